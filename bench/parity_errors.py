"""How far artifacts are from the eager reference: on this CPU in float32, the numbers the float32 bounds are set from.

Exports every float32 model the test suite exports (the tiny presets, the trained default model, and the
Llama-family test configs in each attention the suite uses) with the float32 bounds opened wide, so every check
runs to the end, and prints each check's errors both as absolute values and as fractions of their scale (the
largest |eager logit| of the check; the largest |eager K/V| of each (layer, head)): the way the bounds in
contract/tolerances.py read them. Then the worst of each column and the bound's margin over it.

    python bench/parity_errors.py [--only WORD ...] [--work DIR]
    python bench/parity_errors.py --kv-scales   # the size the relative K/V bound is taken of, per model
    python bench/parity_errors.py --kv-dtype int8   # the slots exports again, and the gpt2 preset, with K/V in int8
                                                    # (or float16): what contract/tolerances.py's KV_TOLERANCES are set from
    python bench/parity_errors.py --provider cuda [--dtype float16] [--seeds 3]
        # the same on a GPU, each artifact checked on the CUDA provider (float16: the slots cases that export in it, the
        # bound opened); --seeds repeats each Llama-family config with other random weights: where a bound stands on
        # the CUDA kernels' rounding, measured across configurations and seeds (issue 50)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from machine import describe  # noqa: E402

from kvserve.contract import tolerances  # noqa: E402
from kvserve.export.onnx_export import fused_attention_refusal  # noqa: E402
from kvserve.export.pipeline import export_artifact  # noqa: E402
from kvserve.model.checkpoint import load_checkpoint  # noqa: E402
from kvserve.model.presets import preset  # noqa: E402
from kvserve.model.decoders import build  # noqa: E402
from tests.conftest import DEFAULT_CHECKPOINT, LLAMA_CONFIGS  # noqa: E402  (the suite's own models)
from tests.hf_reference import HF_CLASSES  # noqa: E402


def hf_llama(name: str, work: Path, seed: int | None = None):
    """LLAMA_CONFIGS[name] as the tests' make_hf_llama fixture builds it (same initializer range; seed None: the
    fixture's own seed)."""
    import transformers

    model_type, config = LLAMA_CONFIGS[name]
    seed = len(name) if seed is None else seed
    torch.manual_seed(seed)
    config_class, model_class = (getattr(transformers, name) for name in HF_CLASSES[model_type])
    hf_config = config_class(**{"initializer_range": 0.3, "bos_token_id": 1, "eos_token_id": 2, **config}, attn_implementation="eager")
    hf = model_class(hf_config).eval()
    with torch.no_grad():  # the fixture's norms, drawn around 1 (before 2026-12-07 this left them at 1: other weights)
        for param_name, param in hf.named_parameters():
            if "norm" in param_name:
                param.normal_(1.0, 0.3)
    directory = work / f"hf-{len(name)}-{seed}"
    hf.save_pretrained(directory)
    return load_checkpoint(directory), {"kind": "checkpoint", "path": str(directory)}


def cases(work: Path, seeds: int = 1):
    """(label, model, source, export keyword arguments) for every float32 export of the suite; seeds > 1: each
    Llama-family config again with that many other random weights (labelled name@seed)."""
    yield "tiny", build(preset("tiny"), 0), {"kind": "preset", "name": "tiny", "seed": 0}, {}
    yield "tiny", build(preset("tiny"), 0), {"kind": "preset", "name": "tiny", "seed": 0}, {"kv_cache": "concat"}
    for attention in ("fused", "standard"):
        yield "tiny-llama", build(preset("tiny-llama"), 0), {"kind": "preset", "name": "tiny-llama", "seed": 0}, {"attention": attention}
    yield "kjv-gpt2", load_checkpoint(DEFAULT_CHECKPOINT), {"kind": "checkpoint", "path": str(DEFAULT_CHECKPOINT)}, {}
    for name in LLAMA_CONFIGS:
        for seed in [None] + list(range(1, seeds)):
            model, source = hf_llama(name, work, seed)
            for extra in ({}, {"attention": "standard"}, {"kv_cache": "concat"}):
                yield name if seed is None else f"{name}@{seed}", model, source, extra


def kv_scales(work: Path) -> None:
    """Per model: the smallest and largest per-(layer, head) max |K/V| of the eager model on the golden prompt (17
    tokens), so the relative K/V bound's absolute size is known: an error the old absolute 1e-4 let through passes a
    relative 1e-4 wherever that scale is at least 1."""
    from kvserve.contract.artifact import golden_prompt

    print("| model | smallest per-(layer, head) max abs K/V | largest |\n|---|---:|---:|")
    seen = set()
    for label, model, _, _ in cases(work):
        if label in seen:
            continue
        seen.add(label)
        ids = torch.tensor([golden_prompt(model.config.vocab_size, 17)])
        with torch.no_grad():
            _, present = model(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None], model.empty_cache(1))
        scales = [t[0, h].abs().max().item() for k, v in present for t in (k, v) for h in range(t.shape[1])]
        print(f"| {label} | {min(scales):.3g} | {max(scales):.3g} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="run the cases whose label contains one of these words")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--kv-scales", action="store_true", help="print each model's per-(layer, head) K/V scale instead")
    parser.add_argument("--kv-dtype", choices=("float16", "int8"), default=None,
                        help="export the slots cases (and the gpt2 preset) with K/V in this dtype, its bounds opened instead")
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu", help="where each artifact is checked (default cpu)")
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                        help="the graphs' dtype (float16: the slots cases, its bound opened instead)")
    parser.add_argument("--seeds", type=int, default=1, help="each Llama-family config with this many random weights (default 1)")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds counts the random weights each config is built with: at least 1, not {args.seeds}")
    if args.kv_dtype and args.dtype != "float32":
        parser.error("--kv-dtype measures K/V dtypes beside float32 graphs; leave --dtype out")
    if args.kv_scales:
        kv_scales(args.work or Path(tempfile.mkdtemp(prefix="parity-errors-")))
        return
    table, key = (tolerances.KV_TOLERANCES, args.kv_dtype) if args.kv_dtype else (tolerances.TOLERANCES, args.dtype)
    bound = table[key]
    table[key] = dataclasses.replace(bound, logits_max_abs=1.0, kv_max_abs=1.0, kl_mean_max=None, text=None)  # report, never refuse
    work = args.work or Path(tempfile.mkdtemp(prefix="parity-errors-"))
    print(f"machine: {describe(args.provider)}; {args.dtype} graphs checked on the {args.provider} provider\n")
    print("| model | layout, attention | check | max abs Δ logits | max abs logit | Δ / max | rel. Δ K/V |")
    print("|---|---|---|---:|---:|---:|---:|")
    worst_logits = worst_ratio = worst_kv = 0.0
    chosen = cases(work, args.seeds)
    if args.dtype == "float16":  # slots graphs: a concat one keeps float32's role as the reference layout
        chosen = [(label, model, source, {**extra, "dtype": "float16"}) for label, model, source, extra in chosen
                  if extra.get("kv_cache") != "concat"]
    if args.kv_dtype:  # a concat graph keeps its model's dtype; each attention named, auto would choose for the K/V dtype
        chosen = [(label, model, source, {"attention": "standard" if fused_attention_refusal(model, "slots") else "fused", **extra,
                                          "kv_dtype": args.kv_dtype}) for label, model, source, extra in chosen if extra.get("kv_cache") != "concat"]
        chosen.append(("gpt2", build(preset("gpt2"), 0), {"kind": "preset", "name": "gpt2", "seed": 0}, {"kv_dtype": args.kv_dtype}))
    for index, (label, model, source, extra) in enumerate(chosen):
        if args.only and not any(word in label for word in args.only):
            continue
        try:
            report = export_artifact(model, source, work / f"artifact-{index}", provider=args.provider, **extra)
        except Exception as exc:  # a case the dtype or provider refuses (a fused graph's head size, say), or a fault: named, not fatal
            print(f"| {label} | {extra} | export failed: {str(exc).splitlines()[0][:120]} | | | | |")
            continue
        layout = f"{report.kv_cache}, {report.attention}"
        for check in report.checks:
            ratio = check.max_abs_logits / check.max_abs_eager_logit
            kv = check.kv_max_abs
            print(f"| {label} | {layout} | {check.name} | {check.max_abs_logits:.2e} | {check.max_abs_eager_logit:.3g} | "
                  f"{ratio:.2e} | {'n/a' if kv is None else f'{kv:.2e}'} |")
            worst_logits, worst_ratio = max(worst_logits, check.max_abs_logits), max(worst_ratio, ratio)
            worst_kv = max(worst_kv, kv or 0.0)
    print(f"\nworst: max abs Δ logits {worst_logits:.2e}; Δ / max abs logit {worst_ratio:.2e}; relative Δ K/V {worst_kv:.2e}")
    print(f"{key}{' K/V' if args.kv_dtype else ''} bounds: logits {bound.logits_max_abs:g}{' of the max abs logit' if bound.logits_relative else ' absolute'} "
          f"(margin x{bound.logits_max_abs / max(worst_ratio if bound.logits_relative else worst_logits, 1e-30):.1f}), "
          f"K/V {bound.kv_max_abs:g}{' relative' if bound.kv_relative else ' absolute'}"
          + (f" (margin x{bound.kv_max_abs / max(worst_kv, 1e-30):.1f})" if bound.kv_relative else ""))


if __name__ == "__main__":
    main()
