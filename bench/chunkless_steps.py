"""A fused artifact's steps through its decode graph against its step graph (runtime/step.py, chunkless_steps;
contract/artifact.py, CHUNKLESS_MAX_WEIGHT_BYTES): what the step graph's If a layer costs, what a second session that
saves it holds, and what changing sessions between steps costs, on this machine's CPU.

For each artifact one runtime with both sessions, its pool's 16 rows filled with the same 100-token prompt; each kind
of step is timed in blocks, the step graph's block and the decode graph's taking turns (which goes first alternates),
and the ratio is taken block pair by block pair (the median of those ratios; a shared machine's drift between
minutes moves both alike). Kinds: batch 1 (a plain step, one row checking 9 tokens, one checking 17: how a row checks
drafts, through run_slots, the decode graph's block with the runtime's chunkless session, the step graph's without);
16 rows decoding (the decode graph through run_decode, which runs it at the pool's rows); and 16 rows with a prompt
chunk beside 15 of them every fourth step (those always through the step graph): what each change of session costs.
Greedy tokens are checked equal first. An artifact exported without a decode graph (its weights above the bound)
gets one written into a copy of it in a temporary folder (the weights copied: ONNX Runtime reads external data only
from the graph's own folder). Also the resident memory of a fresh process that opens the runtime and runs a step,
either way. Prints a markdown table and the machine.

    python bench/chunkless_steps.py [--artifacts artifacts/kjv-quote artifacts/gpt2] [--rounds 20] [--steps 20]
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

from kvserve.contract.artifact import DECODE_GRAPH_FILE, MODEL_DATA_FILE, MODEL_FILE, graph_bytes, open_artifact  # noqa: E402
from kvserve.export.decode_graph import decode_only  # noqa: E402
from kvserve.runtime import DecoderRuntime, pool_capacity  # noqa: E402

ROWS, PROMPT, CHECKS = 16, 100, (9, 17)


RESIDENT = """
import sys
import numpy as np
from kvserve.contract.artifact import open_artifact
from kvserve.runtime import DecoderRuntime, pool_capacity
artifact = open_artifact(sys.argv[1])
config = artifact.config
runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, "cpu", chunkless_steps=sys.argv[2] == "on")
pool = runtime.new_pool(1, config.n_kv_head, config.d_head, pool_capacity(config))
runtime.run_slots(pool, np.array([5]), np.array([0]), None, np.zeros(0, np.int64), 0, 0, np.array([0]), False)
with open("/proc/self/statm") as f:
    print(int(f.read().split()[1]) * 4096)
"""


def resident_bytes(directory: Path, chunkless: bool) -> int:
    """What a fresh process holds once it has opened directory's runtime (chunkless steps on or off) and run a step."""
    done = subprocess.run([sys.executable, "-c", RESIDENT, str(directory), "on" if chunkless else "off"], capture_output=True,
                          text=True, check=True)
    return int(done.stdout.split()[-1])


def with_decode_graph(directory: Path, scratch: Path) -> Path:
    """directory itself when it holds a decode graph, else a copy of its graph and weights in scratch with one written."""
    if (directory / DECODE_GRAPH_FILE).exists():
        return directory
    copy = scratch / directory.name
    copy.mkdir()
    for path in directory.iterdir():
        if path.is_file():
            shutil.copy2(path, copy / path.name)
    onnx.save_model(decode_only(onnx.load(str(copy / MODEL_FILE), load_external_data=False)), str(copy / DECODE_GRAPH_FILE))
    return copy


def measure(name: str, directory: Path, rounds: int, steps: int) -> dict:
    artifact = open_artifact(directory)
    config = artifact.config
    memory = (resident_bytes(directory, False), resident_bytes(directory, True))
    runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, "cpu", decode_graph=True, chunkless_steps=True)
    decode_session = runtime.chunkless_session
    capacity = pool_capacity(config)
    scratch = capacity - 1
    pool = runtime.new_pool(ROWS, config.n_kv_head, config.d_head, capacity)
    prompt = np.arange(3, 3 + PROMPT, dtype=np.int64) % config.vocab_size
    empty = np.zeros(0, np.int64)
    for row in range(ROWS):  # each prompt alone, the step's one row
        runtime.run_slots(pool, np.zeros(1, np.int64), np.full(1, scratch), None, prompt, 0, row, np.array([PROMPT]), False)
    rows = np.arange(ROWS)

    def plain_1(decode: bool):
        return runtime.run_slots(pool, np.array([5]), np.array([PROMPT]), None, empty, 0, 0, np.array([0]), False)

    def check(tokens: int):
        def check_tokens(decode: bool):
            return runtime.run_slots(pool, np.zeros(1, np.int64), np.full(1, scratch), None, prompt[:tokens], PROMPT, 0,
                                     np.arange(1, 1 + tokens), False)
        return check_tokens

    def plain_16(decode: bool):
        if decode:
            return runtime.run_decode(pool, np.full(ROWS, 5), np.full(ROWS, PROMPT), None, False)
        return runtime.run_slots(pool, np.full(ROWS, 5), np.full(ROWS, PROMPT), None, empty, 0, 0, rows, False)

    def chunk_16(decode: bool):
        return runtime.run_slots(pool, np.full(ROWS - 1, 5), np.full(ROWS - 1, PROMPT), None, prompt[:ROWS], PROMPT, ROWS - 1,
                                 rows, False)

    def chunk_every_4th(decode: bool):
        for _ in range(3):
            plain_16(decode)
        return chunk_16(decode)

    kinds = {"plain, batch 1": plain_1, f"1 row checking {CHECKS[0]}": check(CHECKS[0]),
             f"1 row checking {CHECKS[1]}": check(CHECKS[1]), f"{ROWS} rows": plain_16,
             f"{ROWS} rows, a chunk every 4th step": chunk_every_4th}

    def through(decode: bool) -> None:
        runtime.chunkless_session = decode_session if decode else None

    for kind in kinds.values():  # each writes the same columns every time: the rows stay alike
        tokens = []
        for decode in (False, True):
            through(decode)
            tokens.append(kind(decode).greedy_tokens.tolist())
        if tokens[0] != tokens[1]:
            raise SystemExit(f"{name}: {kind.__name__} gave other greedy tokens through the decode graph")
    times: dict[tuple[str, bool], list[float]] = {}
    for round_ in range(rounds):
        for label, kind in kinds.items():
            for decode in (False, True) if round_ % 2 == 0 else (True, False):
                through(decode)
                for _ in range(2):
                    kind(decode)
                start = time.perf_counter()
                for _ in range(steps):
                    kind(decode)
                times.setdefault((label, decode), []).append((time.perf_counter() - start) / steps)
    results = {}
    for label, kind in kinds.items():
        old, new = times[(label, False)], times[(label, True)]
        per_step = 4 if kind is chunk_every_4th else 1
        results[label] = (statistics.median(old) / per_step, statistics.median(new) / per_step,
                          statistics.median(b / a for a, b in zip(old, new)))
    return {"name": name, "weights": graph_bytes(directory), "layers": config.n_layer, "memory": memory, "steps": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifacts", nargs="+", default=["artifacts/kjv-quote", "artifacts/gpt2"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20, help="steps in a block (a large model's: fewer will do)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be >= 1")
    results = []
    with tempfile.TemporaryDirectory(prefix="chunkless-") as scratch:
        for path in args.artifacts:
            directory = Path(path)
            if not (directory / MODEL_DATA_FILE).exists() and not (directory / MODEL_FILE).exists():
                parser.error(f"{path}: no artifact there")
            if open_artifact(directory).attention != "fused":
                parser.error(f"{path}: a standard-attention artifact has no attention If to leave out")
            results.append(measure(path, with_decode_graph(directory, Path(scratch)), args.rounds, args.steps))
    print(f"# Step graph (an If a layer) against decode graph: {args.rounds} rounds, blocks of {args.steps} steps taking turns; "
          "median µs a step, and the median of the block pairs' ratios\n")
    labels = list(results[0]["steps"])
    print("| artifact | graph + weights | layers | resident: step graph alone | with the decode graph | " + " | ".join(labels) + " |")
    print("|---|---:|---:|---:|---:|" + "---|" * len(labels))
    for r in results:
        cells = [f"{old * 1e6:,.0f} -> {new * 1e6:,.0f} ({ratio:.2f}x)" for old, new, ratio in r["steps"].values()]
        print(f"| {r['name']} | {r['weights'] / 2**20:,.0f} MiB | {r['layers']} | {r['memory'][0] / 2**20:,.0f} MiB | "
              f"{r['memory'][1] / 2**20:,.0f} MiB | " + " | ".join(cells) + " |")
    print(f"\nMachine: {describe('cpu')}")


if __name__ == "__main__":
    main()
