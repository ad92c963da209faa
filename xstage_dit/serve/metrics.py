"""The service's Prometheus metrics, in a registry of its own: queue depth, requests by outcome, latency, queue
time, step time, encoding time, batch size and the symmetric memory this rank holds."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..sp.fabric import symmetric_bytes_held

OUTCOMES = ("ok", "invalid", "rejected", "unavailable", "failed", "dropped", "cancelled", "deadline")
_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
_STEP_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)


class ServiceMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.queue_depth = Gauge("xstage_queue_depth", "requests waiting", registry=self.registry)
        self.requests = Counter("xstage_requests", "requests answered, by outcome: ok (200), invalid (400/404/422), "
                                "rejected (429: queue full), unavailable (503), failed (500), dropped (client gone "
                                "before its request started), cancelled (client gone during its call, which stopped "
                                "if no other request was in it), deadline (504: past its timeout_s, waiting or in "
                                "its call)", ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.latency = Histogram("xstage_request_seconds", "admission to the end of the pipeline call, of requests "
                                 "answered 200 (encoding not included)",
                                 buckets=_SECONDS, registry=self.registry)
        self.queue_time = Histogram("xstage_queue_seconds", "admission to the start of the request's call",
                                    buckets=_SECONDS, registry=self.registry)
        self.step_time = Histogram("xstage_step_seconds", "one denoising step of a pipeline call, between the "
                                   "host's step ends (the GPU's step time once its queue is full)",
                                   buckets=_STEP_SECONDS, registry=self.registry)
        self.encode_time = Histogram("xstage_encode_seconds", "encoding one request's outputs (PNG or MP4), in "
                                     "the HTTP thread while the ranks run the next call",
                                     buckets=_STEP_SECONDS, registry=self.registry)
        self.batch_size = Histogram("xstage_batch_outputs", "outputs made by one pipeline call",
                                    buckets=(1, 2, 4, 8, 16, 32), registry=self.registry)
        self.symmetric_memory = Gauge("xstage_symmetric_memory_bytes", "symmetric memory rank 0's fabrics hold "
                                      "(their workspaces, grown to the largest call's need; 0 without a fabric)",
                                      registry=self.registry)
        self.symmetric_memory.set_function(symmetric_bytes_held)

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
