"""Export and verify of the 3-8 B models people run on CPUs: peak memory and time of `kvserve export` on a checkpoint
of a published model's shape (random weights, bfloat16 shards of 2 GB with their index, as downloaded), per precision;
or of a preset; this tree against a baseline revision, alternating (--baseline).

    python bench/large_export.py [--shape qwen3-4b] [--precision int4 float16] [--work /tmp/kvserve-large] [--residual-scale 0.015625]
    python bench/large_export.py --preset qwen2.5-0.5b --precision int4 --baseline d63c112 [--rounds 2]
    python bench/large_export.py --shape llama3.1-8b --layers 2 --residual-scale 0.015625 --baseline HEAD  # the numbers, quickly

--layers keeps the shape's first N layers (its vocabulary and widths whole): a quick look at how a precision moves the
numbers (verify's mean KL is in the table), not a figure of the whole model's memory or time. --baseline with --shape
exports the same checkpoint with a revision's kvserve in turn with this tree's.

The checkpoint is written once into --work (kept for the next run; 8 GB for qwen3-4b, 16 GB for llama3.1-8b) a tensor
at a time. Each export runs as its own process under /usr/bin/time -v (peak RSS is its maximum resident set: what
the process held, the page cache of the files it read not included) and the table says which stages took the time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_memory import install_revision  # noqa: E402
from machine import describe  # noqa: E402

from kvserve.contract.config import DecoderConfig, RopeScaling  # noqa: E402
from kvserve.model.checkpoint import _checkpoint_shapes, write_checkpoint  # noqa: E402
from kvserve.model.weights import skeleton  # noqa: E402

SHARD_BYTES = 2 * 10**9  # transformers' default max_shard_size for these models' published shards ("2GB" .. "5GB")

SHAPES = {
    # Qwen3-4B's published config: 36 layers of 2,560, 32 query and 8 K/V heads of 128, per-head Q/K norms, tied
    # 151,936-token head, 40,960-token context. 4.02 B parameters.
    "qwen3-4b": DecoderConfig(
        model_type="qwen3", vocab_size=151936, n_ctx=40960, d_model=2560, n_head=32, n_kv_head=8, head_dim=128, n_layer=36, d_mlp=9728,
        eos_token_ids=(151645, 151643), bos_token_id=151643, rope_theta=1000000.0, layer_norm_eps=1e-6, qk_norm=True,
    ),
    # Llama-3.1-8B's: 32 layers of 4,096, 32 query and 8 K/V heads of 128, untied 128,256-token head, llama3 RoPE scaling
    # to a 131,072-token context. 8.03 B parameters.
    "llama3.1-8b": DecoderConfig(
        model_type="llama", vocab_size=128256, n_ctx=131072, d_model=4096, n_head=32, n_kv_head=8, n_layer=32, d_mlp=14336,
        eos_token_ids=(128001, 128008, 128009), bos_token_id=128000, rope_theta=500000.0, layer_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
    ),
}
PRECISIONS = {"int4": ["--quantize", "int4"], "int4-attention4": ["--quantize", "int4", "--attention-bits", "4"], "int4-b32": ["--quantize", "int4", "--quantize-block", "32"], "int8-b32": ["--quantize", "int8", "--quantize-block", "32"], "int8": ["--quantize", "int8"], "float16": ["--dtype", "float16"], "float32": [],
              # docs/models.md's recipe for many streams on a CPU
              "int4-many-streams": ["--quantize", "int4", "--quantize-block", "256", "--attention-bits", "4", "--kv-dtype", "int8"]}


RESIDUAL_PROJECTIONS = ("o_proj.weight", "down_proj.weight")


def random_tensors(config: DecoderConfig, seed: int = 0, residual_scale: float = 1.0):
    """A checkpoint's tensors of config's shape, one at a time: unit norms, zero biases, normal(0, 0.02) matrices but for
    the projections into the residual stream, drawn at 0.02 / sqrt(2 x layers) as GPT-2 initialises them. Drawn all at
    0.02, 36 layers make a chaotic function of their input: the Qwen3-4B shape's int8 artifact then differed from
    itself by 0.26 in a logit between a cached decode and a recompute of the same tokens, and no quantized export of it
    could pass verify (bench/results/cpu-2core.md, "Export in bounded memory"). residual_scale multiplies those
    projections' spread again: at 1/64 the residual stream is mostly the embedding, no error is amplified through the
    depth, and an int4 export verifies (what a serving benchmark of the shape needs; its speed does not depend on the
    values)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = _checkpoint_shapes({key: tuple(p.shape) for key, p in skeleton(config).state_dict().items()}, config)
    residual_std = residual_scale * config.initializer_range / math.sqrt(2 * config.n_layer)
    for name, shape in shapes.items():
        if "norm" in name:
            yield name, torch.ones(shape)
        elif name.endswith("bias"):
            yield name, torch.zeros(shape)
        else:
            std = residual_std if name.endswith(RESIDUAL_PROJECTIONS) else config.initializer_range
            yield name, torch.randn(shape, generator=generator, dtype=torch.bfloat16).mul_(std)


def shape_config(shape: str, layers: int | None = None) -> DecoderConfig:
    """The shape's config, cut to its first `layers` layers if given (random_tensors then draws the residual projections
    for that depth)."""
    config = SHAPES[shape]
    return config if layers is None else replace(config, n_layer=layers)


def checkpoint(shape: str, work: Path, residual_scale: float = 1.0, layers: int | None = None) -> Path:
    name = shape if layers is None else f"{shape}-{layers}l"
    directory = work / (f"{name}-bf16-scaled" if residual_scale == 1.0 else f"{name}-bf16-residual-{residual_scale:g}")
    config = shape_config(shape, layers)
    if not (directory / "model.safetensors.index.json").exists():
        started = time.perf_counter()
        write_checkpoint(config, directory, random_tensors(config, residual_scale=residual_scale), torch.bfloat16, SHARD_BYTES)
        print(f"wrote {directory} in {time.perf_counter() - started:.0f} s", flush=True)
    return directory


def timed_export(source: list[str], out: Path, precision: str, site: Path | None = None) -> dict:
    """One `kvserve export` of source (its --checkpoint or --preset arguments) under /usr/bin/time -v, the kvserve installed
    at site if given: peak RSS, wall seconds, the stage lines it printed, its result."""
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "kvserve.cli", "export", *source, "--out", str(out), "--overwrite",
               *PRECISIONS[precision]]
    env = dict(os.environ) | ({"PYTHONPATH": str(site)} if site is not None else {})
    started = time.perf_counter()
    # not from a checkout: `python -m` puts the working directory first on the path, and from the repository's root that
    # imports this tree's kvserve ahead of site's (the baseline then measured this tree against itself, until 2026-11-29)
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    wall = time.perf_counter() - started
    (out.parent / f"{out.name}.log").write_text(run.stdout + run.stderr)  # the whole report, beside the artifact
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)
    stages = re.findall(r"^== (.+?): ([\d.]+) s \(total", run.stdout + run.stderr, re.M)
    passed = "result: PASS" in run.stdout + run.stderr
    return {"peak_gb": int(peak.group(1)) * 1024 / 1e9 if peak else float("nan"), "wall_s": wall, "passed": passed, "rc": run.returncode,
            "stages": stages, "tail": (run.stdout + run.stderr)[-1500:], "kl": verify_kl(run.stdout + run.stderr)}


def verify_kl(report: str) -> tuple[float, float]:
    """(the largest mean KL of verify's prefill and decode checks, its held-out text's mean KL) from the report an export
    prints (NaN where absent): how far the precision moved the logits, passed or not."""
    checks = [float(row.split("|")[5]) for row in re.findall(r"^\| (?:prefill|decode)[^\n]*", report, re.M)]
    text = re.search(r"held-out text, teacher-forced .*?mean KL ([\d.e+-]+)", report)
    return max(checks, default=float("nan")), float(text.group(1)) if text else float("nan")


def exports_in_turn(args, source: list[str], stem: str) -> list[tuple[str, int, str, dict]]:
    """(precision, round, tree, timed_export's result) of each --precision's export of source (its --checkpoint or
    --preset arguments), --rounds times, this tree's and --baseline's in turn, each into WORK/STEM-PRECISION[-baseline]."""
    trees = {"this tree": None} | ({f"baseline {args.baseline}": install_revision(args.baseline)} if args.baseline else {})
    rows = []
    for precision in args.precision:
        for round_ in range(args.rounds):
            for tree, site in trees.items():
                out = args.work / f"{stem}-{precision}{'' if site is None else '-baseline'}"
                result = timed_export(source, out, precision, site)
                data = out / "model.onnx.data"
                result["data_sha256"] = json.loads((out / "manifest.json").read_text())["files"].get("model.onnx.data", "") if data.exists() else ""
                if result["rc"] not in (0, 1):
                    print(result["tail"], file=sys.stderr)
                rows.append((precision, round_, tree, result))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--precision", nargs="+", choices=sorted(PRECISIONS), default=["int4"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvserve-large"))
    parser.add_argument("--preset", help="export this preset instead of a checkpoint of --shape")
    parser.add_argument("--baseline", help="a revision whose export runs in turn with this tree's (of --preset, or of --shape's checkpoint)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--residual-scale", type=float, default=1.0,
                        help="the residual projections' spread times this (random_tensors): 1/64 makes an int4 export verify")
    parser.add_argument("--layers", type=int, help="the shape's first N layers only (shape_config)")
    args = parser.parse_args()
    if args.rounds < 1 or (args.layers is not None and args.layers < 1):
        parser.error("--rounds and --layers must be at least 1")
    args.work = args.work.resolve()  # the exports run from another directory
    if args.preset:
        compare_presets(args)
        return
    directory = checkpoint(args.shape, args.work, args.residual_scale, args.layers)
    params = sum(torch.Size(s).numel() for s in (p.shape for p in skeleton(shape_config(args.shape, args.layers)).parameters()))
    # random weights: a vocabulary would change nothing measured
    rows = exports_in_turn(args, ["--checkpoint", str(directory), "--no-tokenizer"], directory.name)
    layers = "" if args.layers is None else f" (its first {args.layers} layers)"
    print(f"\n{args.shape}{layers}: {params / 1e9:.2f} B parameters, bfloat16 shards of {SHARD_BYTES / 1e9:.0f} GB, residual scale {args.residual_scale:g}")
    print("| precision | tree | export + verify peak RSS | wall | verify | mean KL, worst check / held-out text | where the time went |")
    print("|---|---|---|---|---|---|---|")
    for precision, _, tree, r in rows:
        where = ", ".join(f"{name} {float(s):.0f} s" for name, s in r["stages"])
        verdict = "PASS" if r["passed"] else f"FAIL (rc {r['rc']})"
        checks, text = r["kl"]
        print(f"| {precision} | {tree} | {r['peak_gb']:.2f} GB | {r['wall_s'] / 60:.1f} min | {verdict} | {checks:.3f} / {text:.3f} | {where} |")
    print(f"\nmachine: {describe()}")


def compare_presets(args) -> None:
    """--preset: this tree's export against --baseline's, alternating, each round; and whether their weights files match."""
    rows = exports_in_turn(args, ["--preset", args.preset], args.preset)
    print(f"\n{args.preset}: `kvserve export --preset`, {args.rounds} round(s), trees alternating")
    print("| precision | round | tree | peak RSS | wall | verify | model.onnx.data sha256 |")
    print("|---|---|---|---|---|---|---|")
    for precision, round_, tree, r in rows:
        verdict = "PASS" if r["passed"] else f"FAIL (rc {r['rc']})"
        print(f"| {precision} | {round_ + 1} | {tree} | {r['peak_gb']:.2f} GB | {r['wall_s']:.0f} s | {verdict} | {r['data_sha256'][:12]} |")
    print(f"\nmachine: {describe()}")


if __name__ == "__main__":
    main()
