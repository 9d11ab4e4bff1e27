"""A fused artifact's steps split between its chunk graph and its decode graph against its step graph (runtime/step.py,
splits_steps; export/chunk_graph.py) on this machine's CPU: what the step graph's If a layer costs a step with a prompt
chunk beside decoding rows, what the split costs the steps around them (two sessions, each with its own packed
weights), and the memory a process holds either way.

For each artifact two runtimes, one on the step graph (chunk_graph=False, chunkless steps off) and one splitting its
steps (chunk_graph=True), each with a pool of 16 rows filled with the same 100-token prompt. Each kind of step is timed
in blocks, the two runtimes' blocks taking turns (which goes first alternates), and the ratio is taken block pair by
block pair (their median). Kinds: one row decoding beside a chunk of 8 tokens; 15 rows beside chunks of 16 and of 32;
16 rows decoding alone (the decode graph through run_slots, as the CPU serves it); and 16 rows with a chunk beside 15
of them every fourth step (the split runtime changes sessions twice in four). Greedy tokens are checked equal first.
An artifact without a chunk graph (a float32 export: only float16 ones write it) gets both graphs written into a copy
of it in a temporary folder (the weights copied: ONNX Runtime reads external data only from the graph's own folder).
Prints a markdown table and the machine.

    python bench/chunk_steps.py [--artifacts artifacts/kjv-quote artifacts/gpt2] [--rounds 12] [--steps 20]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

from kvserve.contract.artifact import CHUNK_GRAPH_FILE, DECODE_GRAPH_FILE, MODEL_FILE, graph_bytes, open_artifact  # noqa: E402
from kvserve.export.chunk_graph import with_chunk  # noqa: E402
from kvserve.export.decode_graph import decode_only  # noqa: E402
from kvserve.runtime import DecoderRuntime, pool_capacity  # noqa: E402

ROWS, PROMPT = 16, 100

RESIDENT = """
import sys
import numpy as np
from kvserve.contract.artifact import open_artifact
from kvserve.runtime import DecoderRuntime, pool_capacity
artifact = open_artifact(sys.argv[1])
config = artifact.config
split = sys.argv[2] == "on"
runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, "cpu", chunkless_steps=split, chunk_graph=split)
pool = runtime.new_pool(2, config.n_kv_head, config.d_head, pool_capacity(config))
runtime.run_slots(pool, np.array([5]), np.array([0]), None, np.array([6, 7], np.int64), 0, 1, np.array([0, 2]), False)
runtime.run_slots(pool, np.array([5, 8]), np.array([1, 2]), None, np.zeros(0, np.int64), 0, 0, np.array([0, 1]), False)
with open("/proc/self/statm") as f:
    print(int(f.read().split()[1]) * 4096)
"""


def resident_bytes(directory: Path, split: bool) -> int:
    """What a fresh process holds once it has opened directory's runtime (split or not) and run a step of each graph."""
    done = subprocess.run([sys.executable, "-c", RESIDENT, str(directory), "on" if split else "off"], capture_output=True,
                          text=True, check=True)
    return int(done.stdout.split()[-1])


def with_split_graphs(directory: Path, scratch: Path) -> Path:
    """directory itself when it holds a chunk graph and a decode graph, else a copy of it in scratch with both written."""
    if (directory / CHUNK_GRAPH_FILE).exists() and (directory / DECODE_GRAPH_FILE).exists():
        return directory
    copy = scratch / directory.name
    copy.mkdir()
    for path in directory.iterdir():
        if path.is_file():
            shutil.copy2(path, copy / path.name)
    step = onnx.load(str(copy / MODEL_FILE), load_external_data=False)
    onnx.save_model(with_chunk(step), str(copy / CHUNK_GRAPH_FILE))
    if not (copy / DECODE_GRAPH_FILE).exists():
        onnx.save_model(decode_only(step), str(copy / DECODE_GRAPH_FILE))
    return copy


def measure(name: str, directory: Path, rounds: int, steps: int) -> dict:
    artifact = open_artifact(directory)
    config = artifact.config
    memory = (resident_bytes(directory, False), resident_bytes(directory, True))
    runtimes = {split: DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, "cpu", chunkless_steps=split, chunk_graph=split)
                for split in (False, True)}
    capacity = pool_capacity(config)
    scratch = capacity - 1
    pools = {split: runtime.new_pool(ROWS, config.n_kv_head, config.d_head, capacity) for split, runtime in runtimes.items()}
    prompt = np.arange(3, 3 + PROMPT, dtype=np.int64) % config.vocab_size
    empty = np.zeros(0, np.int64)
    for split, runtime in runtimes.items():
        for row in range(ROWS):  # each prompt alone, the step's one row
            runtime.run_slots(pools[split], np.zeros(1, np.int64), np.full(1, scratch), None, prompt, 0, row, np.array([PROMPT]), False)

    def beside(rows: int, tokens: int):
        def rows_and_chunk(split: bool):  # rows 0 .. rows-1 decode at PROMPT, the last row's chunk rewrites its columns PROMPT ..
            return runtimes[split].run_slots(pools[split], np.full(rows, 5), np.full(rows, PROMPT), None, prompt[:tokens], PROMPT, ROWS - 1,
                                             np.arange(rows + tokens), False)
        return rows_and_chunk

    def plain(split: bool):
        return runtimes[split].run_slots(pools[split], np.full(ROWS, 5), np.full(ROWS, PROMPT), None, empty, 0, 0, np.arange(ROWS), False)

    def chunk_every_4th(split: bool):
        for _ in range(3):
            plain(split)
        return beside(ROWS - 1, ROWS)(split)

    kinds = {"1 row beside a chunk of 8": beside(1, 8), f"{ROWS - 1} rows beside a chunk of 16": beside(ROWS - 1, 16),
             f"{ROWS - 1} rows beside a chunk of 32": beside(ROWS - 1, 32), f"{ROWS} rows decoding": plain,
             f"{ROWS} rows, a chunk every 4th step": chunk_every_4th}
    for label, kind in kinds.items():  # each writes the same columns every time: the rows stay alike
        if kind(False).greedy_tokens.tolist() != kind(True).greedy_tokens.tolist():
            raise SystemExit(f"{name}: {label} gave other greedy tokens split")
    times: dict[tuple[str, bool], list[float]] = {}
    for round_ in range(rounds):
        for label, kind in kinds.items():
            for split in (False, True) if round_ % 2 == 0 else (True, False):
                for _ in range(2):
                    kind(split)
                start = time.perf_counter()
                for _ in range(steps):
                    kind(split)
                times.setdefault((label, split), []).append((time.perf_counter() - start) / steps)
    results = {}
    for label, kind in kinds.items():
        old, new = times[(label, False)], times[(label, True)]
        per_step = 4 if kind is chunk_every_4th else 1
        results[label] = (statistics.median(old) / per_step, statistics.median(new) / per_step,
                          statistics.median(b / a for a, b in zip(old, new)))
    return {"name": name, "weights": graph_bytes(directory), "layers": config.n_layer, "memory": memory, "steps": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", nargs="+", type=Path, default=[Path("artifacts/kjv-quote"), Path("artifacts/gpt2")])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20, help="steps a block")
    args = parser.parse_args()
    missing = [str(d) for d in args.artifacts if not (d / MODEL_FILE).exists()]
    if missing:
        raise SystemExit(f"no artifact at {', '.join(missing)}: export it first (kvserve export)")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for directory in args.artifacts:
            rows.append(measure(directory.name, with_split_graphs(directory, Path(scratch)), args.rounds, args.steps))
    print(f"machine: {describe()}")
    print(f"{args.rounds} rounds, blocks of {args.steps} steps taking turns; ratio: the median of split / step graph, block pair by block pair\n")
    print("| artifact | weights MiB | step | step graph ms | split ms | split / step graph |")
    print("|---|---:|---|---:|---:|---:|")
    for row in rows:
        for label, (old, new, ratio) in row["steps"].items():
            print(f"| {row['name']} ({row['layers']} layers) | {row['weights'] / 2**20:.0f} | {label} | {old * 1e3:.2f} | {new * 1e3:.2f} | {ratio:.2f}x |")
    print("\n| artifact | resident MiB, step graph | resident MiB, split | split / step graph |")
    print("|---|---:|---:|---:|")
    for row in rows:
        old, new = row["memory"]
        print(f"| {row['name']} | {old / 2**20:.0f} | {new / 2**20:.0f} | {new / old:.2f}x |")


if __name__ == "__main__":
    main()
