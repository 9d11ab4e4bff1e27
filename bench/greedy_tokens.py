"""Greedy decode steps that read back the graph's greedy_tokens against steps that read back the logits: the same
gpt2 weights exported with that output and without it (as slots artifacts were before it), the serving batch
(kv_slots.SlotBatch, no gRPC), in-process, both in one run, alternating.

  logits          an artifact without greedy_tokens: every step hands its (rows, V) float32 logits to the host,
                  where each row's argmax is taken (under CUDA a device-to-host copy of them first)
  greedy tokens   the artifact with it: the argmax runs in the graph and a step of greedy rows hands back one
                  int64 a row; the logits stay where the step ran

Each at the exact shapes the server runs by default and at the fixed shapes of `serve --cuda-graph` (captured as
CUDA graphs on the CUDA provider). Batch 1: a 128-token prompt, 128 new tokens; batch 16: 16 sequences joined
together, prompt 32, 64 new tokens each; ms per decode step over the steps where every row decodes, best round
of each. Also the logits read back in that run (prefill steps included), and whether both produced the same tokens. Then the
host's share (ONNX Runtime's run a no-op, as in cuda_graph_decode.py). Last, how the graph could spell the argmax:
ONNX Runtime's ArgMax and TopK(k=1) alone, over 16 rows of gpt2 logits, against numpy's argmax on the host. Prints
markdown tables and the machine.

    python bench/greedy_tokens.py [--artifact artifacts/gpt2] [--baseline artifacts/gpt2-logits] [--dtype float32]
                                  [--provider auto] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_graph_decode import CROWD, SOLO, alternate, capture_state, host_ms_per_step, warm_batch  # noqa: E402
from machine import describe  # noqa: E402

from kvserve.export.artifact import open_artifact  # noqa: E402
from kvserve.export.pipeline import export_artifact, load_source  # noqa: E402


def artifact_at(path: Path, greedy_tokens: bool, dtype: str, provider: str):
    """The gpt2 preset's standard slots artifact at path, with or without greedy_tokens; exported there (in dtype) if missing."""
    if not path.exists():
        model, source = load_source("gpt2", None)
        export_artifact(model, source, path, dtype=dtype, provider=provider, greedy_tokens=greedy_tokens)
    artifact = open_artifact(path)
    if artifact.kv_cache != "slots" or artifact.attention != "standard" or artifact.greedy_tokens != greedy_tokens:
        raise SystemExit(f"{path}: need a standard slots artifact {'with' if greedy_tokens else 'without'} greedy_tokens")
    return artifact


def one_operator_ms(op: str, logits: np.ndarray, provider: str) -> float:
    """Best-of timing (ms) of a one-operator graph, op over logits (K, V) -> (K,) indices, IO in host memory."""
    k = [helper.make_tensor("k", TensorProto.INT64, [1], [1])] if op == "TopK" else []
    node = (helper.make_node("TopK", ["logits", "k"], ["values", "tokens"], axis=-1) if op == "TopK"
            else helper.make_node("ArgMax", ["logits"], ["tokens"], axis=-1, keepdims=0))
    outputs = [helper.make_tensor_value_info("tokens", TensorProto.INT64, None)]
    if op == "TopK":
        outputs.append(helper.make_tensor_value_info("values", TensorProto.FLOAT, None))
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, None])], outputs, k)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), providers=[provider])
    tokens = session.run(["tokens"], {"logits": logits})[0].reshape(-1)
    if not np.array_equal(tokens, logits.argmax(-1)):
        raise SystemExit(f"{op} disagrees with numpy's argmax")
    return min(timeit.repeat(lambda: session.run(["tokens"], {"logits": logits}), number=100, repeat=5)) / 100 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default="artifacts/gpt2", help="a standard slots artifact with greedy_tokens (exported if missing)")
    parser.add_argument("--baseline", default="artifacts/gpt2-logits", help="the same weights without greedy_tokens (exported if missing)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"), help="for an artifact exported here")
    parser.add_argument("--provider", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    artifacts = {"logits": artifact_at(Path(args.baseline), False, args.dtype, args.provider),
                 "greedy tokens": artifact_at(Path(args.artifact), True, args.dtype, args.provider)}
    config = artifacts["greedy tokens"].config
    if artifacts["logits"].config != config or artifacts["logits"].dtype != artifacts["greedy tokens"].dtype:
        raise SystemExit(f"{args.baseline} and {args.artifact} hold different models or dtypes")
    rows_needed = max(SOLO[0], CROWD[0])
    variants = {(steps, read_back): warm_batch(artifact, args.provider, cuda_graph, rows_needed)
                for read_back, artifact in artifacts.items() for steps, cuda_graph in (("exact shapes", False), ("fixed shapes", True))}
    best, generated = alternate(variants, args.rounds, config.vocab_size)
    runtime = variants[("fixed shapes", "greedy tokens")][0]
    captured = capture_state(runtime)
    print(f"{args.artifact} vs {args.baseline} ({config.n_layer} layers, d_model {config.d_model}, {artifacts['logits'].dtype}), "
          f"{runtime.provider}, greedy, best of {args.rounds} rounds, alternating; fixed shapes: {captured}\n")
    print("| decode steps | read back | batch 1 ms/step | batch 16 ms/step | batch 16 tokens/s | logits MB read back per run (batch 1 / 16) | same tokens as the first row |")
    print("|---|---|---:|---:|---:|---:|:-:|")
    for key in variants:
        (solo_s, solo_t, solo_read), (crowd_s, crowd_t, crowd_read) = best[(key, SOLO)], best[(key, CROWD)]
        same = all(generated[(key, s)] == generated[(("exact shapes", "logits"), s)] for s in (SOLO, CROWD))
        print(f"| {key[0]} | {key[1]} | {solo_s / (solo_t / SOLO[0]) * 1e3:.2f} | {crowd_s / (crowd_t / CROWD[0]) * 1e3:.2f} | "
              f"{crowd_t / crowd_s:.1f} | {solo_read / 2**20:.1f} / {crowd_read / 2**20:.1f} | {'yes' if same else 'NO'} |")
    print("\nHost work per decode step (ONNX Runtime's run a no-op), best of 3 passes of 200 steps:\n")
    print("| decode steps | read back | batch 1 host ms/step | batch 16 host ms/step |")
    print("|---|---|---:|---:|")
    for key, (runtime, batch) in variants.items():
        cells = [f"{host_ms_per_step(runtime, batch, rows):.3f}" for rows in (SOLO[0], CROWD[0])]
        print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    logits = np.random.default_rng(0).standard_normal((CROWD[0], config.vocab_size)).astype(np.float32)  # (16, V)
    print(f"\nThe argmax alone over ({CROWD[0]}, {config.vocab_size}) float32 logits, best of 5 x 100 runs "
          f"(ONNX Runtime on {runtime.provider}, inputs and outputs in host memory):\n")
    print("| argmax as | ms |")
    print("|---|---:|")
    for op in ("ArgMax", "TopK"):
        print(f"| ONNX Runtime {op}{' (k=1)' if op == 'TopK' else ''} | {one_operator_ms(op, logits, runtime.provider):.3f} |")
    numpy_ms = min(timeit.repeat(lambda: logits.argmax(-1), number=100, repeat=5)) / 100 * 1e3
    print(f"| numpy argmax | {numpy_ms:.3f} |")
    print(f"\nmachine: {describe(runtime.provider)}")


if __name__ == "__main__":
    main()
