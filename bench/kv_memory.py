"""K/V memory under load: a server's resident memory when it is SERVING and idle, and at its peak while 16 streams
write --new-tokens after a 32-token prompt, with their tokens/s and the start's seconds to SERVING; this tree against a
baseline revision (or artifacts of the same weights with other K/V dtypes, --artifacts), alternating, each run a
fresh server.

The baseline is the revision given (default HEAD~1), installed on its own (pip install --target, its dependencies this
environment's, as scripts/mutations.py installs a mutant) and run with PYTHONPATH ahead of this checkout. Resident
memory is the server process's VmRSS (/proc), sampled every 50 ms; the input worker, a process of its own, is not in
it.

    python bench/kv_memory.py [--artifact artifacts/gpt2-int8] [--baseline REV] [--rounds 2] [--new-tokens 992]
    python bench/kv_memory.py --artifacts artifacts/gpt2-int8 artifacts/gpt2-int8-kv-f16 artifacts/gpt2-int8-kv-int8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from serving_latency import free_port, prompt, stream, wait_until_serving  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STREAMS, PROMPT = 16, 32


def install_revision(revision: str) -> Path:
    """revision's tree installed as the kvserve package into a scratch site directory (with this tree's generated
    protobuf modules, which no revision tracks)."""
    root = Path(tempfile.mkdtemp(prefix="kvserve-baseline-"))
    archive = subprocess.run(["git", "archive", revision], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    for generated in (REPO / "kvserve" / "v1").glob("*_pb2*.py"):
        shutil.copy(generated, root / "kvserve" / "v1" / generated.name)
    site = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site), str(root)],
                   cwd=root, capture_output=True, check=True, timeout=600)
    return site


def resident_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory now (VmRSS), or its peak so far (VmHWM)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(f"{field}:"))


class Peak(threading.Thread):
    """The highest VmRSS of a process, sampled every 50 ms until stopped."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stopped = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.05):
            self.peak = max(self.peak, resident_bytes(self.pid))


async def load(target: str, vocab: int, new_tokens: int, seed: int) -> float:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        started = time.perf_counter()
        runs = await asyncio.gather(*(stream(stub, prompt(seed + i, PROMPT, vocab), new_tokens) for i in range(STREAMS)))
        return sum(len(r) - 1 for r in runs) / (time.perf_counter() - started)


def run_once(artifact: str, site: Path | None, vocab: int, new_tokens: int, seed: int, extra: tuple[str, ...] = ()) -> dict:
    """A fresh server on artifact (extra: more `serve` flags): seconds to SERVING, idle and peak VmRSS, and tokens/s
    while 16 streams of a 32-token prompt write new_tokens each."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", str(Path(artifact).resolve()), "--port", str(port),
                               "--provider", "cpu", "--max-batch-size", str(STREAMS), "--max-queue", "64", *extra],
                              stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir(), env=env)
    try:
        if not wait_until_serving(server, target):
            sys.exit("the server did not start")
        to_serving = time.perf_counter() - started
        start_peak = resident_bytes(server.pid, "VmHWM")  # the session, gate and warm-up's highest, before any request
        time.sleep(1.0)  # settled
        idle = resident_bytes(server.pid)
        peak = Peak(server.pid)
        peak.start()
        rate = asyncio.run(load(target, vocab, new_tokens, seed))
        peak.stopped.set()
        peak.join()
        return {"to_serving": to_serving, "start_peak": start_peak, "idle": idle, "peak": max(peak.peak, idle), "rate": rate}
    finally:
        server.terminate()
        server.wait(60)


def token_bytes(artifact: str) -> int:
    """One token's K and V over every layer, in the artifact's K/V dtype."""
    opened = open_artifact(artifact)
    config = opened.config
    return 2 * config.n_layer * config.n_kv_head * config.head_dim * np.dtype(opened.kv_dtype).itemsize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2-int8")
    parser.add_argument("--baseline", default="HEAD~1", help="the revision to compare with (default HEAD~1)")
    parser.add_argument("--artifacts", nargs="+", default=None, metavar="DIR",
                        help="instead of a baseline revision: these artifacts (the same weights with other K/V dtypes), each served by this tree")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=992, help="a stream's new tokens (default 992: 1,024 with the prompt)")
    args = parser.parse_args()
    site = None
    if args.artifacts:
        sides = {Path(a).name: (a, None) for a in args.artifacts}
        compared = f"artifacts {', '.join(sides)} (K/V {', '.join(open_artifact(a).kv_dtype for a in args.artifacts)}), this tree"
    else:
        revision = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        site = install_revision(args.baseline)
        sides = {"baseline": (args.artifact, site), "this tree": (args.artifact, None)}
        compared = f"{Path(args.artifact).name}: baseline {args.baseline} ({revision}), this tree"
    first = next(iter(sides.values()))[0]
    config = open_artifact(first).config
    live_tokens = STREAMS * (PROMPT + args.new_tokens)
    print(f"# K/V memory: {STREAMS} streams x {PROMPT + args.new_tokens} tokens\n\n{describe()}\n")
    print(f"{compared}; context {config.n_ctx}, {STREAMS} rows, {args.rounds} rounds alternating; server VmRSS. K/V growth: "
          f"(peak - idle) over the live tokens' K/V bytes ({live_tokens:,} tokens)\n")
    print("| round | server | to SERVING s | start-up peak GB | idle RSS GB | peak RSS GB | K/V growth | tokens/s |\n"
          "|---:|---|---:|---:|---:|---:|---:|---:|")
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for round_number in range(args.rounds):
        order = list(sides) if round_number % 2 == 0 else list(reversed(sides))
        for side in order:
            artifact, side_site = sides[side]
            result = run_once(artifact, side_site, config.vocab_size, args.new_tokens, 1000 * round_number)
            result["growth"] = (result["peak"] - result["idle"]) / (live_tokens * token_bytes(artifact))
            results[side].append(result)
            print(f"| {round_number + 1} | {side} | {result['to_serving']:.2f} | {result['start_peak'] / 1e9:.3f} | {result['idle'] / 1e9:.3f} | "
                  f"{result['peak'] / 1e9:.3f} | "
                  f"{result['growth']:.2f}x | {result['rate']:.1f} |")
    print("\n| server | to SERVING s (median) | idle RSS GB (median) | peak RSS GB (median) | K/V growth (median) | tokens/s (mean) |"
          "\n|---|---:|---:|---:|---:|---:|")
    for side, runs in results.items():
        print(f"| {side} | {statistics.median(r['to_serving'] for r in runs):.2f} | {statistics.median(r['idle'] for r in runs) / 1e9:.3f} | "
              f"{statistics.median(r['peak'] for r in runs) / 1e9:.3f} | {statistics.median(r['growth'] for r in runs):.2f}x | "
              f"{statistics.mean(r['rate'] for r in runs):.1f} |")
    if site is not None:
        shutil.rmtree(site.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
