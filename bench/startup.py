"""Cold starts: `kvserve serve` from its process start to SERVING (asked of the health service every 10 ms, as
`kvserve health` asks), median of --runs, and where the time goes, read from the server's own log lines: the
interpreter and imports up to the bound port, the session, the parity gate's replay, and the serving batch (its K/V
memory allocated and touched) with the warm-up.

    python bench/startup.py [--artifact artifacts/gpt2-int8] [--rows 8 16] [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import re
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
from serving_latency import free_port, serving_status  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.v1 import generation_pb2_grpc  # noqa: E402, F401  (the stubs exist: the server can start)

SERVING = 1  # grpc.health.v1.HealthCheckResponse.SERVING
MARKS = {"bound": "listening on", "session": "execution provider:", "gate": "parity gate passed", "serving": ": SERVING "}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def cold_start(artifact: str, rows: int) -> dict[str, float]:
    """One start: seconds from the process's start to each mark, and to the first SERVING answer."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    started_wall, started = time.time(), time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", str(Path(artifact).resolve()), "--port", str(port),
                                "--provider", "cpu", "--max-batch-size", str(rows)], stderr=log, cwd=tempfile.gettempdir())
    try:
        while process.poll() is None:
            try:
                if asyncio.run(serving_status(f"127.0.0.1:{port}")) == SERVING:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.01)
        answered = time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(60)
    log.seek(0)
    marks = {"answered": answered}
    for line in log.read().splitlines():
        stamp = STAMP.match(line)
        for name, words in MARKS.items():
            if stamp and words in line and name not in marks:
                marks[name] = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - started_wall
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2-int8")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    config = open_artifact(args.artifact).config
    print(f"# Cold starts to SERVING\n\n{describe()}\n\n{Path(args.artifact).name} ({config.n_layer} layers, context {config.n_ctx}), "
          f"{args.runs} starts per row count, alternating; medians, seconds from the process's start\n")
    print("| rows | to SERVING | imports + bind | session | parity gate | batch + warm-up | runs (to SERVING) |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    runs: dict[int, list[dict]] = {rows: [] for rows in args.rows}
    for _ in range(args.runs):
        for rows in args.rows:
            runs[rows].append(cold_start(args.artifact, rows))
    for rows, marks in runs.items():
        def median(name: str) -> float:
            return statistics.median(m[name] for m in marks)

        bound, session, gate, serving = median("bound"), median("session"), median("gate"), median("serving")
        print(f"| {rows} | {median('answered'):.2f} | {bound:.2f} | {session - bound:.2f} | {gate - session:.2f} | {serving - gate:.2f} | "
              f"{', '.join(format(m['answered'], '.2f') for m in marks)} |")


if __name__ == "__main__":
    main()
