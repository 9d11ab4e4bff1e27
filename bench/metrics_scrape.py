"""The inference gateway's scrape under load: /metrics every 50 ms (the endpoint picker's default
--refresh-metrics-interval) while 16 streams decode, against the same load unscraped, in one run, the modes' order
rotated each round: the HTTP API port, the gauges' own process (--gateway-metrics-port) and a stand-in static server,
which is what scraping costs this machine whatever answers (--ports picks).

Per round and mode: 16 gRPC streams (prompt 32, --new-tokens new, greedy, ignore_eos) started together; aggregate
tokens/s; in a scraped mode, each scrape's latency (p50, p99, max) over one kept-alive connection, as the picker's
Go HTTP client scrapes (--fresh-connections: a new one each time), and whether the three gauges the picker reads were
present in every answer. First, in this process, what rendering each exposition costs: the gateway's three gauges (the
API port's /metrics) and the whole registry (the metrics port's), after a load's worth of samples. The scraper is a process of its own, as the picker is: in this one its thread would wait for
the GIL behind the 16 streams' client and count that wait as the server's.

    python bench/metrics_scrape.py [--artifact artifacts/gpt2-int8] [--rounds 3] [--new-tokens 128] [--ports api,gateway,stand-in]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from prometheus_client import generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from serving_latency import Server, free_port, prompt, stream  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

STREAMS, INTERVAL_S = 16, 0.05
GAUGES = (b"vllm:num_requests_waiting", b"vllm:num_requests_running", b"vllm:kv_cache_usage_perc")


def render_costs() -> dict[str, float]:
    """Median ms to render the gateway's gauges and the whole registry, each filled as after a busy minute."""
    from kvserve.service.edges.metrics import Metrics

    metrics = Metrics()
    metrics.set_rows(STREAMS)
    for method in ("Generate", "Completions", "ChatCompletions", "GetModelInfo"):
        for code in ("OK", "CANCELLED", "INVALID_ARGUMENT"):
            metrics.on_request(method, code)
    for i in range(1000):
        metrics.on_token(0, None if i % 64 == 0 else 1, 2_000_000)
        metrics.on_step(STREAMS, STREAMS, 3, 1 << 30, 2)
    metrics.on_prompt(32, 32)
    metrics.execution_provider.labels(provider="CPUExecutionProvider").set(1)

    def median_ms(render) -> float:
        times = []
        for _ in range(2000):
            started = time.perf_counter()
            render()
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)

    return {"gateway": median_ms(metrics.gateway_exposition), "whole": median_ms(lambda: generate_latest(metrics.registry))}


def scrape_until_interrupted(port: int, fresh: bool) -> None:
    """The scraper process: GET /metrics every INTERVAL_S until SIGINT, then print its latencies and counts as JSON."""
    stopped = []
    signal.signal(signal.SIGINT, lambda *_: stopped.append(True))
    latencies, complete, connection = [], 0, None
    while not stopped:
        started = time.perf_counter()
        if connection is None or fresh:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", "/metrics")
        body = connection.getresponse().read()
        if fresh:
            connection.close()
        latencies.append(time.perf_counter() - started)
        complete += all(gauge in body for gauge in GAUGES)
        time.sleep(max(0.0, INTERVAL_S - (time.perf_counter() - started)))
    print(json.dumps({"latencies": latencies, "complete": complete}))


class Scraper:
    def __init__(self, port: int, fresh: bool):
        self.port, self.fresh = port, fresh

    def start(self):
        self.process = subprocess.Popen([sys.executable, __file__, "--scrape", str(self.port), *(["--fresh-connections"] if self.fresh else [])],
                                        stdout=subprocess.PIPE, text=True)

    def finish(self):
        self.process.send_signal(signal.SIGINT)
        result = json.loads(self.process.communicate(timeout=30)[0])
        self.latencies, self.complete = result["latencies"], result["complete"]


async def load(target: str, vocab: int, new_tokens: int, seed: int) -> float:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await stream(stub, prompt(seed, 32, vocab), 4)  # connection and warm-up
        started = time.perf_counter()
        runs = await asyncio.gather(*(stream(stub, prompt(seed + i, 32, vocab), new_tokens) for i in range(STREAMS)))
        return sum(len(r) - 1 for r in runs) / (time.perf_counter() - started)


PORTS = {"api": "the HTTP API's /metrics (the pool's target port: the picker's default)",
         "gateway": "--gateway-metrics-port's (the gauges' own process)",
         "metrics": "--metrics-port's (the whole registry)",
         "stand-in": "a static file server answering the same bytes: what the scraper and a minimal server cost this machine"}


def percentile_99(ms: list[float]) -> float:
    ms = sorted(ms)
    return ms[min(len(ms) - 1, int(0.99 * len(ms)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2-int8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--provider", default="cpu", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--fresh-connections", action="store_true", help="a new connection a scrape (default: one kept alive)")
    parser.add_argument("--ports", default="api,gateway,stand-in",
                        help="what to scrape, comma-separated, each a mode of its own in every round beside the unscraped load: "
                        + "; ".join(f"{name}: {what}" for name, what in PORTS.items()))
    parser.add_argument("--scrape", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the scraper process's own entry
    args = parser.parse_args()
    if args.scrape:
        return scrape_until_interrupted(args.scrape, args.fresh_connections)
    scraped = args.ports.split(",")
    if not scraped or any(name not in PORTS for name in scraped):
        parser.error(f"--ports: each of {', '.join(PORTS)}")
    vocab = open_artifact(args.artifact).config.vocab_size
    ports = {name: free_port() for name in PORTS}
    ports["http"] = ports.pop("api")
    print(f"# /metrics scraped every {INTERVAL_S * 1e3:.0f} ms under {STREAMS} decoding streams\n\n{describe()}\n")
    connections = "a new connection a scrape" if args.fresh_connections else "one connection kept alive"
    print(f"{Path(args.artifact).name}, {args.new_tokens} new tokens a stream, {args.rounds} rounds, the modes' order rotated each "
          f"round, {connections}; scraped: " + "; ".join(f"{name}, {PORTS[name]}" for name in scraped) + "\n")
    costs = render_costs()
    print(f"render, median of 2,000 in this process: the gateway's three gauges {costs['gateway']:.3f} ms, the whole registry "
          f"{costs['whole']:.3f} ms\n")
    print("| round | mode | tokens/s | scrapes | scrape p50 ms | p99 ms | max ms | with the 3 gauges |\n|---:|---|---:|---:|---:|---:|---:|---:|")
    modes = ["unscraped", *scraped]
    rates = {mode: [] for mode in modes}
    latencies = {mode: [] for mode in scraped}
    stand_in = None
    if "stand-in" in scraped:
        directory = tempfile.mkdtemp()
        Path(directory, "metrics").write_bytes(b"".join(b"# TYPE %s gauge\n%s 0.0\n" % (g, g) for g in GAUGES))
        stand_in = subprocess.Popen([sys.executable, "-m", "http.server", str(ports["stand-in"]), "--bind", "127.0.0.1", "--directory", directory],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
    served = ["--http-port", str(ports["http"]), "--metrics-port", str(ports["metrics"]), "--gateway-metrics-port", str(ports["gateway"])]
    with Server("metrics", args.artifact, args.provider, sys.executable, served) as server:
        for round_number in range(args.rounds):
            shift = round_number % len(modes)
            for index, mode in enumerate(modes[shift:] + modes[:shift]):
                scraper = None if mode == "unscraped" else Scraper(ports["http" if mode == "api" else mode], args.fresh_connections)
                if scraper:
                    scraper.start()
                # prompts of their own: the prompt cache would speed up a run whose prompts an earlier one sent
                rate = asyncio.run(load(server.target, vocab, args.new_tokens, 1000 * round_number + 100 * index))
                rates[mode].append(rate)
                if scraper is None:
                    print(f"| {round_number + 1} | {mode} | {rate:.1f} | | | | | |")
                    continue
                scraper.finish()
                ms = sorted(x * 1e3 for x in scraper.latencies)
                latencies[mode] += ms
                print(f"| {round_number + 1} | {mode} | {rate:.1f} | {len(ms)} | {statistics.median(ms):.2f} | {percentile_99(ms):.2f} | "
                      f"{ms[-1]:.2f} | {scraper.complete}/{len(ms)} |")
    if stand_in is not None:
        stand_in.terminate()
    unscraped = statistics.mean(rates["unscraped"])
    print("\n| scraped | tokens/s scraped / unscraped (target >= 0.98) | scrape p50 ms | p99 ms, all rounds (target < 5) |\n|---|---:|---:|---:|")
    for mode in scraped:
        print(f"| {mode} | {statistics.mean(rates[mode]) / unscraped:.3f} | {statistics.median(latencies[mode]):.2f} | "
              f"{percentile_99(latencies[mode]):.2f} |")


if __name__ == "__main__":
    main()
