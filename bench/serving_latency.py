"""Speed per stream under load, two servers timed in turn in one run: tail latency, interference from a long
prompt, time to first token, and how aggregate throughput scales. Made for comparing the serving core
before and after a change (a baseline checkout of kvserve against this one), or two artifacts.

Scenarios (greedy, ignore_eos; each server `--max-batch-size 16`):
  staggered    16 streams starting 0-1 s apart, 2 requests each (prompt 32, 64 new): aggregate tokens/s and
               inter-token latency p50 / p99
  lockstep     the same 16 streams started together with 1-token prompts: gaps with no prompt work beside them, so
               their p99 / p50 is this machine's and the gRPC path's own jitter, the floor under staggered's
  long-prompt  8 streams decoding (prompt 32, 160 new) when a 900-token prompt arrives: the 8 streams' median
               and longest gap, and the long prompt's time to first token
  ttft-1000    a lone 1,000-token prompt (1 new token) on an idle server: time to first token, best of 3
  scaling      16 concurrent streams vs 1 (prompt 32, 64 new, 2 requests per stream): aggregate tokens/s

    python bench/serving_latency.py --new ARTIFACT [--baseline ARTIFACT [--baseline-python PYTHON]] [--rounds 2]
                                    [--provider cpu] [--new-args "--step-token-budget 32"]

--baseline-python runs the baseline server with another environment's interpreter, one where another checkout of
kvserve is installed, so old and new code are timed alternately on one machine:

    git worktree add /tmp/old <commit> && cd /tmp/old && python3 -m venv .venv \
      && .venv/bin/pip install -c constraints.txt -e . grpcio-tools==1.85.1 && make proto BIN=.venv/bin

Each server is ready when its health service says SERVING (asked, as `kvserve health` asks), on a port picked here.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

from kvserve.v1 import generation_pb2 as pb  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

TIME_CAP_S = 300


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


async def stream(stub, ids: list[int], new_tokens: int) -> list[float]:
    """Arrival time of the request, then of every token (perf_counter seconds)."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=new_tokens, ignore_eos=True)
    stamps = [time.perf_counter()]
    async for _ in stub.Generate(request, timeout=TIME_CAP_S):
        stamps.append(time.perf_counter())
    return stamps


def gaps(stamps: list[float]) -> list[float]:
    return list(np.diff(stamps[1:]))  # between tokens: the first token's wait is time to first token


async def staggered_load(request, vocab: int, spread_s: float = 1.0, prompt_tokens: int = 32) -> tuple[list[list[float]], float]:
    """The staggered scenario's requests (16 streams starting spread_s apart in all, 2 requests each, 64 new tokens),
    each through request(ids, new_tokens) -> [arrival, every token's time]: every request's stamps and the seconds
    the whole load took."""
    runs = []

    async def worker(w: int):
        await asyncio.sleep(w * spread_s / 15)
        for k in range(2):
            runs.append(await request(prompt(100 * w + k, prompt_tokens, vocab), 64))

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(16)))
    return runs, time.perf_counter() - start


def gap_summary(runs: list[list[float]], elapsed: float) -> dict:
    """Aggregate tokens/s and the inter-token gaps' p50 / p99 of requests' stamps (stream's) over elapsed seconds."""
    itl = [gap for stamps in runs for gap in gaps(stamps)]
    p50, p99 = np.percentile(itl, 50) * 1e3, np.percentile(itl, 99) * 1e3
    return {"tokens/s": sum(len(stamps) - 1 for stamps in runs) / elapsed, "ITL p50 ms": p50, "ITL p99 ms": p99, "p99/p50": p99 / p50}


async def staggered(stub, vocab: int) -> dict:
    return gap_summary(*await staggered_load(lambda ids, new_tokens: stream(stub, ids, new_tokens), vocab))


async def lockstep(stub, vocab: int) -> dict:
    return gap_summary(*await staggered_load(lambda ids, new_tokens: stream(stub, ids, new_tokens), vocab, spread_s=0, prompt_tokens=1))


async def long_prompt(stub, vocab: int) -> dict:
    streams = [asyncio.create_task(stream(stub, prompt(200 + w, 32, vocab), 160)) for w in range(8)]
    await asyncio.sleep(1.5)  # all 8 are decoding
    long = await stream(stub, prompt(999, 900, vocab), 4)
    decode = await asyncio.gather(*streams)
    arrival = long[0]
    # the decoding streams' gaps from the long prompt's arrival on (their steady state before it is not the question)
    observed = [g for s in decode for a, g in zip(s[2:], gaps(s)) if a >= arrival]
    every = [g for s in decode for g in gaps(s)]
    median = statistics.median(every)
    return {"median gap ms": median * 1e3, "longest gap ms": max(observed) * 1e3, "longest/median": max(observed) / median,
            "long prompt TTFT ms": (long[1] - long[0]) * 1e3}


async def ttft_1000(stub, vocab: int) -> dict:
    best = min([(s[1] - s[0]) for s in [await stream(stub, prompt(300 + k, 1000, vocab), 1) for k in range(3)]])
    return {"TTFT ms": best * 1e3}


async def scaling(stub, vocab: int) -> dict:
    async def level(concurrency: int) -> float:
        tokens = 0

        async def worker(w: int):
            nonlocal tokens
            for k in range(2):
                stamps = await stream(stub, prompt(400 + 10 * w + k, 32, vocab), 64)
                tokens += len(stamps) - 1  # after the await: += across it would lose the other workers' counts

        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return tokens / (time.perf_counter() - start)

    one, sixteen = await level(1), await level(16)
    return {"c1 tokens/s": one, "c16 tokens/s": sixteen, "c16/c1": sixteen / one}


SCENARIOS = {"staggered": staggered, "lockstep": lockstep, "long-prompt": long_prompt, "ttft-1000": ttft_1000, "scaling": scaling}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def serving_status(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="kvserve.v1.GenerationService"), timeout=2)
        return reply.status


def wait_until_serving(process: subprocess.Popen, target: str, timeout_s: float = 600) -> bool:
    """Poll the server's health service until SERVING; False if the process ends or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if asyncio.run(serving_status(target)) == health_pb2.HealthCheckResponse.SERVING:
                return True
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    return False


class Server:
    def __init__(self, name: str, artifact: str, provider: str, python: str, extra: list[str]):
        self.name, self.provider, self.python, self.extra = name, provider, python, extra
        self.artifact = str(Path(artifact).resolve())  # the server runs outside this checkout

    def __enter__(self):
        port = free_port()
        self.target = f"127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [self.python, "-m", "kvserve.cli", "serve", "--model", self.artifact, "--port", str(port), "--provider", self.provider,
             "--max-batch-size", "16", "--max-queue", "64", *self.extra],
            stderr=self.log, cwd=tempfile.gettempdir(),  # not a checkout: the interpreter's own installed kvserve is the one run
        )
        if wait_until_serving(self.process, self.target):
            return self
        self.process.kill()
        self.log.seek(0)
        lines = self.log.read().strip().splitlines()
        sys.exit(f"{self.name}: the server did not start: {lines[-1] if lines else 'no output'}")

    def __exit__(self, *exc):
        self.process.terminate()
        self.process.wait(60)
        self.log.close()

    async def run(self, scenario, vocab: int) -> dict:
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            await stream(stub, prompt(0, 32, vocab), 4)  # connection and warm-up
            return await scenario(stub, vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new", required=True, help="artifact served by this checkout")
    parser.add_argument("--new-args", default="", help="extra `kvserve serve` flags for it")
    parser.add_argument("--baseline", help="artifact for the baseline server")
    parser.add_argument("--baseline-python", default=sys.executable,
                        help="the interpreter of an environment where the baseline's kvserve is installed (default: this one's)")
    parser.add_argument("--baseline-args", default="")
    parser.add_argument("--provider", default="cpu", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=2, help="each scenario runs this many times per server, alternating")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    unknown = [name for name in args.scenarios.split(",") if name not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(unknown)} (choose from {', '.join(SCENARIOS)})")
    probe = subprocess.run([args.baseline_python, "-c", "import kvserve.cli, kvserve.v1.generation_pb2"], capture_output=True,
                           cwd=tempfile.gettempdir())
    if probe.returncode != 0:
        parser.error(f"--baseline-python {args.baseline_python}: no installed kvserve with generated stubs there")
    from kvserve.contract.artifact import open_artifact

    config = open_artifact(args.new).config
    servers = [Server("new", args.new, args.provider, sys.executable, shlex.split(args.new_args))]
    if args.baseline:
        servers.insert(0, Server("baseline", args.baseline, args.provider, args.baseline_python, shlex.split(args.baseline_args)))
    results: dict[tuple[str, str], list[dict]] = {}
    for name in args.scenarios.split(","):
        for _ in range(args.rounds):
            for server in servers:  # alternate: drift on a shared machine hits both alike
                with server:
                    results.setdefault((name, server.name), []).append(asyncio.run(server.run(SCENARIOS[name], config.vocab_size)))

    print(f"## Serving latency, {args.new} ({config.n_layer} layers, d_model {config.d_model}), {args.rounds} rounds, "
          f"servers alternating, medians over rounds\n")
    for server in servers:
        print(f"- {server.name}: {server.artifact} {' '.join(server.extra)} (code: the kvserve installed for {server.python})")
    for name in args.scenarios.split(","):
        keys = list(results[(name, servers[0].name)][0])
        print(f"\n### {name}\n\n| server | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys))
        for server in servers:
            runs = results[(name, server.name)]
            print(f"| {server.name} | " + " | ".join(f"{statistics.median(r[k] for r in runs):.2f}" for k in keys) + " |")
        print("\nEvery round (a target that must hold in every run is read here):\n")
        print("| server | round | " + " | ".join(keys) + " |\n|---|---:|" + "---:|" * len(keys))
        for server in servers:
            for index, run in enumerate(results[(name, server.name)], 1):
                print(f"| {server.name} | {index} | " + " | ".join(f"{run[k]:.2f}" for k in keys) + " |")
    print(f"\nmachine: {describe(args.provider)}")


if __name__ == "__main__":
    main()
