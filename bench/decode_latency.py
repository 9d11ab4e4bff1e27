"""Decode speed of a preset (gpt2 by default; qwen3-0.6b, qwen2.5-0.5b, ...): transformers' generate vs our eager model
vs our ONNX graph.

Batch 1, greedy, a 128-token prompt, 128 new tokens, the same weights everywhere. Decode tokens/s counts
the 127 tokens after the first (prefill excluded). Also the cost of one decode step at past 16 vs past
1,000. The ONNX graph runs as the server runs a lone stream (the slots layout, bench/decode_step.py).
Prints markdown tables and the machine it ran on.

    python bench/decode_latency.py [--preset gpt2] [--artifact artifacts/PRESET] [--provider auto|cpu|cuda] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import one_row_pool, onnx_step, slots_generate  # noqa: E402
from machine import describe  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.export.pipeline import export_artifact, load_source  # noqa: E402
from kvserve.model.checkpoint import save_checkpoint  # noqa: E402
from kvserve.model.generate import generate  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 128, 128


def timed(fn, *args) -> float:
    """Wall time of fn(*args) in seconds."""
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def decode_rates(repeats: int, runners: list) -> list[tuple[float, float]]:
    """(tokens/s, ms/step) of decode alone for each runner: time(N tokens) - time(1 token) over N - 1 steps.
    The implementations take turns within every repeat, so machine drift affects all of them alike; the best
    (least disturbed) time of each is kept."""
    first = [[] for _ in runners]
    full = [[] for _ in runners]
    for _ in range(repeats):
        for i, run_n in enumerate(runners):
            first[i].append(timed(run_n, 1))
            full[i].append(timed(run_n, NEW_TOKENS))
    rates = []
    for t_first, t_all in zip(first, full, strict=True):
        per_step = (min(t_all) - min(t_first)) / (NEW_TOKENS - 1)
        rates.append((1.0 / per_step, per_step * 1e3))
    return rates


def eager_step(model, past_len: int):
    config = model.config
    shape = (1, config.n_kv_head, past_len, config.d_head)
    past = [(torch.randn(shape), torch.randn(shape)) for _ in range(config.n_layer)]
    mask = torch.ones(1, past_len + 1, dtype=torch.int64)
    pos = torch.tensor([[past_len]])
    ids = torch.tensor([[42]])

    def step():
        with torch.no_grad():
            model(ids, mask, pos, past)

    return step


def interleaved_median_ms(short, long, repeats: int = 40) -> tuple[float, float]:
    """Median ms of two step functions timed alternately, so machine drift affects both alike."""
    for _ in range(3):
        short(), long()
    times = {short: [], long: []}
    for _ in range(repeats):
        for fn in (short, long):
            start = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - start)
    return statistics.median(times[short]) * 1e3, statistics.median(times[long]) * 1e3


def open_preset(path: str, provider: str, model, source) -> DecoderRuntime:
    """A runtime over the preset (seed 0) exported at path (the slots layout, float32); exported there first if missing."""
    if not Path(path).exists():
        print(f"exporting the {source['name']} preset to {path} ...", file=sys.stderr)
        export_artifact(model, source, path, provider=provider)
    artifact = open_artifact(path)
    if artifact.manifest["source"] != source or artifact.kv_cache != "slots" or artifact.quantization is not None or artifact.dtype != "float32":
        sys.exit(f"{path} is not the {source['name']} preset (seed 0), float32, with the slots KV cache")
    config = artifact.config
    return DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, provider)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="gpt2", help="the preset whose random weights all three run")
    parser.add_argument("--artifact", help="the preset's float32 artifact (default artifacts/PRESET); exported there first if missing")
    parser.add_argument("--provider", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model, source = load_source(args.preset, None, seed=0)
    runtime = open_preset(args.artifact or f"artifacts/{args.preset}", args.provider, model, source)
    config = model.config
    pool = one_row_pool(runtime, config)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, config.vocab_size, PROMPT_LEN)]

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(model, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    hf_ids = torch.tensor([prompt])

    def hf_run(n):
        with torch.no_grad():
            hf.generate(input_ids=hf_ids, attention_mask=torch.ones_like(hf_ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)

    # Same weights, same tokens: check before timing anything.
    eager = generate(model, [prompt], 16).tokens[0].tolist()
    with torch.no_grad():
        theirs = hf.generate(input_ids=hf_ids, attention_mask=torch.ones_like(hf_ids), max_new_tokens=16, do_sample=False, pad_token_id=0)
    ours = slots_generate(runtime, pool, prompt, 16)
    assert ours == eager == theirs[0, PROMPT_LEN:].tolist(), "the implementations disagree; not timing"

    provider = runtime.provider
    names = ["transformers generate (torch, KV cache)", "kvserve eager model (torch, KV cache)", f"kvserve ONNX, slots ({provider})"]
    runners = [hf_run, lambda n: generate(model, [prompt], n), lambda n: slots_generate(runtime, pool, prompt, n)]
    rows = [(name, *rate) for name, rate in zip(names, decode_rates(args.repeats, runners))]
    hf_rate = rows[0][1]
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"## Decode, {args.preset} preset ({parameters:.0f}M parameters, float32), batch 1, greedy, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens\n")
    print("| implementation | decode tokens/s | ms/step | vs transformers |")
    print("|---|---:|---:|---:|")
    for name, rate, ms in rows:
        print(f"| {name} | {rate:.1f} | {ms:.2f} | {rate / hf_rate:.2f}x |")
    print("\n## One decode step (B=1, T=1), median ms, by past length (the two lengths timed alternately)\n")
    print("| implementation | past 16 | past 1,000 | ratio |")
    print("|---|---:|---:|---:|")
    short, long = interleaved_median_ms(onnx_step(runtime, config, 16), onnx_step(runtime, config, 1000))
    print(f"| kvserve ONNX, slots ({provider}) | {short:.2f} | {long:.2f} | {long / short:.2f}x |")
    short, long = interleaved_median_ms(eager_step(model, 16), eager_step(model, 1000))
    print(f"| kvserve eager | {short:.2f} | {long:.2f} | {long / short:.2f}x |")
    print(f"\nmachine: {describe(provider)}; torch {torch.__version__} ({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
