"""Why float16 artifacts of the suite's random Llama-family configs cross the fixed float16 bounds, and what the floor
that holds them is set from: for each config and seed (built as the tests' fixture builds it), the float16 graph's
worst check (every check verify runs, nothing refused) beside the eager model's own float16 error on the prompts those
checks drew (export/own_rounding.py, the floor contract/tolerances.py's own_rounding_multiple multiplies) and beside
transformers' own float16 forward of the same checkpoint (an independent implementation: prompts of the decode and
widest prefill lengths, each prefilled whole, its logits against its float32 self). Then the worst graph / floor ratio
of each column: the multiple's margin.

    python bench/float16_floor.py [--provider cpu|cuda] [--seeds 3] [--only WORD ...] [--work DIR]
    python bench/float16_floor.py --cost [--preset gpt2]
        # what measuring the floor costs an export: the preset exported in float16 on the CPU, in a child process under
        # GNU time each, plainly and with the floor forced (every check past the fixed bounds, none refused)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from machine import describe  # noqa: E402
from parity_errors import hf_llama  # noqa: E402

from kvserve.contract import tolerances  # noqa: E402
from kvserve.export.own_rounding import own_rounding  # noqa: E402
from kvserve.export.parity import DECODE_PROMPTS, PREFILL_CASES  # noqa: E402
from kvserve.export.pipeline import export_artifact  # noqa: E402
from tests.conftest import LLAMA_CONFIGS  # noqa: E402
from tests.hf_reference import HF_CLASSES  # noqa: E402


def transformers_own_error(checkpoint: Path, model_type: str, prompts: list[list[int]]) -> float:
    """transformers' float16 forward of each prompt against its float32 one: the worst max |Δ logit| over that prompt's
    largest |float32 logit|."""
    import transformers

    model_class = getattr(transformers, HF_CLASSES[model_type][1])
    full = model_class.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    half = copy.deepcopy(full).half()
    worst = 0.0
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])  # (1, T)
            reference = full(ids).logits[0]  # (T, V)
            worst = max(worst, float((half(ids).logits[0].float() - reference).abs().max() / reference.abs().max()))
    return worst


def force_the_floor() -> None:
    """Fixed float16 bounds that every check crosses, so verify always measures the floor, and a multiple no check
    crosses: every check reported as it is, none refused."""
    fixed = tolerances.TOLERANCES["float16"]
    tolerances.TOLERANCES["float16"] = dataclasses.replace(fixed, logits_max_abs=0.0, kv_max_abs=0.0, kl_mean_max=None,
                                                           own_rounding_multiple=1e9)


def export_cost(preset_name: str, work: Path) -> None:
    """The preset's float16 export, plain and with the floor forced, each a child process under /usr/bin/time -v."""
    print(f"| {preset_name} float16 export | wall s | peak RSS GB | floor measured |\n|---|---:|---:|---|")
    for forced in (False, True):
        child = (f"import sys; sys.path[:0] = {[str(ROOT / 'bench'), str(ROOT)]!r}; import float16_floor as f; "
                 f"from kvserve.export.pipeline import export_artifact; from kvserve.model.decoders import build; "
                 f"from kvserve.model.presets import preset; {'f.force_the_floor(); ' if forced else ''}"
                 f"r = export_artifact(build(preset({preset_name!r}), 0), {{'kind': 'preset', 'name': {preset_name!r}, 'seed': 0}}, "
                 f"{str(work / f'{preset_name}-{forced}')!r}, dtype='float16', provider='cpu'); print('floor', r.own_rounding)")
        done = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", child], capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"float16_floor: the {'forced' if forced else 'plain'} export failed: {done.stderr.strip().splitlines()[-1]}")
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\d+):([\d.]+)", done.stderr)
        rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
        floor = re.search(r"^floor (.*)$", done.stdout, re.M).group(1)
        print(f"| {'floor forced' if forced else 'plain'} | {60 * int(wall.group(1)) + float(wall.group(2)):.1f} | {rss / 1e6:.2f} | {floor} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seeds", type=int, default=3, help="random weights per config: its test seed, then 1, 2, ... (default 3)")
    parser.add_argument("--only", nargs="*", default=[], help="the configs whose name contains one of these words")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--cost", action="store_true", help="time and peak memory of a preset's float16 export, plain and with the floor forced")
    parser.add_argument("--preset", default="gpt2", help="the preset --cost exports (default gpt2: the largest reference held whole)")
    args = parser.parse_args()
    if args.cost:
        print(f"machine: {describe('cpu')}\n")
        export_cost(args.preset, args.work or Path(tempfile.mkdtemp(prefix="float16-floor-cost-")))
        return
    if args.seeds < 1:
        parser.error(f"--seeds counts the random weights each config is built with: at least 1, not {args.seeds}")
    fixed = tolerances.TOLERANCES["float16"]
    force_the_floor()
    work = args.work or Path(tempfile.mkdtemp(prefix="float16-floor-"))
    print(f"machine: {describe(args.provider)}; float16 graphs checked on the {args.provider} provider\n")
    print("| config | seed | attention | graph logits | own logits | graph / own | transformers' own | graph K/V | own K/V | "
          "graph / own | mean KL |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst_logits = worst_kv = worst_kl = 0.0
    for name, (model_type, _) in LLAMA_CONFIGS.items():
        if args.only and not any(word in name for word in args.only):
            continue
        for seed in [None] + list(range(1, args.seeds)):
            model, source = hf_llama(name, work, seed)
            try:
                report = export_artifact(model, source, work / f"artifact-{len(name)}-{seed}", provider=args.provider, dtype="float16")
            except Exception as exc:  # a config the provider refuses in float16: named, not fatal
                print(f"| {name} | {seed or 'own'} | export failed: {str(exc).splitlines()[0][:120]} | | | | | | | | |")
                continue
            rng = np.random.default_rng(0)
            prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in DECODE_PROMPTS + PREFILL_CASES[-1]]
            independent = transformers_own_error(Path(source["path"]), model_type, prompts)
            own = report.own_rounding
            logits = max(c.max_abs_logits / c.max_abs_eager_logit for c in report.checks)
            kv = max(c.kv_max_abs or 0.0 for c in report.checks)
            kl = max(c.kl_mean for c in report.checks)
            print(f"| {name} | {seed or 'own'} | {report.attention} | {logits:.2e} | {own['logits']:.2e} | {logits / own['logits']:.2f} | "
                  f"{independent:.2e} | {kv:.2e} | {own['kv']:.2e} | {kv / own['kv']:.2f} | {kl:.1e} |", flush=True)
            worst_logits, worst_kv = max(worst_logits, logits / own["logits"]), max(worst_kv, kv / own["kv"])
            worst_kl = max(worst_kl, kl)
    multiple = fixed.own_rounding_multiple
    print(f"\nworst graph / own: logits {worst_logits:.2f}, K/V {worst_kv:.2f}; the multiple {multiple:g} (margin x"
          f"{multiple / max(worst_logits, worst_kv, 1e-30):.2f}); worst mean KL {worst_kl:.1e} (held at {fixed.kl_mean_max:g})")


if __name__ == "__main__":
    main()
