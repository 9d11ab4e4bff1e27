"""Random schedules, seeded: sequences arriving at random steps, some prompts beginning like an earlier sequence's prompt
and output (the prompt cache, prefixes copied from rows in use) or repeating themselves, drafts offered from each
sequence's true continuation (every third offer with one token wrong: kept whole, cut short, refused), under random row
counts, step token budgets, step-time bounds and K/V budgets, with the prompt cache on or off. However they meet, each
sequence gets the tokens it gets alone, to the rounding of the logits (Schedule.parted): on the CPU's rules,
transformers' own generate; on CUDA's (steps split between the chunk and decode graphs, prompts padded and prefilled
together, decode steps at fixed shapes, rows left as holes or kept dense), the same float16 artifact's, one sequence at
a time, greedy or sampled with a seed. The fixed tests beside this file each hold one way of meeting; these hold the
ways nobody wrote down. Measured step times steer the step-time bound and, where costs are measured, which rows draft,
so a schedule is not replayed exactly from its seed: a sequence that parts is reported whole (its schedule's limits,
its prompt and both continuations)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvserve.contract.artifact import open_artifact
from kvserve.contract.tolerances import TOLERANCES
from kvserve.runtime import DecoderRuntime
from kvserve.service.core.batch import SlotBatch
from kvserve.service.core.scheduler import MAX_PROMPT_GROUP, Scheduler

from ...conftest import PROVIDER
from ...hf_reference import hf_greedy_logits
from ..conftest import FlatCosts, sequence


# How far apart two float16 computations of one position's logits may round: a few units in the last place (ulps) of
# float16 at the largest logit. A step that checks drafts computes a row's positions together, where a one-token step
# computes one, and the two can round a logit a unit apart (measured: 1.05 ulps, the tiny-llama preset on the CPU).
FLOAT16_ROUNDING_ULPS = 4


def float16_rounding(logits: np.ndarray) -> float:
    return FLOAT16_ROUNDING_ULPS * float(np.spacing(np.float16(np.abs(logits).max())))


def float32_rounding(logits: np.ndarray) -> float:
    """Twice the float32 parity bound (contract/tolerances.py) at these logits: the artifact's and transformers' logits
    each within it of the eager model's, their argmax can part only where transformers' top two are this close (these
    schedules' closest: 2.7e-6 of the largest logit, Phi-3's, against the bound's 1e-4)."""
    return 2 * TOLERANCES["float32"].logits_max_abs * float(np.abs(logits).max())


@dataclass
class Schedule:
    """What one random schedule ran: its limits, its sequences with the tokens and logits each gets alone, and what its
    steps did."""

    limits: dict
    rounding: Callable[[np.ndarray], float]  # how far apart rounding alone may put one position's logits
    sequences: list = field(default_factory=list)
    sampling: dict = field(default_factory=dict)  # sequence id -> its sampling parameters
    expected: dict = field(default_factory=dict)  # sequence id -> its tokens alone
    expected_logits: dict = field(default_factory=dict)  # sequence id -> its logits alone, a row a token
    seen: Counter = field(default_factory=Counter)  # what the steps did: groups, chunks, reused tokens, drafts

    def parted(self) -> list[dict]:
        """Every sequence whose tokens are not its tokens alone, with all a reader needs to run it again; but not one
        whose first token apart rounding explains (counted in seen): a greedy row's near-tie (its token's logit alone
        within `rounding` of the best), or a sampled row's draw where every logit up to there is within `rounding` of
        its logits alone."""
        parted = []
        for seq in self.sequences:
            expected, reference = self.expected[seq.id], self.expected_logits[seq.id]
            if seq.generated == expected:
                continue
            at = next(i for i, (got, alone) in enumerate(zip(seq.generated, expected)) if got != alone)
            if (self._within_rounding(seq, reference, at) if self.sampling[seq.id]
                    else reference[at][seq.generated[at]] >= reference[at].max() - self.rounding(reference[at])):
                self.seen["tokens moved by rounding"] += 1
                continue
            parted.append(dict(self.limits, prompt=seq.prompt_ids, sampling=self.sampling[seq.id], got=seq.generated, expected=expected))
        return parted

    def _within_rounding(self, seq, reference: list[np.ndarray], at: int) -> bool:
        return all(np.abs(got - alone).max() <= self.rounding(alone) for got, alone in zip(seq.captured_logits[: at + 1], reference))


def arriving_prompt(rng: random.Random, vocab: int, earlier: list) -> list[int]:
    """A fresh prompt of 1 to 120 tokens, a third of the long ones repeating their start; or, two times in five, an
    earlier sequence's prompt and output so far, whole (as a conversation's next turn begins) or cut anywhere, and a few
    tokens of its own."""
    if earlier and rng.random() < 0.4:
        earlier = rng.choice(earlier)
        text = earlier.prompt_ids + earlier.generated
        cut = len(text) if rng.random() < 0.5 else rng.randint(1, len(text))
        return text[:cut] + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 12))]
    prompt = [rng.randrange(3, vocab) for _ in range(rng.choice([1, 3, rng.randint(1, 40), rng.randint(1, 120)]))]
    if len(prompt) > 5 and rng.random() < 0.3:
        prompt += prompt[: rng.randint(3, len(prompt))]
    return prompt


def run_schedule(scheduler: Scheduler, rng: random.Random, count: int, sampled_share: float,
                 alone: Callable[[list[int], int, dict], tuple[list[int], list]], truth: dict,
                 rounding: Callable[[np.ndarray], float]) -> Schedule:
    """count sequences through scheduler, step by step as its loop would run them, each arriving at a random step
    (in bursts of up to 6, or at once when nothing runs); sampled_share of them sample with a seed. alone(prompt,
    max_new_tokens, sampling) gives a sequence's tokens alone, which the drafts oracle (truth) offers it, and its
    logits alone; rounding(logits) how far apart rounding alone may put them (Schedule.parted)."""
    config = scheduler.batch.config
    kv = scheduler.kv
    limits = dict(rows=kv.max_rows, budget=scheduler.step_token_budget, dense=kv.compact, bound=scheduler.step_time_bound,
                  speculation=scheduler.speculation, flat_costs=isinstance(scheduler.batch.step_costs, FlatCosts),
                  prompt_cache=kv.prefixes is not None, kv_budget=kv.budget_bytes)
    schedule = Schedule(limits, rounding)
    while len(schedule.sequences) < count or scheduler.waiting or kv.rows:
        idle = not (scheduler.waiting or kv.rows)
        if len(schedule.sequences) < count and (idle or rng.random() < 0.35):
            for _ in range(min(rng.choice([1, 1, 2, 3, 6]), count - len(schedule.sequences))):
                prompt = arriving_prompt(rng, config.vocab_size, schedule.sequences)[: config.n_ctx - 3]
                sampling = {"temperature": 0.8, "seed": rng.randrange(1 << 20)} if rng.random() < sampled_share else {}
                seq = sequence(len(schedule.sequences), prompt, rng.randint(1, min(30, config.n_ctx - len(prompt) - 1)), **sampling)
                if sampling:
                    seq.captured_logits = []  # read back to sample from anyway: recording them changes no step
                schedule.sequences.append(seq)
                schedule.sampling[seq.id] = sampling
                schedule.expected[seq.id], schedule.expected_logits[seq.id] = alone(prompt, seq.max_new_tokens, sampling)
                truth[tuple(prompt)] = schedule.expected[seq.id]
                scheduler.waiting.append(seq)
        plan = scheduler.plan()
        assert plan.decode or plan.chunk or plan.prompts, "a step planned nothing while sequences wait"
        scheduler.run_step(plan)
        schedule.seen["steps"] += 1
        schedule.seen["groups"] += len(plan.prompts) >= 2
        schedule.seen["chunks"] += plan.chunk is not None
    for seq in schedule.sequences:
        schedule.seen["reused prompt tokens"] += seq.reused_prompt_tokens
        schedule.seen["drafts refused"] += seq.drafts.drafted - seq.drafts.accepted if seq.drafts else 0
        schedule.seen["drafts kept"] += seq.drafts.accepted if seq.drafts else 0
        schedule.seen["sampled tokens"] += len(seq.generated) if schedule.sampling[seq.id] else 0
    return schedule


def alone_on(runtime: DecoderRuntime, config) -> Callable[[list[int], int, dict], tuple[list[int], list]]:
    """A sequence's tokens and logits run by itself in a batch of one row on runtime, no budget, no drafts."""

    def alone(prompt: list[int], max_new_tokens: int, sampling: dict) -> tuple[list[int], list]:
        batch = SlotBatch(runtime, config, 1)
        seq = sequence(0, prompt, max_new_tokens, **sampling)
        seq.captured_logits = []
        Scheduler(batch, step_token_budget=0, prompt_cache=False).drive([seq])
        batch.close()
        return seq.generated, seq.captured_logits

    return alone


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_random_schedules_under_cudas_rules_give_each_sequence_its_tokens_alone(family, float16_fused, oracle):
    """Steps split, prompts padded to a few lengths and fresh ones prefilled together, decode steps at fixed shapes,
    a third of the schedules with freed rows left as holes (CUDA without device copies: then a prompt a step), the
    decoding rows taking none of the step token budget, the prompt cache off in a quarter of them; 20 seeds. The
    reference is the artifact's step graph, one sequence at a time at exact shapes, token for token but where float16's
    own rounding explains the first token apart (Schedule.parted: a draft check computes a row's positions together)."""
    artifact_dir, _ = float16_fused[family]
    artifact = open_artifact(artifact_dir)
    config = artifact.config
    split = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, PROVIDER, chunk_graph=True)
    split.pads_prompts = True
    alone = alone_on(DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, PROVIDER, chunk_graph=False), config)
    seen, holes, parted = Counter(), 0, []
    for seed in range(20):
        rng = random.Random(seed)
        batch = SlotBatch(split, config, rng.choice([2, 3, 4, 6, 8]), fixed_decode=True)
        if seed % 2:
            batch.step_costs = FlatCosts()  # every draft pays: rows draft whenever the oracle offers
        scheduler = Scheduler(batch, step_token_budget=rng.choice([8, 32, 64, 192, 512]), speculation=rng.random() < 0.8,
                              draft_cache_tokens=rng.choice([0, 4096]), step_time_bound=rng.choice([0, 130]),
                              prompt_cache=seed % 4 != 1)
        scheduler.prepare_decode_shapes()
        scheduler.budget_counts_rows = False
        scheduler.kv.compact = seed % 3 != 0
        holes += not scheduler.kv.compact
        scheduler.prompt_group_rows = MAX_PROMPT_GROUP if scheduler.kv.compact else 1  # Scheduler's own rule
        schedule = run_schedule(scheduler, rng, rng.randint(8, 24), 0.3, alone, oracle, float16_rounding)
        batch.close()
        parted += schedule.parted()
        seen += schedule.seen
    assert not parted, parted
    # the schedules met every way this test is for
    assert holes and all(seen[kind] for kind in ("groups", "chunks", "reused prompt tokens", "drafts kept", "drafts refused")), seen


# A ring graph (standard attention on Gemma 3's windowed layers beside a whole-context one), a fused graph's windows,
# Phi-3's longrope (rows crossing its original context prefilled again, long) and another model's (rows turning long
# where they cross, their short columns kept), Qwen3's per-head norms and yarn, SmolLM3's unrotated sliding layers
RANDOM_CONFIGS = [("gemma3 multi-query head_dim 32 qk-norm two bases linear-rope sliding 6", "standard"),
                  ("mistral sliding window 7 head_dim 16", "auto"),
                  ("phi3 gqa 2:1 head_dim 64 longrope partial 0.75 untied", "auto"),
                  ("llama gqa 2:1 head_dim 32 longrope tied", "auto"),
                  ("qwen3 gqa 2:1 head_dim 32 qk-norm yarn tied", "auto"),
                  ("smollm3 gqa 2:1 head_dim 16 nope every 2nd sliding 5 tied", "auto")]


def test_random_schedules_give_each_sequence_transformers_tokens(llama_artifact, oracle):
    """float32 on the provider's own rules (on the CPU: a prompt a step, decoding rows counted against the budget, rows
    kept dense, and in one schedule of three a K/V budget of 1 to 2.5 whole contexts, so sequences wait for memory and
    cached rows give way), speculation on as serve's default, the prompt cache off in one schedule of three; greedy;
    3 seeds for each of RANDOM_CONFIGS, every config's parted sequences reported together."""
    seen, parted = Counter(), []
    for name, attention in RANDOM_CONFIGS:
        hf, _, artifact_dir = llama_artifact(name, attention=attention)
        artifact = open_artifact(artifact_dir)
        config = artifact.config
        runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, PROVIDER)
        oracle.clear()  # the configs draw the same prompts: each offers only its own model's continuations

        def transformers_alone(prompt: list[int], max_new_tokens: int, sampling: dict) -> tuple[list[int], list]:
            return hf_greedy_logits(hf, prompt, max_new_tokens)

        for seed in range(3):
            rng = random.Random(1000 + seed)
            batch = SlotBatch(runtime, config, rng.choice([2, 3, 4, 6]))
            if seed != 1:
                batch.step_costs = FlatCosts()
            scheduler = Scheduler(batch, step_token_budget=rng.choice([4, 8, 16, 33, 64]), speculation=True,
                                  draft_cache_tokens=rng.choice([0, 4096]), step_time_bound=rng.choice([0, 130]),
                                  prompt_cache=seed != 2)
            if seed % 2 and runtime.device == "cpu":  # under CUDA the pool is allocated whole: no K/V budget
                scheduler.kv.budget_bytes = int(scheduler.kv.tokens_bytes(config.n_ctx) * rng.uniform(1.0, 2.5))
            schedule = run_schedule(scheduler, rng, rng.randint(8, 16), 0.0, transformers_alone, oracle, float32_rounding)
            batch.close()
            parted += [dict(item, config=name) for item in schedule.parted()]
            seen += schedule.seen
    assert not parted, parted
    assert all(seen[kind] for kind in ("chunks", "reused prompt tokens", "drafts kept", "drafts refused")), seen
