"""Where a decode step's time goes: ONNX Runtime's own profiler, per operator type, at two past lengths.

One decode step (B=--rows, T=1) of an artifact, run `--steps` times at past 16 and at past 1,000 (or `--pasts`) with
profiling on; prints the kernel milliseconds per step of the operator types that cost the most, so a change in the cost
of a long past can be pinned to the ops behind it (the slots graph: its K/V write is a ScatterND into the pool), and
with --rows 16 what a batched step spends in the weight matmuls against the rest.

    python bench/step_profile.py --artifact artifacts/gpt2 [--steps 20] [--top 8] [--rows 1] [--pasts 16 1000]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import onnx_step  # noqa: E402
from machine import describe  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.runtime.providers import CPU, session_options  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402

PAST_LENGTHS = (16, 1000)


def kernel_ms_per_op(artifact, past_len: int, steps: int, rows: int = 1) -> dict[str, float]:
    """{operator type: kernel ms per step} over `steps` decode steps of `rows` rows at past_len, on the CPU provider."""
    config = artifact.config
    runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        options = session_options()  # the process's one thread pool, as every session here
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tmp, "step")
        options.log_severity_level = 3
        runtime.session = ort.InferenceSession(str(artifact.model_path), options, providers=[CPU])  # the same graph, profiled
        step = onnx_step(runtime, config, past_len, rows=rows)
        with runtime.step_graph_only():  # every step through it, one row too
            for _ in range(steps):
                step()
        events = json.loads(Path(runtime.session.end_profiling()).read_text())
    totals = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            totals[event["args"]["op_name"]] += event["dur"]  # microseconds
    return {op: us / steps / 1e3 for op, us in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1, help="rows a decode step runs (default 1)")
    parser.add_argument("--pasts", type=int, nargs=2, default=PAST_LENGTHS, metavar=("SHORT", "LONG"))
    args = parser.parse_args()
    if args.rows < 1 or args.steps < 1 or min(args.pasts) < 1:
        sys.exit("step_profile: --rows, --steps and --pasts must be at least 1")
    artifact = open_artifact(args.artifact)
    if artifact.config.n_ctx <= max(args.pasts):
        sys.exit(f"{args.artifact}: its context holds {artifact.config.n_ctx} positions; this profile needs {max(args.pasts) + 1}")
    short, long = (kernel_ms_per_op(artifact, n, args.steps, args.rows) for n in args.pasts)
    ops = sorted(set(short) | set(long), key=lambda op: -long.get(op, 0.0))[: args.top]
    print(f"## Kernel ms per decode step by operator, {args.artifact} ({artifact.kv_cache} KV cache, {artifact.dtype}), "
          f"{args.rows} row(s), {args.steps} steps each\n")
    print(f"| operator | past {args.pasts[0]} | past {args.pasts[1]:,} | added |")
    print("|---|---:|---:|---:|")
    for op in ops:
        a, b = short.get(op, 0.0), long.get(op, 0.0)
        print(f"| {op} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
    a, b = sum(short.values()), sum(long.values())
    print(f"| all kernels | {a:.2f} | {b:.2f} | {b - a:+.2f} ({b / a:.2f}x) |")
    print(f"\nmachine: {describe(CPU)}")


if __name__ == "__main__":
    main()
