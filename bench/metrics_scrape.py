"""The inference gateway's scrape under load: /metrics on the API port every 50 ms (the endpoint picker's default
--refresh-metrics-interval) while 16 streams decode, against the same load unscraped, alternating.

Per round and mode: 16 gRPC streams (prompt 32, --new-tokens new, greedy, ignore_eos) started together; aggregate
tokens/s; in the scraped mode, each scrape's latency (a fresh connection per scrape, as a cold scraper's; p50, p99,
max) and whether the three gauges the picker reads were present in every answer.

    python bench/metrics_scrape.py [--artifact artifacts/gpt2-int8] [--rounds 3] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from serving_latency import Server, free_port, prompt, stream  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

STREAMS, INTERVAL_S = 16, 0.05
GAUGES = (b"vllm:num_requests_waiting", b"vllm:num_requests_running", b"vllm:kv_cache_usage_perc")


class Scraper(threading.Thread):
    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.latencies, self.complete, self.stop = url, [], 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            started = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=5) as response:
                body = response.read()
            self.latencies.append(time.perf_counter() - started)
            self.complete += all(gauge in body for gauge in GAUGES)
            self.stop.wait(max(0.0, INTERVAL_S - (time.perf_counter() - started)))


async def load(target: str, vocab: int, new_tokens: int, seed: int) -> float:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await stream(stub, prompt(seed, 32, vocab), 4)  # connection and warm-up
        started = time.perf_counter()
        runs = await asyncio.gather(*(stream(stub, prompt(seed + i, 32, vocab), new_tokens) for i in range(STREAMS)))
        return sum(len(r) - 1 for r in runs) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2-int8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--provider", default="cpu", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args()
    vocab = open_artifact(args.artifact).config.vocab_size
    http_port = free_port()
    print(f"# /metrics scraped every {INTERVAL_S * 1e3:.0f} ms under {STREAMS} decoding streams\n\n{describe()}\n")
    print(f"{Path(args.artifact).name}, {args.new_tokens} new tokens a stream, {args.rounds} rounds alternating\n")
    print("| round | mode | tokens/s | scrapes | scrape p50 ms | p99 ms | max ms | with the 3 gauges |\n|---:|---|---:|---:|---:|---:|---:|---:|")
    rates = {"unscraped": [], "scraped": []}
    every_latency = []
    with Server("metrics", args.artifact, args.provider, sys.executable, ["--http-port", str(http_port)]) as server:
        for round_number in range(args.rounds):
            for mode in ("unscraped", "scraped") if round_number % 2 == 0 else ("scraped", "unscraped"):
                scraper = Scraper(f"http://127.0.0.1:{http_port}/metrics") if mode == "scraped" else None
                if scraper:
                    scraper.start()
                rate = asyncio.run(load(server.target, vocab, args.new_tokens, 100 * round_number))
                rates[mode].append(rate)
                if scraper is None:
                    print(f"| {round_number + 1} | {mode} | {rate:.1f} | | | | | |")
                    continue
                scraper.stop.set()
                scraper.join()
                ms = sorted(x * 1e3 for x in scraper.latencies)
                every_latency += ms
                p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
                print(f"| {round_number + 1} | {mode} | {rate:.1f} | {len(ms)} | {statistics.median(ms):.2f} | {p99:.2f} | {ms[-1]:.2f} | "
                      f"{scraper.complete}/{len(ms)} |")
    every_latency.sort()
    p99 = every_latency[min(len(every_latency) - 1, int(0.99 * len(every_latency)))]
    ratio = statistics.mean(rates["scraped"]) / statistics.mean(rates["unscraped"])
    print(f"\nscraped / unscraped tokens/s: {ratio:.3f} (target >= 0.98); scrape p99 over all rounds: {p99:.2f} ms (target < 5)")


if __name__ == "__main__":
    main()
