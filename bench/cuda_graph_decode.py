"""Decode steps as CUDA graphs against uncaptured ones: the serving batch (batch.SlotBatch, no gRPC) of one
standard slots artifact (or a fused float16 one, whose decode graph the fixed shapes run), in-process, both ways in one run.

  uncaptured     the server's default: decode steps at their exact shapes, inputs bound from host memory
  fixed shapes   `serve --cuda-graph`: decode steps at bucketed (rows, width) shapes, inputs written into bound
                 device buffers, every shape prepared before timing; captured as a CUDA graph per shape where the
                 session can (the CUDA provider); on the CPU provider the same steps run uncaptured, which shows
                 what the bucketing alone costs there
  fixed, uncaptured  (where fixed shapes are captured) the same bucketed steps from a session that does not
                 capture: captured steps must give its tokens exactly. Against the exact shapes a float16 graph may
                 part after a few dozen tokens (another shape, another kernel's rounding), so that column is shown too

Batch 1: a 128-token prompt, 128 new tokens, greedy: ms per decode step (the steps after the first token).
Batch 16: 16 sequences joined together (prompt 32, 64 new tokens each): aggregate decode tokens/s over the steps
where all 16 decode. The two take turns within every round; the best round of each is kept. Also whether both
produced the same greedy tokens. Then the host's share of a step: the same decode steps with ONNX Runtime's run
replaced by a no-op, so what is left is kvserve's own work per step (inputs, binding, logits to numpy, sampling,
stop rules), which no CUDA graph removes: at batch 1 it must stay well under the 1 ms/step goal. Prints markdown
tables and the machine.

With --attention-kernels (a fused artifact on CUDA) each choice after the first adds captured fixed-shape steps from
a runtime opened under that choice of GroupQueryAttention's decode kernel (bench/attention_kernels.py: XQA, cuDNN's
SDPA or FlashAttention's decode path), in the same rounds; their tokens may part from the others' after a few dozen
(another kernel's float16 rounding).

    python bench/cuda_graph_decode.py [--artifact artifacts/gpt2] [--provider auto|cpu|cuda] [--rounds 3]
                                      [--attention-kernels default,flash]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_kernels  # noqa: E402
from machine import describe  # noqa: E402

from kvserve.contract.artifact import DECODE_GRAPH_FILE, open_artifact  # noqa: E402
from kvserve.export.pipeline import export_artifact, load_source  # noqa: E402
from kvserve.service.process.gate import _greedy_sequence  # noqa: E402
from kvserve.service.core.batch import SlotBatch  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402
from kvserve.service.core.scheduler import Scheduler  # noqa: E402

SOLO = (1, 128, 128)  # rows, prompt, new tokens
CROWD = (16, 32, 64)


def decode_run(batch: SlotBatch, rows: int, prompt_len: int, new_tokens: int, vocab_size: int) -> tuple[float, int, list]:
    """Join rows sequences, run them to the end; returns (seconds, tokens) of the steps where every row decodes
    and nothing prefills, and the generated tokens."""
    scheduler = Scheduler(batch, step_token_budget=0)
    seqs = [_greedy_sequence(i, ((np.arange(prompt_len) * 7919 + 13 * (i + 1)) % vocab_size).tolist(), new_tokens) for i in range(rows)]
    for seq in seqs:
        scheduler.waiting.append(seq)
    seconds, tokens = 0.0, 0
    while scheduler.waiting or scheduler.kv.rows:
        plan = scheduler.plan()
        timed = plan.chunk is None and not plan.joining and len(plan.decode) == rows
        start = time.perf_counter()
        scheduler.run_step(plan)
        if timed:
            seconds += time.perf_counter() - start
            tokens += rows
    return seconds, tokens, [s.generated for s in seqs]


def warm_batch(artifact, provider: str, cuda_graph: bool, rows: int, fixed: bool | None = None) -> tuple[DecoderRuntime, SlotBatch]:
    """A runtime and a serving batch of rows over a standard slots artifact, at exact shapes or (fixed, by default
    cuda_graph) the fixed shapes of `serve --cuda-graph`, every shape prepared, then warmed up: first runs pay
    allocation and kernel selection."""
    config = artifact.config
    fixed = cuda_graph if fixed is None else fixed
    runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, provider, cuda_graph=cuda_graph, decode_graph=fixed)
    batch = SlotBatch(runtime, config, rows, fixed_decode=fixed)
    if fixed:
        batch.prepare_decode_shapes()
    decode_run(batch, 2, 16, 8, config.vocab_size)
    return runtime, batch


def capture_state(runtime: DecoderRuntime) -> str:
    """What became of a cuda_graph runtime's fixed-shape steps, for a table's heading."""
    return "captured as CUDA graphs" if runtime.captures_decode else f"not captured ({runtime.cuda_graph_note})"


def alternate(variants: dict, rounds: int, vocab_size: int) -> tuple[dict, dict]:
    """Every variant's (runtime, batch) through SOLO then CROWD, taking turns within each round (drift hits every variant
    alike). Returns {(variant, shape): (seconds, tokens, logits bytes read back)} of its best round, and
    {(variant, shape): the tokens generated}."""
    best = {(key, shape): (float("inf"), 1, 0) for key in variants for shape in (SOLO, CROWD)}
    generated = {}
    for _ in range(rounds):
        for shape in (SOLO, CROWD):
            for key, (runtime, batch) in variants.items():
                before = runtime.traffic.logits_bytes
                seconds, tokens, tokens_out = decode_run(batch, *shape, vocab_size)
                if seconds < best[(key, shape)][0]:
                    best[(key, shape)] = (seconds, tokens, runtime.traffic.logits_bytes - before)
                generated[(key, shape)] = tokens_out
    return best, generated


def host_ms_per_step(runtime: DecoderRuntime, batch: SlotBatch, rows: int, steps: int = 200) -> float:
    """ms of host work per decode step of rows sequences, the session's runs replaced by a no-op (tokens are then
    meaningless; only the time counts). Best of three passes of steps (fewer where the context is shorter)."""
    prompt = [1, 2, 3, 4]
    steps = min(steps, (batch.config.n_ctx - len(prompt) - 2) // 3)  # three passes, then a token to spare
    scheduler = Scheduler(batch, step_token_budget=0)
    seqs = [_greedy_sequence(i, [1 + i] + prompt[1:], 3 * steps + 2) for i in range(rows)]
    for seq in seqs:
        scheduler.waiting.append(seq)
    scheduler.run_step(scheduler.plan())  # the prefill, for real
    sessions = {id(s): s for s in (runtime.session, runtime.fixed_steps.session)}.values()  # a fused artifact's decode graph has its own
    for session in sessions:
        session.run_with_iobinding = lambda *args, **kwargs: None  # an instance attribute shadows the method
    try:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(steps):
                scheduler.run_step(scheduler.plan())
            best = min(best, (time.perf_counter() - start) / steps * 1e3)
    finally:
        for session in sessions:
            del session.run_with_iobinding
    for seq in seqs:
        seq.cancelled = True
    scheduler.run_step(scheduler.plan())  # frees the rows
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default="artifacts/gpt2", help="a standard slots artifact, or a fused one with its decode graph "
                        "(float16); the gpt2 preset is exported there if missing")
    parser.add_argument("--provider", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attention-kernels", type=attention_kernels.parse, default=["default"],
                        help=f"comma-separated, among {', '.join(attention_kernels.CHOICES)}: the first opens every runtime, each other "
                        "adds captured steps of its own")
    args = parser.parse_args()

    artifact_dir = Path(args.artifact)
    if not artifact_dir.exists():
        model, source = load_source("gpt2", None)
        export_artifact(model, source, artifact_dir, provider=args.provider)
    artifact = open_artifact(artifact_dir)
    if artifact.kv_cache != "slots" or not (artifact.attention == "standard" or (artifact_dir / DECODE_GRAPH_FILE).exists()):
        raise SystemExit(f"{artifact_dir}: need a slots artifact with standard attention, or a fused float16 one with its decode graph")
    config = artifact.config
    rows_needed = max(SOLO[0], CROWD[0])
    first, *others = args.attention_kernels
    with attention_kernels.opened_under(first):
        variants = {name: warm_batch(artifact, args.provider, cuda_graph, rows_needed)
                    for name, cuda_graph in (("uncaptured", False), ("fixed shapes", True))}
        if variants["fixed shapes"][0].captures_decode:
            variants["fixed, uncaptured"] = warm_batch(artifact, args.provider, False, rows_needed, fixed=True)
    for choice in others:
        with attention_kernels.opened_under(choice):
            variants[f"fixed shapes, {choice} attention"] = warm_batch(artifact, args.provider, True, rows_needed)
    best, generated = alternate(variants, args.rounds, config.vocab_size)
    runtime = variants["fixed shapes"][0]
    captured = capture_state(runtime)
    print(f"{artifact_dir} ({config.n_layer} layers, d_model {config.d_model}, {artifact.dtype}, {artifact.attention} attention), {runtime.provider}, greedy, "
          f"best of {args.rounds} rounds, alternating; fixed shapes: {captured}; attention kernels: {first} "
          f"({attention_kernels.CHOICES[first] or 'ONNX Runtime as it chooses'})\n")
    print("| decode steps | batch 1 ms/step | batch 1 tokens/s | batch 16 ms/step | batch 16 tokens/s | same tokens as uncaptured "
          "| same tokens as fixed, uncaptured |")
    print("|---|---:|---:|---:|---:|:-:|:-:|")
    for name in variants:
        cells = []
        for shape in (SOLO, CROWD):
            seconds, tokens, _ = best[(name, shape)]
            steps = tokens / shape[0]
            cells.append(f"{seconds / steps * 1e3:.2f} | {tokens / seconds:.1f}")
        same = {other: all(generated[(name, s)] == generated[(other, s)] for s in (SOLO, CROWD)) if other in variants else None
                for other in ("uncaptured", "fixed, uncaptured")}
        marks = ["n/a" if v is None else "yes" if v else "NO" for v in same.values()]
        print(f"| {name} | " + " | ".join(cells) + f" | {marks[0]} | {marks[1]} |")
    print("\nHost work per decode step (ONNX Runtime's run a no-op), best of 3 passes of 200 steps (fewer on a short context):\n")
    print("| decode steps | batch 1 host ms/step | batch 16 host ms/step |")
    print("|---|---:|---:|")
    for name, (runtime, batch) in variants.items():
        cells = [f"{host_ms_per_step(runtime, batch, rows):.3f}" for rows in (SOLO[0], CROWD[0])]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nmachine: {describe(runtime.provider)}")


if __name__ == "__main__":
    main()
