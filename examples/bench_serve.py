r"""Load benchmark of the generation service (`python -m xstage_dit.serve`), running at --url or launched by the
benchmark (--launch, once per --max-batch: the settings side by side, as ratios to the first): N concurrent
clients, Poisson arrivals at a rate, or Poisson arrivals at multiples of the service's capacity (measured first by
one client in a loop), over a fixed prompt set; with --hostile, each Poisson load again with hostile clients
besides (bad, oversized, past-their-deadline and disconnecting requests), the good requests' latency as ratios to
the run without them. Reports throughput, p50/p90/p99 latency, queue time and the service's own overhead (latency
less queue and pipeline call; of which encoding) of the answered good requests and how many got each status;
writes PREFIX.json and PREFIX.md.

    python examples/bench_serve.py --launch "torchrun --nproc_per_node 1 -m xstage_dit.serve --config flux-dev \
        --queue-bound 4" --wait-ready 900 --size 1024x1024 --steps 28 --capacity-factors 0.5 1 2 --requests 10 \
        --out docs/benchmarks/serve-h200-flux-dev
    python examples/bench_serve.py --launch "torchrun --nproc_per_node 1 -m xstage_dit.serve --config zimage" \
        --max-batch 1 2 --concurrency 4 --requests 12 --size 1024x1024 --steps 8 --out serve-batching
    python examples/bench_serve.py --launch "torchrun --nproc_per_node 1 -m xstage_dit.serve --config flux-dev" \
        --wait-ready 900 --size 1024x1024 --steps 28 --capacity-factors 2 --duration 60 --hostile 1 \
        --out serve-hostile"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from provenance import provenance, write_records
from xstage_dit.runtime.distributed import free_port

PROMPTS = ("a lighthouse on a cliff at dawn", "a red fox in fresh snow", "a city street in the rain at night",
           "a bowl of ramen, studio light", "an astronaut reading in a library", "a sailboat on a calm lake",
           "a mountain village in autumn", "a robot watering plants")
REQUEST_TIMEOUT_S = 3600.0
STOP_S = 120.0  # a launched service's drain after SIGTERM, before it is killed
CLIENTS = 32  # threads sending Poisson arrivals: an arrival waits for one when all are waiting for answers
HOSTILE = ("bad", "oversized", "deadline", "disconnect")  # the hostile clients, sent in turn
HOLD_S = 0.5  # a disconnecting client goes away at its first progress event, or after this long without one
DEADLINE_FACTOR = 1.2  # a past-its-deadline client asks for this times its call's predicted time
GONE = 499  # a disconnecting client's status: it went away before its answer


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it: sent at `sent` (seconds from the run's start), answered `status`."""

    sent: float
    status: int
    latency_s: float
    queue_s: float | None = None
    call_s: float | None = None  # its pipeline call, as the service reports it
    encode_s: float | None = None  # encoding its outputs, as the service reports it
    kind: str = "good"  # or one of HOSTILE
    message: str | None = None  # an error answer's message


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a running service (without --launch)")
    parser.add_argument("--launch", help="the service's command line, without --port and --max-batch: the "
                                         "benchmark starts it on a free port once per --max-batch and stops it "
                                         "with SIGTERM after its runs")
    parser.add_argument("--max-batch", type=int, nargs="+", default=[1],
                        help="with --launch: the service's --max-batch for each launch")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="clients, each sending its next request when answered")
    load.add_argument("--rate", type=float, help="Poisson arrivals, requests per second")
    load.add_argument("--capacity-factors", type=float, nargs="+",
                      help="Poisson arrivals at these multiples of the capacity measured first")
    parser.add_argument("--requests", type=int, default=16, help="requests per run")
    parser.add_argument("--duration", type=float,
                        help="seconds of Poisson arrivals per run (instead of --requests)")
    parser.add_argument("--hostile", type=float,
                        help="with --capacity-factors or --rate: each run again with hostile clients besides, "
                             "arriving at this many times the good requests' rate")
    parser.add_argument("--capacity-requests", type=int, default=4,
                        help="sequential requests that measure the capacity")
    parser.add_argument("--warmup", type=int, default=1,
                        help="requests sent first and not counted (compilation, CUDA graph capture), by as many "
                             "clients as --concurrency (so that batched calls are warmed up too), else by one")
    parser.add_argument("--size", help="WIDTHxHEIGHT (default: the model's)")
    parser.add_argument("--steps", type=int, help="default: the model's")
    parser.add_argument("--seed", type=int, default=0, help="seeds the arrivals and the requests")
    parser.add_argument("--wait-ready", type=float, default=0.0,
                        help="seconds to wait for /health to answer ready (a service still loading)")
    parser.add_argument("--out", type=Path, required=True, help="PREFIX of PREFIX.json and PREFIX.md")
    args = parser.parse_args(argv)
    if args.concurrency is None and args.rate is None and args.capacity_factors is None:
        args.concurrency = 1
    if args.launch is None and args.max_batch != [1]:
        parser.error("--max-batch is the launched service's: it needs --launch")
    if args.hostile is not None and args.concurrency is not None:
        parser.error("--hostile adds Poisson arrivals: it needs --rate or --capacity-factors")
    return args


def wait_ready(client: httpx.Client, seconds: float, service: subprocess.Popen | None = None) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        try:
            health = client.get("/health")
            if health.status_code == 200:
                return health.json()
        except httpx.TransportError:
            pass
        if service is not None and service.poll() is not None:
            raise SystemExit(f"bench_serve: the launched service exited with {service.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_serve: {client.base_url} was not ready within {seconds:.0f} s")
        time.sleep(1.0)


@contextlib.contextmanager
def launched(command: str, max_batch: int) -> Iterator[tuple[str, subprocess.Popen]]:
    """The service of `command` on a free port with `max_batch`: (its URL, its process), stopped afterwards as
    an orchestrator stops it, SIGTERM to its process group (killed if it has not drained within STOP_S)."""
    port = free_port()
    service = subprocess.Popen([*shlex.split(command), "--port", str(port), "--max-batch", str(max_batch)],
                               start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}", service
    finally:
        if service.poll() is None:
            os.killpg(service.pid, signal.SIGTERM)
            try:
                service.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(service.pid, signal.SIGKILL)
                service.wait()


def good_body(args: argparse.Namespace, index: int) -> dict:
    body = {"prompt": PROMPTS[index % len(PROMPTS)], "seed": args.seed + index}
    if args.size:
        body["size"] = args.size
    if args.steps:
        body["num_inference_steps"] = args.steps
    return body


def hostile_body(kind: str, args: argparse.Namespace, index: int, service: dict) -> dict:
    """A hostile client's request: a field of the wrong type or out of range (bad), twice each side of the most
    pixels the model takes (oversized), a deadline just above its call's predicted time, so that it passes
    admission and runs out waiting (deadline), or a good request (disconnect: its client goes away)."""
    if kind == "bad":
        wrong = {"n": "two"} if index // len(HOSTILE) % 2 else {"num_inference_steps": 0}  # every other bad one
        return {**good_body(args, index), **wrong}
    if kind == "oversized":
        side = 2 * max(64, math.isqrt(service.get("max_pixels", 4096 ** 2)) // 64 * 64)
        return {**good_body(args, index), "size": f"{side}x{side}", "num_inference_steps": 1}
    if kind == "deadline":  # at the model's default size, a call's predicted time is its steps' measured cost
        body = good_body(args, index)
        body.pop("size", None)
        predicted = service.get("step_cost", {}).get("seconds", 0.1) * (args.steps or service.get("default_steps", 1))
        body["timeout_s"] = min(DEADLINE_FACTOR * predicted, service.get("max_timeout_s", math.inf))
        return body
    return good_body(args, index)


def send(client: httpx.Client, args: argparse.Namespace, index: int, start: float, kind: str = "good",
         service: dict | None = None) -> Sample:
    body = good_body(args, index) if kind == "good" else hostile_body(kind, args, index, service or {})
    sent = time.monotonic()
    if kind == "disconnect":
        return _go_away(client, body, sent, start)
    response = client.post("/v1/images/generations", json=body)
    latency = time.monotonic() - sent
    queue, call, encode = (response.headers.get(f"x-{name}-seconds") for name in ("queue", "call", "encode"))
    message = response.json().get("error", {}).get("message") if response.status_code != 200 else None
    return Sample(sent - start, response.status_code, latency, *(float(value) if value is not None else None
                                                                 for value in (queue, call, encode)),
                  kind=kind, message=message)


def _go_away(client: httpx.Client, body: dict, sent: float, start: float) -> Sample:
    """Stream `body`'s request and close the connection at its first progress event (its call runs) or after
    HOLD_S without one (it waits): status GONE, or that of an answer that came first."""
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, read=HOLD_S)  # no answer, or no event, for HOLD_S: it goes
    status, message = GONE, None
    with contextlib.suppress(httpx.ReadTimeout), \
            client.stream("POST", "/v1/images/generations", json={**body, "stream": True}, timeout=timeout) as response:
        if response.status_code != 200:
            response.read()
            status, message = response.status_code, response.json().get("error", {}).get("message")
        else:
            for line in response.iter_lines():
                if line.startswith("event: "):
                    status = GONE if line == "event: progress" else 200
                    break
    return Sample(sent - start, status, time.monotonic() - sent, kind="disconnect", message=message)


def closed_loop(client: httpx.Client, args: argparse.Namespace, clients: int, requests: int) -> list[Sample]:
    start, counter = time.monotonic(), iter(range(requests))

    def worker() -> list[Sample]:
        return [send(client, args, index, start) for index in counter]

    with ThreadPoolExecutor(clients) as pool:
        return [s for samples in pool.map(lambda _: worker(), range(clients)) for s in samples]


def arrivals(seed: int, rate: float, requests: int, seconds: float | None) -> list[float]:
    """Poisson arrival times (seconds from the start): `requests` of them, or as many as come within `seconds`."""
    moments, moment, draw = [], 0.0, random.Random(seed)
    while True:
        moment += draw.expovariate(rate)
        if (seconds is not None and moment > seconds) or (seconds is None and len(moments) == requests):
            return moments
        moments.append(moment)


def poisson(client: httpx.Client, args: argparse.Namespace, rate: float, requests: int, hostile_rate: float = 0.0,
            service: dict | None = None) -> list[Sample]:
    """Good requests arriving at `rate` (the same arrivals whatever the hostile load), and hostile ones besides at
    `hostile_rate`, each kind in turn, over the same span; sent by at most CLIENTS threads at once."""
    good = arrivals(args.seed, rate, requests, args.duration)
    hostile = arrivals(args.seed + 1, hostile_rate, 0, args.duration or (good[-1] if good else 0.0)) \
        if hostile_rate > 0 else []
    plan = sorted([(moment, index, "good") for index, moment in enumerate(good)]
                  + [(moment, index, HOSTILE[index % len(HOSTILE)]) for index, moment in enumerate(hostile)])
    start = time.monotonic()

    def arrive(item: tuple[float, int, str]) -> Sample:
        moment, index, kind = item
        time.sleep(max(0.0, start + moment - time.monotonic()))
        return send(client, args, index, start, kind, service)

    with ThreadPoolExecutor(max(1, min(len(plan), CLIENTS))) as pool:
        return list(pool.map(arrive, plan))


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(ordered)}


def _statuses(samples: list[Sample]) -> dict[str, int]:
    statuses: dict[str, int] = {}
    for s in samples:
        statuses[str(s.status)] = statuses.get(str(s.status), 0) + 1
    return statuses


def summary(samples: list[Sample], load: dict) -> dict:
    """The good requests' numbers (a good request lost: answered anything but 200 or 429), and the hostile
    requests' statuses by kind."""
    hostile = {kind: _statuses([s for s in samples if s.kind == kind]) for kind in HOSTILE
               if any(s.kind == kind for s in samples)}
    samples = [s for s in samples if s.kind == "good"]
    answered = [s for s in samples if s.status == 200]
    statuses = _statuses(samples)
    span = max(s.sent + s.latency_s for s in samples) - min(s.sent for s in samples)
    lost = sum(count for status, count in statuses.items() if status not in ("200", "429"))
    return {**load, "requests": len(samples), "answered": statuses, "lost": lost, **({"hostile": hostile}
                                                                                      if hostile else {}),
            "throughput_rps": len(answered) / span if span > 0 else 0.0,
            "latency_s": _percentiles([s.latency_s for s in answered]),
            "queue_s": _percentiles([s.queue_s for s in answered if s.queue_s is not None]),
            # what the service adds to a request besides its wait and its call: HTTP, broadcast, encoding
            "overhead_s": _percentiles([s.latency_s - s.queue_s - s.call_s for s in answered
                                        if s.queue_s is not None and s.call_s is not None]),
            "encode_s": _percentiles([s.encode_s for s in answered if s.encode_s is not None])}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.launch is None:
        records = measure(args.url, args)
    else:
        records = []
        for max_batch in args.max_batch:
            with launched(args.launch, max_batch) as (url, service):
                records += measure(url, args, service)
    write_records(records, args.out, "Generation service under load",
                  "Latency: from sending a request to its answer, as the client saw it; queue: from admission to "
                  "the start of the request's pipeline call, as the service reports it (x-queue-seconds); "
                  "overhead: latency less queue less the pipeline call as rank 0 timed it (x-call-seconds, with "
                  "building the call's inputs), i.e. HTTP, validation, the broadcast to the ranks and encoding, "
                  "of which encoding the outputs (x-encode-seconds); all over the requests answered 200. "
                  "Throughput: answered requests per second from the first send to the last answer. The capacity "
                  "row is one client in a loop; the Poisson rows offer that many times its throughput. p99 target: "
                  "the queue bound times the capacity row's time per request, + 10 %. Answered: requests by HTTP "
                  "status (a request lost would be anything but 200 or 429). Ratios: each max batch's row against "
                  "the same load at the first one's. Hostile rows: the same good arrivals with hostile clients "
                  "besides (bad, oversized, past-their-deadline and disconnecting requests, in turn; their "
                  f"statuses by kind, {GONE} for a client that went away), their good requests' latency against "
                  "the run without them. The service (its max batch: each row's): "
                  f"{json.dumps(records[0]['service'])}.", table(records) + ratios(records) + hostile_ratios(records))


def measure(url: str, args: argparse.Namespace, service: subprocess.Popen | None = None) -> list[dict]:
    """The runs the arguments ask for against the service at `url` (launched as `service`, if it was)."""
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S,
                      limits=httpx.Limits(max_connections=max(args.requests, 8) + 4)) as client:
        health = wait_ready(client, args.wait_ready, service)
        [model] = client.get("/v1/models").json()["data"]
        closed_loop(client, args, args.concurrency or 1, args.warmup)
        runs: list[dict] = []
        if args.concurrency is not None:
            runs.append(summary(closed_loop(client, args, args.concurrency, args.requests),
                                {"load": f"{args.concurrency} concurrent client(s)"}))
        elif args.rate is not None:
            runs += poisson_runs(client, args, args.rate, {"load": f"Poisson {args.rate:.3g}/s"}, model["service"])
        else:
            measured = summary(closed_loop(client, args, 1, args.capacity_requests), {"load": "capacity"})
            capacity = measured["throughput_rps"]
            runs.append(measured)
            # the bound on an admitted request under overload: the queue's bound of calls before it, + 10 %
            target = 1.1 * model["service"]["queue_bound"] / capacity
            for factor in args.capacity_factors:
                runs += poisson_runs(client, args, factor * capacity,
                                     {"load": f"Poisson {factor:g}x capacity", "p99_target_s": target},
                                     model["service"])
    common = {**provenance(), "ranks": health["ranks"], "model": health["model"], "size": args.size,
              "steps": args.steps, "service": model["service"], "max_batch": model["service"]["max_batch"]}
    return [{**common, **run} for run in runs]


def poisson_runs(client: httpx.Client, args: argparse.Namespace, rate: float, load: dict, service: dict
                 ) -> list[dict]:
    """Good requests at `rate`; with --hostile, again with hostile clients besides."""
    runs = [summary(poisson(client, args, rate, args.requests), {**load, "rate_rps": rate})]
    if args.hostile is not None:
        samples = poisson(client, args, rate, args.requests, args.hostile * rate, service)
        runs.append(summary(samples, {**load, "load": f"{load['load']} + hostile {args.hostile:g}x", "rate_rps": rate,
                                      "hostile_rate_rps": args.hostile * rate, "clean_load": load["load"]}))
    return runs


def table(records: list[dict]) -> list[str]:
    lines = ["| max batch | load | requests | answered | throughput (req/s) | latency p50 / p90 / p99 (s) | "
             "p99 target (s) | queue p50 / p99 (s) | overhead p50 (s, % of latency) | of which encoding p50 (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        latency, queue, overhead, encode = r["latency_s"], r["queue_s"], r["overhead_s"], r.get("encode_s")
        answered = ", ".join(f"{status}: {count}" for status, count in sorted(r["answered"].items()))
        lines.append(f"| {r['max_batch']} | {r['load']} | {r['requests']} | {answered} | {r['throughput_rps']:.3f} | "
                     + (f"{latency['p50']:.3f} / {latency['p90']:.3f} / {latency['p99']:.3f}" if latency else "-")
                     + " | " + (f"{r['p99_target_s']:.3f}" if "p99_target_s" in r else "-")
                     + " | " + (f"{queue['p50']:.3f} / {queue['p99']:.3f}" if queue else "-")
                     + " | " + (f"{overhead['p50']:.4f} ({100 * overhead['p50'] / latency['p50']:.2f} %)"
                                if overhead else "-")
                     + " | " + (f"{encode['p50']:.4f}" if encode else "-") + " |")
    return lines


def ratios(records: list[dict]) -> list[str]:
    """Each later max batch's throughput and p50 latency over the first max batch's, load by load."""
    first = records[0]["max_batch"]
    baseline = {r["load"]: r for r in records if r["max_batch"] == first}
    rows = [(r, baseline[r["load"]]) for r in records if r["max_batch"] != first and r["load"] in baseline]
    if not rows:
        return []
    lines = ["", f"Against max batch {first}:", "",
             "| max batch | load | throughput ratio | latency p50 ratio |", "|---|---|---|---|"]
    for r, base in rows:
        throughput = r["throughput_rps"] / base["throughput_rps"] if base["throughput_rps"] else float("nan")
        latency = r["latency_s"]["p50"] / base["latency_s"]["p50"] if r["latency_s"] and base["latency_s"] \
            else float("nan")
        lines.append(f"| {r['max_batch']} | {r['load']} | {throughput:.3f} | {latency:.3f} |")
    return lines


def hostile_ratios(records: list[dict]) -> list[str]:
    """Each hostile run's good requests against the same load without hostile clients: latency p50 and p99 ratios,
    good requests lost, and the hostile requests' statuses."""
    clean = {(r["max_batch"], r["load"]): r for r in records if "clean_load" not in r}
    rows = [(r, clean[(r["max_batch"], r["clean_load"])]) for r in records
            if "clean_load" in r and (r["max_batch"], r["clean_load"]) in clean]
    if not rows:
        return []
    lines = ["", "With hostile clients, against the same good load without them:", "",
             "| max batch | load | good lost | latency p50 ratio | latency p99 ratio | hostile statuses |",
             "|---|---|---|---|---|---|"]
    for r, base in rows:
        p50, p99 = ((r["latency_s"][q] / base["latency_s"][q] if r["latency_s"] and base["latency_s"]
                     else float("nan")) for q in ("p50", "p99"))
        hostile = "; ".join(f"{kind}: " + ", ".join(f"{status} x{count}" for status, count in sorted(counts.items()))
                            for kind, counts in r.get("hostile", {}).items())
        lines.append(f"| {r['max_batch']} | {r['load']} | {r['lost']} | {p50:.3f} | {p99:.3f} | {hostile} |")
    return lines


if __name__ == "__main__":
    main()
