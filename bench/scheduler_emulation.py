"""What the scheduler makes of a device's step costs without the device: the engine in this process (no gRPC) under N
concurrent streams (prompts of --prompt-tokens, --new-tokens each, greedy, 2 requests a stream), its model calls run on
a small artifact on the CPU and then held until they take what the device's steps took: a decode step --decode-ms, a
step with a prompt chunk --chunk-ms plus --chunk-ms-per-token a chunk token. The defaults are the H200's fused gpt2
float16 steps at 16 streams (bench/results/h200.md, second loan: 0.87 ms decoding at a captured shape, 4.75 ms with a
chunk through the step graph), so what this prints is a forecast of the scheduling on that GPU, not a measurement of it:
the host work (the engine, the scheduler, the tiny model's CPU step inside each held call) is this machine's.

Each configuration is a step token budget, a step-time bound (serve's --step-token-budget / --step-time-bound) and
a rule: `rows`, the CPU's (the decoding rows take their share of the budget, Scheduler.budget_counts_rows; one prompt
joins a step); `cuda`, CUDA's one prompt a step (the rows take none of the budget); `groups`, CUDA's as a server that
splits its steps runs it (Scheduler.prompt_group: fresh prompts join together and prefill as rows of one call, held
to --chunk-ms and --chunk-ms-per-token a token of every row's padded length, beside the decoding rows' own call, held
to --decode-ms). Group lengths are padded as on CUDA (DecoderRuntime.pads_prompts) in every configuration. They take
turns, round by round. Per configuration and streams: tokens/s, the model calls and those with prompt tokens, rows in
a call (p50 / max), prompt tokens in a call that has some (p50), the model calls' share of the wall (the rest is the
step thread's host work, or its wait for the event loop: where it is small, the host bounds the tokens/s, not the
emulated device) and the part of it the calls ran past their emulated time (the small artifact's own CPU step outlasting
the device's: where it is large, this CPU bounds the forecast), time to first token and the gaps between tokens
(p50 / p99).

    python bench/scheduler_emulation.py --artifact DIR (the tiny preset's) [--streams 16,64,256]
        [--configs 32/130/rows,32/130/cuda,512/130/cuda] [--decode-ms 0.87] [--chunk-ms 4.75] [--chunk-ms-per-token 0]
        [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpc_load import InProcess, percentile, prompt_ids  # noqa: E402
from machine import describe  # noqa: E402

from kvserve.service.core.scheduler import MAX_PROMPT_GROUP  # noqa: E402


RULES = ("rows", "cuda", "groups")


@dataclass(frozen=True)
class Rules:
    budget: int
    bound: int
    rule: str  # one of RULES

    @classmethod
    def parse(cls, text: str) -> "Rules":
        """budget/bound/rule, e.g. 32/130/cuda; ValueError naming what is wrong."""
        parts = text.split("/")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in RULES:
            raise ValueError(f"{text!r} is not budget/bound/rule: two whole numbers and one of {', '.join(RULES)}")
        return cls(int(parts[0]), int(parts[1]), parts[2])

    def __str__(self) -> str:
        return f"{self.budget} / {self.bound}% / {self.rule}"


def hold_steps(runtime, decode_s: float, chunk_s: float, chunk_token_s: float, steps: list) -> None:
    """Every model call of runtime takes at least the emulated device's time; steps gets (rows, prompt tokens, seconds
    the call took, seconds it was to take) of each."""
    run_slots, run_prompts = runtime.run_slots, runtime.run_prompts

    def hold(began: float, seconds: float) -> None:
        left = seconds - (time.perf_counter() - began)
        if left > 0:
            time.sleep(left)

    def held_slots(pool, input_ids, position_ids, attention_mask, piece, *args, **kwargs):
        began = time.perf_counter()
        out = run_slots(pool, input_ids, position_ids, attention_mask, piece, *args, **kwargs)
        held = chunk_s + chunk_token_s * len(piece) if len(piece) else decode_s
        hold(began, held)
        steps.append((len(input_ids), len(piece), time.perf_counter() - began, held))
        return out

    def held_prompts(pool, first_row, prompts, length, *args, **kwargs):
        began = time.perf_counter()
        out = run_prompts(pool, first_row, prompts, length, *args, **kwargs)
        held = chunk_s + chunk_token_s * len(prompts) * length
        hold(began, held)
        steps.append((len(prompts), len(prompts) * length, time.perf_counter() - began, held))
        return out

    runtime.run_slots, runtime.run_prompts = held_slots, held_prompts
    runtime.pads_prompts = True  # a group's rows run the lengths a CUDA server's do


async def load(local: InProcess, rules: Rules, streams: int, prompt_tokens: int, new_tokens: int, first_seed: int) -> dict:
    engine = local.engine(max_queue=4 * streams, step_token_budget=rules.budget, step_time_bound=rules.bound)
    scheduler = engine.scheduler  # each read as a step is planned: none has been yet
    scheduler.budget_counts_rows = rules.rule == "rows"
    scheduler.prompt_group_rows = MAX_PROMPT_GROUP if rules.rule == "groups" else 1
    ttfts, gaps = [], []
    try:
        async def stream(k: int) -> None:
            for r in range(2):  # new prompts every time: nothing comes from the prompt cache
                stamps = await InProcess.stamps(engine, prompt_ids(first_seed + 2 * k + r, prompt_tokens, local.config.vocab_size),
                                                new_tokens)
                ttfts.append(stamps[1] - stamps[0])
                gaps.extend(np.diff(stamps[1:]))

        began = time.perf_counter()
        await asyncio.gather(*(stream(k) for k in range(streams)))
        wall = time.perf_counter() - began
    finally:
        await engine.close()
    return {"tokens_per_s": streams * 2 * new_tokens / wall, "wall": wall, "ttft": ttfts, "gaps": gaps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True, help="a small artifact (the tiny preset's): its CPU step sits inside each held call")
    parser.add_argument("--streams", default="16,64,256")
    parser.add_argument("--configs", default="32/130/rows,32/130/cuda,512/130/cuda",
                        help="budget/bound/rule, comma-separated: serve's --step-token-budget and --step-time-bound, and "
                             "'rows' (the CPU's rule), 'cuda' (CUDA's, a prompt a step) or 'groups' (CUDA's, prompts "
                             "prefilled together)")
    parser.add_argument("--decode-ms", type=float, default=0.87)
    parser.add_argument("--chunk-ms", type=float, default=4.75)
    parser.add_argument("--chunk-ms-per-token", type=float, default=0.0)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    try:
        configs = [Rules.parse(text) for text in args.configs.split(",")]
        levels = [int(n) for n in args.streams.split(",")]
    except ValueError as error:
        parser.error(f"--configs / --streams: {error}")

    local = InProcess(args.artifact, "cpu", max_batch=args.max_batch_size)
    steps: list = []
    hold_steps(local.runtime, args.decode_ms / 1e3, args.chunk_ms / 1e3, args.chunk_ms_per_token / 1e3, steps)
    print(f"{args.artifact} on the CPU, model calls held to a decode step of {args.decode_ms} ms and a step with a chunk of "
          f"{args.chunk_ms} ms + {args.chunk_ms_per_token} ms a chunk token; prompts of {args.prompt_tokens}, "
          f"{args.new_tokens} new tokens, 2 requests a stream, {args.rounds} rounds alternating, the best round's tokens/s\n")
    results: dict = {}
    seed = 10_000
    for _ in range(args.rounds):
        for streams in levels:
            for rules in configs:
                steps.clear()
                run = asyncio.run(load(local, rules, streams, args.prompt_tokens, args.new_tokens, seed))
                seed += 2 * streams
                rows = np.array([step[0] for step in steps])
                chunks = np.array([step[1] for step in steps if step[1]])
                run.update(steps=len(steps), chunk_steps=len(chunks), rows_p50=float(np.median(rows)), rows_max=int(rows.max()),
                           chunk_p50=float(np.median(chunks)) if len(chunks) else 0.0,
                           model_share=sum(step[2] for step in steps) / run["wall"],
                           overrun_share=sum(max(0.0, step[2] - step[3]) for step in steps) / run["wall"])
                best = results.get((streams, rules))
                if best is None or run["tokens_per_s"] > best["tokens_per_s"]:
                    results[streams, rules] = run
    print("| streams | budget / bound / rule | tokens/s | model calls | with prompt tokens | rows p50 / max | prompt tokens p50 | "
          "model calls' share of the wall (past their time) | TTFT p50 / p99 ms | gap p50 / p99 ms |")
    print("|---:|---|---:|---:|---:|---|---:|---:|---|---|")
    for streams in levels:
        for rules in configs:
            r = results[streams, rules]
            print(f"| {streams} | {rules} | {r['tokens_per_s']:,.0f} | {r['steps']} | {r['chunk_steps']} | "
                  f"{r['rows_p50']:.0f} / {r['rows_max']} | {r['chunk_p50']:.0f} | {r['model_share']:.0%} ({r['overrun_share']:.0%}) | "
                  f"{percentile(r['ttft'], 50):.1f} / {percentile(r['ttft'], 99):.1f} | "
                  f"{percentile(r['gaps'], 50):.2f} / {percentile(r['gaps'], 99):.2f} |")
    print(f"\nmachine: {describe('CPUExecutionProvider')} (the steps' times held to the emulated device's)")


if __name__ == "__main__":
    main()
