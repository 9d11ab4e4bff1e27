"""Cold starts: `kvserve serve` from its process start to SERVING (asked of the health service every 10 ms, as
`kvserve health` asks), median of --runs, and where the time goes, read from the server's own log lines: the
interpreter and imports up to the bound port, the session, the parity gate's replay, and the serving batch with the
warm-up; and the bytes the server had read from storage by then (/proc/PID/io read_bytes: with --cold, whether its
weights file was read from the disk once or twice). Then what the warm-up leaves to the first requests: a burst of as
many streams as rows (32-token prompts, 64 new tokens, or --burst-tokens) sent at SERVING, and the same burst again;
their seconds, and the first's over the second's.

    python bench/startup.py [--artifact artifacts/gpt2-int8] [--rows 8 16] [--runs 5] [--baseline REV] [--burst-tokens 64]

With --baseline, the revision given is installed on its own (as bench/kv_memory.py installs it) and started in turn
with this tree. With --llama-server and --gguf, llama.cpp's server is started in turn too (as many slots as rows, 256
tokens each), timed from its start to its /health answering 200, the peer's SERVING. With --cold, the kernel's page
cache is dropped before every start (root only), so each reads its weights from the disk, as a new container does;
without it, a kvserve start hands its weights' pages back (runtime/weights_memory.py) and llama-server's stay cached.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from kv_memory import install_revision  # noqa: E402
from llama_cpp_compare import LlamaServer  # noqa: E402
from serving_latency import free_port, prompt, serving_status, stream  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

SERVING = 1  # grpc.health.v1.HealthCheckResponse.SERVING
MARKS = {"bound": "listening on", "session": "execution provider:", "gate": "parity gate passed", "serving": ": SERVING "}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


BURST_PROMPT, BURST_TOKENS = 32, 64


async def burst(target: str, rows: int, vocab: int, seed: int, tokens: int = BURST_TOKENS) -> float:
    """Seconds for rows streams sent at once to each write `tokens` tokens."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        started = time.perf_counter()
        await asyncio.gather(*(stream(stub, prompt(seed + i, BURST_PROMPT, vocab), tokens) for i in range(rows)))
        return time.perf_counter() - started


def storage_read_bytes(pid: int) -> int:
    """Bytes the kernel has read from storage for process pid so far: its read() calls and the faults of its mapped
    pages that went to the disk; what the page cache already held is not counted."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/io has no read_bytes")


def cold_start(artifact: str, rows: int, vocab: int, site: Path | None = None, burst_tokens: int = BURST_TOKENS) -> dict[str, float]:
    """One start: seconds from the process's start to each mark, to the first SERVING answer, and of the two bursts."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    env = dict(os.environ) | ({"PYTHONPATH": str(site)} if site is not None else {})
    started_wall, started = time.time(), time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", str(Path(artifact).resolve()), "--port", str(port),
                                "--provider", "cpu", "--max-batch-size", str(rows)], stderr=log, cwd=tempfile.gettempdir(), env=env)
    try:
        while process.poll() is None:
            try:
                if asyncio.run(serving_status(f"127.0.0.1:{port}")) == SERVING:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.01)
        answered = time.perf_counter() - started
        if process.poll() is not None:
            log.seek(0)
            last = (log.read().strip().splitlines() or ["(no output)"])[-1]
            sys.exit(f"kvserve serve exited with {process.returncode} before SERVING: {last}")
        read = storage_read_bytes(process.pid)
        first_burst = asyncio.run(burst(f"127.0.0.1:{port}", rows, vocab, 0, burst_tokens))
        second_burst = asyncio.run(burst(f"127.0.0.1:{port}", rows, vocab, 100, burst_tokens))
    finally:
        process.terminate()
        process.wait(60)
    log.seek(0)
    marks = {"answered": answered, "read": read, "first_burst": first_burst, "second_burst": second_burst}
    for line in log.read().splitlines():
        stamp = STAMP.match(line)
        for name, words in MARKS.items():
            if stamp and words in line and name not in marks:
                marks[name] = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - started_wall
    return marks


def drop_page_cache() -> None:
    """Every clean page of every file out of the kernel's cache, so the next start reads its weights from the disk."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def llama_server_start(binary: Path, gguf: Path, rows: int) -> dict[str, float]:
    """Seconds from llama-server's start to its /health answering 200 (loaded, slots ready), asked every 10 ms as
    kvserve's health is, and what it had read from storage by then."""
    started = time.perf_counter()
    server = LlamaServer(binary, gguf, os.cpu_count() or 1, rows, 256, poll=0.01)
    try:
        return {"answered": time.perf_counter() - started, "read": storage_read_bytes(server.process.pid)}
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2-int8")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline", default=None, help="a revision to start in turn with this tree (default: this tree alone)")
    parser.add_argument("--burst-tokens", type=int, default=BURST_TOKENS,
                        help=f"tokens each stream of a burst writes (default {BURST_TOKENS}; fewer for a model whose step takes seconds)")
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary, started in turn on --gguf")
    parser.add_argument("--gguf", type=Path, help="the GGUF llama-server loads (the same checkpoint as --artifact)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every start (root only)")
    args = parser.parse_args()
    if args.burst_tokens < 1 or args.runs < 1:
        parser.error("--burst-tokens and --runs must be at least 1")
    if (args.llama_server is None) != (args.gguf is None):
        parser.error("--llama-server and --gguf go together")
    for path in (args.llama_server, args.gguf):
        if path is not None and not path.is_file():
            parser.error(f"{path}: no such file")
    if args.cold and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        parser.error("--cold drops the page cache, which needs root (/proc/sys/vm/drop_caches is not writable)")
    sides = {"this tree": None}
    if args.baseline:
        sides = {f"baseline {args.baseline}": install_revision(args.baseline), "this tree": None}
    if args.llama_server is not None:
        sides["llama-server"] = None
    config = open_artifact(args.artifact).config
    print(f"# Cold starts to SERVING\n\n{describe()}\n\n{Path(args.artifact).name} ({config.n_layer} layers, context {config.n_ctx}), "
          f"{args.runs} starts per row count, alternating; medians, seconds from the process's start; page cache "
          f"{'dropped before every start' if args.cold else 'as each server leaves it'}"
          f"{f'; llama-server on {args.gguf.name}, to /health 200' if args.llama_server else ''}\n")
    weights = sum(f.stat().st_size for f in Path(args.artifact).iterdir() if f.name.startswith("model.onnx"))
    print(f"weights: {weights / 1e9:.2f} GB (model.onnx and its data file){f', the GGUF {args.gguf.stat().st_size / 1e9:.2f} GB' if args.gguf else ''}\n")
    print("| server | rows | to SERVING | imports + bind | session | parity gate | batch + warm-up | read from storage GB | first burst s | again s | "
          "first / again | runs (to SERVING) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    runs: dict[tuple[str, int], list[dict]] = {(side, rows): [] for side in sides for rows in args.rows}
    for run in range(args.runs):
        for side in (list(sides) if run % 2 == 0 else list(reversed(sides))):
            for rows in args.rows:
                if args.cold:
                    drop_page_cache()
                if side == "llama-server":
                    runs[(side, rows)].append(llama_server_start(args.llama_server, args.gguf, rows))
                else:
                    runs[(side, rows)].append(cold_start(args.artifact, rows, config.vocab_size, sides[side], args.burst_tokens))
    for (side, rows), marks in runs.items():
        def median(name: str) -> float:
            return statistics.median(m[name] for m in marks)

        if side == "llama-server":  # its start has no phases kvserve's log names, and no bursts are sent to it
            print(f"| {side} | {rows} | {median('answered'):.2f} | | | | | {median('read') / 1e9:.2f} | | | | {', '.join(format(m['answered'], '.2f') for m in marks)} |")
            continue
        bound, session, gate, serving = median("bound"), median("session"), median("gate"), median("serving")
        first, again = median("first_burst"), median("second_burst")
        print(f"| {side} | {rows} | {median('answered'):.2f} | {bound:.2f} | {session - bound:.2f} | {gate - session:.2f} | {serving - gate:.2f} | "
              f"{median('read') / 1e9:.2f} | {first:.2f} | {again:.2f} | {first / again:.2f} | {', '.join(format(m['answered'], '.2f') for m in marks)} |")


    for site in sides.values():
        if site is not None:
            shutil.rmtree(site.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
