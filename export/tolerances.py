"""Parity tolerances per precision; shared by `kvserve verify` and the server's load-time gate (no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    logits_max_abs: float  # largest |onnx - eager| allowed on any logit
    kv_max_abs: float  # largest |onnx - eager| allowed on any present K/V entry, per (layer, head)
    top1_min: float  # least share of positions whose argmax token agrees
    greedy_identical: bool  # whether greedy tokens must match exactly


TOLERANCES = {
    "float32": Tolerance(logits_max_abs=1e-4, kv_max_abs=1e-4, top1_min=1.0, greedy_identical=True),
    # float16 keeps ~3 significant digits; LayerNorm statistics and softmax run in float32 in the graph.
    "float16": Tolerance(logits_max_abs=5e-2, kv_max_abs=5e-2, top1_min=0.95, greedy_identical=False),
}
