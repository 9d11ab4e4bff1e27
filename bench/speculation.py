"""Speculation (serve --speculation, service/core/drafts.py) on against off, through the engine in this process (no gRPC),
runs alternating (which goes first alternates too), one batch and one step thread for both.

Workloads (the artifact's own tokenizer):
  structured  each schema of structured_schemas.json, greedy, one request at a time: the grammar's forced tokens as
              drafts; every output parsed and validated (jsonschema), and the same with drafts as without
  structured-16  the same schemas, 16 requests at once (the schemas in turn): grammar drafts beside 15 other rows
  tool-calls  three small functions, each named by tool_choice, through the chat template: the call's name, keys and
              punctuation forced; every call's arguments validated
  repeating   the default model's continuation of verses, greedy, one request at a time: it repeats its own phrases,
              which prompt lookup drafts (the default model copies nothing from its prompt: no copy workload here)
  asked-again the verses greedy, then all of them again (an agent's loop, a retry): the second answers drafted from
              the first (the output cache, --draft-cache-tokens; each run is a fresh engine, so a fresh cache)
  copy        with --copy-artifact: the quoting model (checkpoints/kjv-quote-gpt2, exported) reciting 12 held-out
              passages after its cue, greedy, one request at a time, as many tokens as each passage: what it copies,
              prompt lookup drafts
  copy-16     the same recitals, 16 streams at once (the 12 and the first 4 again)
  open-1      the verses sampled (temperature 0.8, seeds fixed), one request at a time: drafts should stay off where
              they do not pay
  open-16     16 streams at once, sampled (temperature 0.8, seeds fixed): little repeats, so drafts should stay off
              where they do not pay

Per workload and mode: generated tokens/s (median of the rounds), on over off round by round (each round runs both,
one after the other: the median of those ratios, which a shared machine's drift between rounds does not move as it
moves the medians), drafts checked and accepted, and whether greedy outputs were identical. Also a step-cost table: a
step of 1 + k tokens against 1 at batch 1 (the chunk part, as a drafting row runs), which the scheduler's cost model
learns while serving; and with the part costs-16, a step of 16 decoding rows one of which runs 1 + k tokens through
the chunk part against a plain 16-row step, with the most such a step could give were every draft taken (ONNX
Runtime's GroupQueryAttention takes several tokens a row for one row only, so one row drafts a step: 16 + k tokens for
its cost, against 16). And with the part rows, plain decode steps of 1 to 64 rows on the artifact drafts would run
on (the copy artifact where given): the tokens a second a step of 16 + 16k tokens makes bounds what any way of checking
drafts could give 16 streams, all of them drafting k, every draft taken (a row's k tokens cost at least k rows' of
weights' arithmetic). Prints markdown tables and the machine.

    python bench/speculation.py [--artifact artifacts/kjv-gpt2] [--rounds 3]
                                [--parts structured structured-16 tool-calls repeating asked-again open-1 open-16 costs costs-16 rows copy
                                         copy-16]
                                [--copy-artifact artifacts/kjv-quote] [--copy-checkpoint checkpoints/kjv-quote-gpt2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

SCHEMAS = json.loads((Path(__file__).resolve().parent / "structured_schemas.json").read_text())
# Small functions' parameters: the default model's context (256 tokens) holds the template's tool preamble and one.
FUNCTIONS = {"weather": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                         "required": ["unit"], "additionalProperties": False},
             "count": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                       "required": ["n"], "additionalProperties": False},
             "flag": {"type": "object", "properties": {"on": {"type": "boolean"}, "mode": {"enum": ["fast", "slow"]}},
                      "required": ["on", "mode"], "additionalProperties": False}}
VERSES = ["In the beginning God created the heaven and the earth. And the earth was without form, and void;",
          "And the LORD spake unto Moses, saying, Speak unto the children of Israel, and say unto them,",
          "Blessed is the man that walketh not in the counsel of the ungodly,",
          "And it came to pass in those days, that there went out a decree from Caesar Augustus,",
          "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures:",
          "And he opened his mouth, and taught them, saying,"]


class Bench:
    def __init__(self, artifact_dir: str):
        from kvserve.contract.artifact import open_artifact
        from kvserve.contract.chat import load_chat_template
        from kvserve.contract.tokenizer import load_tokenizer
        from kvserve.runtime import DecoderRuntime
        from kvserve.service.core.batch import SlotBatch
        from kvserve.service.core.scheduler import step_thread

        artifact = open_artifact(artifact_dir)
        self.config = artifact.config
        self.runtime = DecoderRuntime(artifact.model_path, self.config.n_layer, artifact.dtype, "cpu")
        self.tokenizer = load_tokenizer(artifact.tokenizer_path)
        self.chat_template = load_chat_template(artifact.directory)
        self.batch = SlotBatch(self.runtime, self.config, 16)
        self.steps = step_thread()

    def engine(self, speculation: bool):
        from kvserve.service.core.engine import Engine
        from kvserve.service.core.limits import EngineLimits

        engine = Engine(self.runtime, self.config, self.tokenizer, EngineLimits(max_batch_size=16, speculation=speculation,
                                                                               prompt_cache=False),
                        batch=self.batch, step_thread=self.steps, chat_template=self.chat_template)
        engine.start()
        return engine

    async def run(self, speculation: bool, requests: list, concurrent: bool):
        """(seconds, [(token ids, finish)], drafted, accepted) of requests through a fresh engine."""
        engine = self.engine(speculation)

        async def one(request):
            tokens, finish = [], None
            async for event in engine.generate(request):
                tokens.append(event.token_id)
                finish = event.finish or finish
            return tokens, finish

        try:
            start = time.perf_counter()
            if concurrent:
                outputs = await asyncio.gather(*(one(r) for r in requests))
            else:
                outputs = [await one(r) for r in requests]
            seconds = time.perf_counter() - start
        finally:
            await engine.close()
        drafted = sum(f.accepted_draft_tokens + f.rejected_draft_tokens for _, f in outputs)
        accepted = sum(f.accepted_draft_tokens for _, f in outputs)
        return seconds, outputs, drafted, accepted


def copy_prompts(checkpoint: Path, count: int = 12) -> list[tuple[list[int], int]]:
    """(a held-out passage and the quoting cue, the passage's length) for the quoting model (bench/speculation_peers.py
    builds the same)."""
    from speculation_peers import prompts

    return prompts(checkpoint, count)


def workloads(parts: list[str], copy: list | None = None) -> dict:
    from kvserve.contract.chat import ChatMessage
    from kvserve.service.core.sampling import SamplingParams
    from kvserve.service.core.sequence import GenerationRequest
    from kvserve.service.core.structured import FormatKind, ResponseFormat
    from kvserve.service.core.tool_calls import ToolChoice, ToolRequest

    chosen = {}
    if "structured" in parts:
        chosen["structured"] = ([GenerationRequest(prompt_text=f"{name}: ", max_new_tokens=120,
                                                   response_format=ResponseFormat(FormatKind.JSON_SCHEMA, json.dumps(schema)))
                                 for name, schema in SCHEMAS.items()], False)
    if "structured-16" in parts:  # 16 streams at once, the schemas in turn
        chosen["structured-16"] = ([GenerationRequest(prompt_text=f"{name}: ", max_new_tokens=120,
                                                      response_format=ResponseFormat(FormatKind.JSON_SCHEMA, json.dumps(schema)))
                                    for name, schema in itertools.islice(itertools.cycle(SCHEMAS.items()), 16)], True)
    if "repeating" in parts:
        chosen["repeating"] = ([GenerationRequest(prompt_text=verse, max_new_tokens=160, ignore_eos=True) for verse in VERSES], False)
    if "copy" in parts and copy is not None:
        chosen["copy"] = ([GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=n, ignore_eos=True) for ids, n in copy], False)
    if "copy-16" in parts and copy is not None:
        chosen["copy-16"] = ([GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=n, ignore_eos=True)
                              for ids, n in (copy * 2)[:16]], True)
    if "asked-again" in parts:
        chosen["asked-again"] = ([GenerationRequest(prompt_text=verse, max_new_tokens=160, ignore_eos=True) for verse in VERSES] * 2, False)
    if "tool-calls" in parts:
        chosen["tool-calls"] = ([GenerationRequest(
            prompt_messages=(ChatMessage(role="user", content="Go."),), max_new_tokens=0,  # what the context leaves
            tools=ToolRequest(json.dumps([{"type": "function", "function": {"name": name, "parameters": schema}}]),
                              ToolChoice.FUNCTION, name, parallel=False))
            for name, schema in FUNCTIONS.items()], False)
    if "open-1" in parts:
        chosen["open-1"] = ([GenerationRequest(prompt_text=verse, max_new_tokens=160, ignore_eos=True,
                                               sampling=SamplingParams(temperature=0.8, seed=i + 1)) for i, verse in enumerate(VERSES)], False)
    if "open-16" in parts:
        chosen["open-16"] = ([GenerationRequest(prompt_text=VERSES[i % len(VERSES)], max_new_tokens=200, ignore_eos=True,
                                                sampling=SamplingParams(temperature=0.8, seed=i + 1)) for i in range(16)], True)
    return chosen


def best_ms(step, sizes: tuple[int, ...], reps: int = 30) -> list[tuple[int, float]]:
    """(size, ms) of step(size), the best of 3 passes over sizes of reps calls each."""
    times: dict[int, list[float]] = {}
    for _ in range(3):
        for size in sizes:
            step(size)
            start = time.perf_counter()
            for _ in range(reps):
                step(size)
            times.setdefault(size, []).append((time.perf_counter() - start) / reps * 1e3)
    return [(size, min(values)) for size, values in times.items()]


def prefilled_pool(bench: Bench, rows: int):
    """A pool of `rows` rows, each holding 64 prompt tokens."""
    from kvserve.runtime import pool_capacity

    config, runtime = bench.config, bench.runtime
    pool = runtime.new_pool(rows, config.n_kv_head, config.d_head, pool_capacity(config))
    none = np.zeros(0, np.int64)
    for row in range(rows):
        runtime.run_slots(pool, none, none, None, np.arange(64, dtype=np.int64) % 50 + 5, 0, row, np.array([63]), False)
    return pool


def step_costs(bench: Bench) -> list[tuple[int, float]]:
    """(tokens, ms) of a batch-1 step that runs 1 + k tokens through the chunk part, at position 64."""
    runtime, pool, none = bench.runtime, prefilled_pool(bench, 1), np.zeros(0, np.int64)
    return best_ms(lambda tokens: runtime.run_slots(pool, none, none, None, np.full(tokens, 7, np.int64), 64, 0, np.arange(tokens), False),
                   (1, 2, 3, 5, 7, 9))


def step_costs_beside_rows(bench: Bench, rows: int = 16) -> list[tuple[int, float]]:
    """(k, ms) of a step of `rows` decoding rows at position 64, the last of them running 1 + k tokens through the chunk
    part as a drafting row does (k = 0: a plain step, every row one token), best of 3."""
    runtime, pool, none = bench.runtime, prefilled_pool(bench, rows), np.zeros(0, np.int64)

    def step(k: int) -> None:
        tokens, positions = np.full(rows, 7, np.int64), np.full(rows, 64, np.int64)  # (B,)
        if k == 0:
            runtime.run_slots(pool, tokens, positions, None, none, 0, 0, np.arange(rows), False)
            return
        tokens[-1], positions[-1] = 0, pool.scratch  # the drafting row sits the decode part out, as SlotBatch runs it
        runtime.run_slots(pool, tokens, positions, None, np.full(1 + k, 7, np.int64), 64, rows - 1,
                          np.array([*range(rows - 1), *range(rows, rows + 1 + k)]), False)

    return best_ms(step, (0, 2, 4, 8))


def plain_steps(bench: Bench, sizes: tuple[int, ...] = (1, 8, 16, 24, 32, 48, 64)) -> list[tuple[int, float]]:
    """(rows, ms) of a plain decode step of that many rows at position 64, best of 3."""
    runtime, pool, none = bench.runtime, prefilled_pool(bench, max(sizes)), np.zeros(0, np.int64)
    return best_ms(lambda rows: runtime.run_slots(pool, np.full(rows, 7, np.int64), np.full(rows, 64, np.int64), None, none, 0, 0,
                                                  np.arange(rows), False), sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default="artifacts/kjv-gpt2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", nargs="+", default=["structured", "tool-calls", "repeating", "asked-again", "open-1", "open-16", "costs"])
    parser.add_argument("--copy-artifact", help="the quoting model's artifact (kvserve export --checkpoint checkpoints/kjv-quote-gpt2): "
                                                "the copy workloads")
    parser.add_argument("--copy-checkpoint", default="checkpoints/kjv-quote-gpt2",
                        help="its checkpoint (the held-out passages are tokenized by its tokenizer)")
    args = parser.parse_args()
    bench = main_bench = Bench(args.artifact)
    copying = Bench(args.copy_artifact) if args.copy_artifact else None
    copy = copy_prompts(Path(args.copy_checkpoint)) if args.copy_artifact else None
    print(f"# Speculation on against off: {args.artifact}, {args.rounds} rounds alternating\n")
    print("| workload | speculation | tokens/s (median) | on / off, round by round (median) | rounds | drafts checked | accepted | greedy outputs |")
    print("|---|---|---:|---:|---|---:|---:|---|")
    for name, (requests, concurrent) in workloads(args.parts, copy).items():
        bench = copying if name.startswith("copy") else main_bench
        asyncio.run(bench.run(False, requests[:1], concurrent))  # warm: every shape seen once
        rates = {False: [], True: []}
        last = {}
        for round_ in range(args.rounds):
            for speculation in ((False, True) if round_ % 2 == 0 else (True, False)):
                seconds, outputs, drafted, accepted = asyncio.run(bench.run(speculation, requests, concurrent))
                rates[speculation].append(sum(len(t) for t, _ in outputs) / seconds)
                last[speculation] = (outputs, drafted, accepted)
        identical = "-" if concurrent or name.startswith("open") else ("identical" if [t for t, _ in last[True][0]] == [t for t, _ in last[False][0]] else "DIFFER")
        if name.startswith("structured"):
            for (tokens, _), schema in zip(last[True][0], itertools.cycle(SCHEMAS.values())):
                text = bench.tokenizer.decode([t for t in tokens if t not in bench.config.eos_token_ids])
                jsonschema.validate(json.loads(text), schema)  # raises: an invalid output fails the bench
            identical += ", all valid"
        if name == "tool-calls":
            calls = [f.tool_calls for _, f in last[True][0]]
            for call, schema in zip(calls, FUNCTIONS.values()):
                jsonschema.validate(json.loads(call[0].arguments), schema)  # raises: a call that breaks its schema fails the bench
            identical += ", every call valid"
        for speculation in (False, True):
            _, drafted, accepted = last[speculation]
            median = statistics.median(rates[speculation])
            ratio = f" ({median / statistics.median(rates[False]):.2f}x)" if speculation else ""
            # A round's two runs are adjacent in time: their ratio cancels the drift a shared VM adds between rounds,
            # which the medians' ratio keeps.
            paired = f"{statistics.median(on / off for on, off in zip(rates[True], rates[False])):.3f}x" if speculation else ""
            print(f"| {name} | {'on' if speculation else 'off'} | {median:,.1f}{ratio} | {paired} | "
                  f"{', '.join(f'{r:,.0f}' for r in rates[speculation])} | {drafted:,} | {accepted:,} | {identical} |")
    bench = main_bench
    if "costs" in args.parts:
        costs = step_costs(bench)
        base = costs[0][1]
        print("\n| tokens a step (batch 1, chunk part) | ms (best of 3) | against 1 |")
        print("|---:|---:|---:|")
        for tokens, ms in costs:
            print(f"| {tokens} | {ms:.3f} | {ms / base:.2f}x |")
    if "costs-16" in args.parts:
        rows = 16
        costs = step_costs_beside_rows(copying or main_bench, rows)
        base = costs[0][1]
        print(f"\n| {rows} decoding rows, one drafting k (chunk part) | ms (best of 3) | against a plain step | tokens/s against plain, every draft taken |")
        print("|---:|---:|---:|---:|")
        for k, ms in costs:
            print(f"| {k} | {ms:.3f} | {ms / base:.2f}x | {(rows + k) / rows / (ms / base):.2f}x |")
    if "rows" in args.parts:
        steps = plain_steps(copying or main_bench)
        at16 = 16 / dict(steps)[16]
        print("\n| rows in a plain decode step | ms (best of 3) | tokens/s | against 16 rows |")
        print("|---:|---:|---:|---:|")
        for rows, ms in steps:
            print(f"| {rows} | {ms:.3f} | {rows / ms * 1e3:,.0f} | {rows / ms / at16:.2f}x |")
    print(f"\nMachine: {describe('cpu')}")
    for each in (main_bench, copying):
        if each is not None:
            each.steps.shutdown()


if __name__ == "__main__":
    main()
