"""Where a preset's int4 error comes from: the eager model with some of its matrices rounded to 4 (or 8) bits as the
export rounds them, against the float model, on random prompts: which matrices carry the error, how it grows with
depth, and how the two K/V measures (the largest entry's, the root mean square's) read it and read a broken layer.

Rounding as ONNX Runtime's MatMulNBits quantizer does it for `kvserve export --quantize` (symmetric blocks along each
output column's inputs: the block's value of largest magnitude maps to -2^(bits-1), the rest round to the nearest
step and clip at 2^(bits-1) - 1); the tied table is rounded once, for the lookup and the head as the export shares it.
Not modelled: the kernel's int8 activations (accuracy_level 4), which measured no different (docs/parity.md). Mean KL
of every position's next-token distribution (float || rounded); K/V per (layer, head) relative to the float model's:
the worst over layers, and the first, middle and last layer's.

    python bench/int4_error_sources.py [--preset qwen2.5-0.5b] [--prompts 2] [--length 48]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

from kvserve.export.pipeline import load_source  # noqa: E402
from kvserve.export.quantize import BLOCKS  # noqa: E402

TABLE = "the tied table (lookup and head)"


def rounded(weight: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """weight (out, in) rounded in blocks of `block` inputs per output, as MatMulNBits stores it."""
    out, width = weight.shape
    x = torch.nn.functional.pad(weight, (0, (-width) % block)).reshape(out, -1, block)  # (out, blocks, block)
    lowest, highest = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    extreme = torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))  # (out, blocks, 1): signed
    scale = extreme / lowest
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.clamp(torch.round(x / scale), lowest, highest) * scale).reshape(out, -1)[:, :width]


KINDS = {"qkv_proj": "qkv", "c_attn": "qkv", "o_proj": "o_proj", "attn.c_proj": "o_proj", "gate_up_proj": "gate_up", "c_fc": "gate_up",
         "down_proj": "down", "mlp.c_proj": "down"}  # Llama-family and GPT-2 names


def kind_of(name: str) -> str:
    return next((kind for part, kind in KINDS.items() if name.endswith(part)), "other")


def with_bits(model, bits_of) -> torch.nn.Module:
    """A copy of model whose Linear weights (and the tied table) are rounded to bits_of(kind) bits; None leaves them."""
    rounded_model = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in rounded_model.named_modules():
            if isinstance(module, torch.nn.Linear) and (bits := bits_of(kind_of(name))):
                module.weight.copy_(rounded(module.weight, bits, BLOCKS[f"int{bits}"][1]))
        table = rounded_model.model.embed_tokens if hasattr(rounded_model, "model") else rounded_model.transformer.wte
        if (bits := bits_of(TABLE)):
            table.weight.copy_(rounded(table.weight, bits, BLOCKS[f"int{bits}"][1]))
    return rounded_model


def only_in(kind: str, bits: int, others: int | None):
    """Bits for a kind of matrix: bits for kind, others for the rest."""
    return lambda k: bits if k == kind else others


def forward(model, ids: torch.Tensor):
    batch, length = ids.shape
    with torch.no_grad():
        return model(ids, torch.ones(batch, length, dtype=torch.int64), torch.arange(length).expand(batch, length), model.empty_cache(batch, 0))


def divergence(reference, other) -> tuple[float, np.ndarray, np.ndarray]:
    """Mean KL, and per layer the worst head's K/V error as (largest entry, root mean square), both relative."""
    (ref_logits, ref_kv), (logits, kv) = reference, other
    p, q = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    largest, rms = [], []
    for (k0, v0), (k1, v1) in zip(ref_kv, kv, strict=True):
        pairs = [(a.double(), b.double()) for a, b in ((k0, k1), (v0, v1))]  # (B, H, T, d_k) each
        largest.append(max(float(((a - b).abs().amax((0, 2, 3)) / a.abs().amax((0, 2, 3))).max()) for a, b in pairs))
        rms.append(max(float(((a - b).pow(2).mean((0, 2, 3)) / a.pow(2).mean((0, 2, 3))).sqrt().max()) for a, b in pairs))
    return kl, np.array(largest), np.array(rms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--length", type=int, default=48)
    args = parser.parse_args()
    model, _ = load_source(args.preset, None, seed=0)
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, model.config.vocab_size, (args.prompts, args.length)))
    reference = forward(model, ids)
    kinds = ("qkv", "o_proj", "gate_up", "down", TABLE)
    variants = {
        "every matrix and the table in 4 bits (the int4 export)": lambda kind: 4,
        **{f"only {k} in 4 bits": only_in(k, 4, None) for k in kinds},
        **{f"int4, {k} in 8 bits": only_in(k, 8, 4) for k in kinds},
        "int4, attention's matrices (qkv, o_proj) in 8 bits": lambda kind: 8 if kind in ("qkv", "o_proj") else 4,
        "int4, the table and gate_up in 8 bits": lambda kind: 8 if kind in (TABLE, "gate_up") else 4,
        "every matrix and the table in 8 bits (the int8 export)": lambda kind: 8,
    }
    layers = model.config.n_layer
    middle = layers // 2
    print(f"## Where int4's error comes from: {args.preset} preset (random weights, {layers} layers), {args.prompts} random prompts "
          f"of {args.length} tokens, eager model with rounded weights against the float one\n")
    print(f"| weights | mean KL | K/V largest entry: worst (layer) | K/V root mean square: worst (layer) | RMS at layers 0 / {middle} / {layers - 1} |")
    print("|---|---:|---:|---:|---:|")

    def row(label, rounded_model):
        kl, largest, rms = divergence(reference, forward(rounded_model, ids))
        print(f"| {label} | {kl:.4f} | {largest.max():.3f} ({int(largest.argmax())}) | {rms.max():.3f} ({int(rms.argmax())}) | "
              f"{rms[0]:.2f} / {rms[middle]:.2f} / {rms[-1]:.2f} |", flush=True)

    for label, bits_of in variants.items():
        row(label, with_bits(model, bits_of))
    broken = with_bits(model, lambda kind: 4)
    attention = broken.model.layers[middle].self_attn if hasattr(broken, "model") else broken.transformer.h[middle].attn
    projection = attention.qkv_proj if hasattr(attention, "qkv_proj") else attention.c_attn
    with torch.no_grad():
        projection.weight.zero_()  # what a zeroed scale tensor does to the graph
    row(f"the int4 export with layer {middle}'s Q/K/V projection lost (broken)", broken)
    print(f"\nmachine: {describe()}; torch {torch.__version__}")


if __name__ == "__main__":
    main()
