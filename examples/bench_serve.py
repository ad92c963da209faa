r"""Load benchmark of a running generation service (`python -m xstage_dit.serve`): N concurrent clients, Poisson
arrivals at a rate, or Poisson arrivals at multiples of the service's capacity (measured first by one client in a
loop), over a fixed prompt set. Reports throughput, p50/p90/p99 latency and queue time of the answered requests
and how many got each status; writes PREFIX.json and PREFIX.md.

    torchrun --nproc_per_node 1 -m xstage_dit.serve --config flux-dev --port 8000 &
    python examples/bench_serve.py --url http://127.0.0.1:8000 --wait-ready 900 --steps 28 \
        --capacity-factors 0.5 1 2 --requests 16 --out docs/benchmarks/serve-h200-flux-dev"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from provenance import provenance, write_records

PROMPTS = ("a lighthouse on a cliff at dawn", "a red fox in fresh snow", "a city street in the rain at night",
           "a bowl of ramen, studio light", "an astronaut reading in a library", "a sailboat on a calm lake",
           "a mountain village in autumn", "a robot watering plants")
REQUEST_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it: sent at `sent` (seconds from the run's start), answered `status`."""

    sent: float
    status: int
    latency_s: float
    queue_s: float | None
    call_s: float | None  # its pipeline call, as the service reports it


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="clients, each sending its next request when answered")
    load.add_argument("--rate", type=float, help="Poisson arrivals, requests per second")
    load.add_argument("--capacity-factors", type=float, nargs="+",
                      help="Poisson arrivals at these multiples of the capacity measured first")
    parser.add_argument("--requests", type=int, default=16, help="requests per run")
    parser.add_argument("--capacity-requests", type=int, default=4,
                        help="sequential requests that measure the capacity")
    parser.add_argument("--warmup", type=int, default=1,
                        help="sequential requests sent first and not counted (compilation, CUDA graph capture)")
    parser.add_argument("--size", help="WIDTHxHEIGHT (default: the model's)")
    parser.add_argument("--steps", type=int, help="default: the model's")
    parser.add_argument("--seed", type=int, default=0, help="seeds the arrivals and the requests")
    parser.add_argument("--wait-ready", type=float, default=0.0,
                        help="seconds to wait for /health to answer ready (a service still loading)")
    parser.add_argument("--out", type=Path, required=True, help="PREFIX of PREFIX.json and PREFIX.md")
    args = parser.parse_args(argv)
    if args.concurrency is None and args.rate is None and args.capacity_factors is None:
        args.concurrency = 1
    return args


def wait_ready(client: httpx.Client, seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        try:
            health = client.get("/health")
            if health.status_code == 200:
                return health.json()
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_serve: {client.base_url} was not ready within {seconds:.0f} s")
        time.sleep(1.0)


def send(client: httpx.Client, args: argparse.Namespace, index: int, start: float) -> Sample:
    body = {"prompt": PROMPTS[index % len(PROMPTS)], "seed": args.seed + index}
    if args.size:
        body["size"] = args.size
    if args.steps:
        body["num_inference_steps"] = args.steps
    sent = time.monotonic()
    response = client.post("/v1/images/generations", json=body)
    latency = time.monotonic() - sent
    queue, call = (response.headers.get(f"x-{name}-seconds") for name in ("queue", "call"))
    return Sample(sent - start, response.status_code, latency, float(queue) if queue is not None else None,
                  float(call) if call is not None else None)


def closed_loop(client: httpx.Client, args: argparse.Namespace, clients: int, requests: int) -> list[Sample]:
    start, counter = time.monotonic(), iter(range(requests))

    def worker() -> list[Sample]:
        return [send(client, args, index, start) for index in counter]

    with ThreadPoolExecutor(clients) as pool:
        return [s for samples in pool.map(lambda _: worker(), range(clients)) for s in samples]


def poisson(client: httpx.Client, args: argparse.Namespace, rate: float, requests: int) -> list[Sample]:
    arrivals, moment = [], 0.0
    draw = random.Random(args.seed)
    for _ in range(requests):
        moment += draw.expovariate(rate)
        arrivals.append(moment)
    start = time.monotonic()

    def arrive(index: int) -> Sample:
        time.sleep(max(0.0, start + arrivals[index] - time.monotonic()))
        return send(client, args, index, start)

    with ThreadPoolExecutor(requests) as pool:
        return list(pool.map(arrive, range(requests)))


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(ordered)}


def summary(samples: list[Sample], load: dict) -> dict:
    answered = [s for s in samples if s.status == 200]
    statuses: dict[str, int] = {}
    for s in samples:
        statuses[str(s.status)] = statuses.get(str(s.status), 0) + 1
    span = max(s.sent + s.latency_s for s in samples) - min(s.sent for s in samples)
    lost = sum(count for status, count in statuses.items() if status not in ("200", "429"))
    return {**load, "requests": len(samples), "answered": statuses, "lost": lost,
            "throughput_rps": len(answered) / span if span > 0 else 0.0,
            "latency_s": _percentiles([s.latency_s for s in answered]),
            "queue_s": _percentiles([s.queue_s for s in answered if s.queue_s is not None]),
            # what the service adds to a request that does not wait: HTTP, queue, broadcast, encoding
            "overhead_s": _percentiles([s.latency_s - s.queue_s - s.call_s for s in answered
                                        if s.queue_s is not None and s.call_s is not None])}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with httpx.Client(base_url=args.url, timeout=REQUEST_TIMEOUT_S,
                      limits=httpx.Limits(max_connections=max(args.requests, 8) + 4)) as client:
        health = wait_ready(client, args.wait_ready)
        [model] = client.get("/v1/models").json()["data"]
        for index in range(args.warmup):
            send(client, args, index, time.monotonic())
        runs: list[dict] = []
        if args.concurrency is not None:
            runs.append(summary(closed_loop(client, args, args.concurrency, args.requests),
                                {"load": f"{args.concurrency} concurrent client(s)"}))
        elif args.rate is not None:
            runs.append(summary(poisson(client, args, args.rate, args.requests),
                                {"load": f"Poisson {args.rate:.3g}/s", "rate_rps": args.rate}))
        else:
            measured = summary(closed_loop(client, args, 1, args.capacity_requests), {"load": "capacity"})
            capacity = measured["throughput_rps"]
            runs.append(measured)
            # the bound on an admitted request under overload: the queue's bound of calls before it, + 10 %
            target = 1.1 * model["service"]["queue_bound"] / capacity
            for factor in args.capacity_factors:
                runs.append(summary(poisson(client, args, factor * capacity, args.requests),
                                    {"load": f"Poisson {factor:g}x capacity", "rate_rps": factor * capacity,
                                     "p99_target_s": target}))
    common = {**provenance(), "ranks": health["ranks"], "model": health["model"], "size": args.size,
              "steps": args.steps, "service": model["service"]}
    records = [{**common, **run} for run in runs]
    write_records(records, args.out, "Generation service under load",
                  "Latency: from sending a request to its answer, as the client saw it; queue: from admission to "
                  "the start of the request's pipeline call, as the service reports it (x-queue-seconds); "
                  "overhead: latency less queue less the pipeline call (x-call-seconds), i.e. HTTP, validation, "
                  "the broadcast to the ranks and encoding; all over the requests answered 200. Throughput: "
                  "answered requests per second from the first send to the last answer. The capacity row is one "
                  "client in a loop; the Poisson rows offer that many times its throughput. p99 target: the queue "
                  "bound times the capacity row's time per request, + 10 %. Answered: requests by HTTP status (a "
                  "request lost would be anything but 200 or 429). The service: "
                  f"{json.dumps(model['service'])}.", table(records))


def table(records: list[dict]) -> list[str]:
    lines = ["| load | requests | answered | throughput (req/s) | latency p50 / p90 / p99 (s) | p99 target (s) | "
             "queue p50 / p99 (s) | overhead p50 (s, % of latency) |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        latency, queue, overhead = r["latency_s"], r["queue_s"], r["overhead_s"]
        answered = ", ".join(f"{status}: {count}" for status, count in sorted(r["answered"].items()))
        lines.append(f"| {r['load']} | {r['requests']} | {answered} | {r['throughput_rps']:.3f} | "
                     + (f"{latency['p50']:.3f} / {latency['p90']:.3f} / {latency['p99']:.3f}" if latency else "-")
                     + " | " + (f"{r['p99_target_s']:.3f}" if "p99_target_s" in r else "-")
                     + " | " + (f"{queue['p50']:.3f} / {queue['p99']:.3f}" if queue else "-")
                     + " | " + (f"{overhead['p50']:.4f} ({100 * overhead['p50'] / latency['p50']:.2f} %)"
                                if overhead else "-") + " |")
    return lines


if __name__ == "__main__":
    main()
