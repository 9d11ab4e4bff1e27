"""The load-time parity gate: before serving, prove that this artifact, on this provider, through this
engine's own prefill + cached-decode path, reproduces what the eager reference recorded at export time."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from kvserve.contract.artifact import Artifact, contract_problems
from kvserve.contract.tokenizer import ByteTokenizer
from kvserve.contract.tolerances import kl_divergence, logits_bound
from kvserve.errors import UserError
from kvserve.runtime import DecoderRuntime

from ..core.batch import SlotBatch
from .kv_budget import MIN_BUDGET_TOKENS
from ..core.limits import EngineLimits
from ..core.model_info import GateResult
from ..core.sampling import SamplingParams
from ..core.scheduler import Scheduler
from ..core.sequence import Sequence
from ..core.text import IncrementalDecoder, StopSequences


def _greedy_sequence(seq_id: int, prompt: list[int], max_new_tokens: int, capture_logits: bool = False) -> Sequence:
    """A server-internal greedy sequence (no client, no stop rules) driven straight through a batch."""
    return Sequence(
        id=seq_id,
        prompt_ids=prompt,
        max_new_tokens=max_new_tokens,
        params=SamplingParams(temperature=0.0),
        stop_ids=frozenset(),
        return_logprobs=False,
        decoder=IncrementalDecoder(ByteTokenizer()),
        stops=StopSequences(()),
        captured_logits=[] if capture_logits else None,
    )


def _scheduler(runtime: DecoderRuntime, artifact: Artifact, rows: int, budget: int, tokens: int) -> Scheduler:
    """A scheduler over a batch of rows for sequences of at most tokens: the replay's, not the whole context's
    (a long-context model's full rows would be gigabytes the server has not yet decided to spend)."""
    config = dataclasses.replace(artifact.config, n_ctx=min(artifact.config.n_ctx, tokens))
    return Scheduler(SlotBatch(runtime, config, rows), budget)


def replay_golden(runtime: DecoderRuntime, artifact: Artifact, step_token_budget: int = EngineLimits.step_token_budget,
                  beside_a_row: bool = False, in_a_group: bool = False) -> GateResult:
    """Greedy-decode the golden prompt through the serving batch and scheduler (prefill from an empty cache, then
    cached decode steps), taking each token from the graph's greedy_tokens as serving does and reading the logits
    beside it: the tokens must be the eager reference's (where the precision requires it) and each its own logits'
    argmax; the logits must be within the precision's bound of the reference's. beside_a_row: a row admitted first
    decodes the whole time, so the golden prompt's chunks run beside a decoding row (a chunk graph's steps), one
    prompt a step; in_a_group: the golden prompt joins with that row's, the two prefilled together as rows of one call
    (Scheduler.prompt_group), the budget raised to hold them."""
    golden = artifact.golden()
    tolerance = artifact.tolerance
    steps, prompt = len(golden.tokens), golden.prompt_ids.tolist()
    seq = _greedy_sequence(0, prompt, steps, capture_logits=True)
    companions = [_greedy_sequence(1, prompt[:1], len(prompt) + steps - 1)] if beside_a_row or in_a_group else []
    tokens = len(prompt) + steps + 1
    budget = max(step_token_budget, 2 * runtime.prompt_length(len(prompt), tokens)) if in_a_group else step_token_budget
    scheduler = _scheduler(runtime, artifact, 1 + len(companions), budget, tokens)
    if in_a_group and scheduler.prompt_group_rows < 2:  # rows not kept dense (no CUDA runtime to copy them): never grouped
        scheduler.batch.close()
        return GateResult(True, "not run: this server prefills no prompts together (its rows are not kept dense)")
    if not in_a_group:
        scheduler.prompt_group_rows = 1
    grouped = []  # each step's prompts prefilled together
    planned = scheduler.plan

    def plan():
        made = planned()
        grouped.append(len(made.prompts))
        return made

    scheduler.plan = plan
    try:  # in a group the golden prompt is the first row: the chunk graph's rows' operator runs it (the chunk, the other)
        results = scheduler.drive([seq] + companions if in_a_group else companions + [seq])
    finally:
        scheduler.batch.close()  # its bound steps (and CUDA graphs) are the replay's alone
    if in_a_group and 2 not in grouped:
        return GateResult(False, "golden replay in a group: the golden prompt did not join one")
    for _, event in results:
        if isinstance(event, BaseException):
            return GateResult(False, f"golden replay failed: {type(event).__name__}: {event}")
    logits = np.stack(seq.captured_logits).astype(np.float64)  # (N, V)
    same_tokens = seq.generated == golden.tokens.tolist()
    own_argmax = bool((logits.argmax(-1) == np.array(seq.generated)).all())
    # Once the greedy tokens part, the two continue from different text: compare up to and including the
    # first step that differs (its logits still came from the same context).
    differ = [i for i, (a, b) in enumerate(zip(seq.generated, golden.tokens.tolist())) if a != b]
    compared = differ[0] + 1 if differ else steps
    max_abs = float(np.abs(logits[:compared] - golden.logits[:compared]).max())
    bound = logits_bound(tolerance, golden.logits[:compared])
    passed = (same_tokens or not tolerance.greedy_identical) and own_argmax and max_abs <= bound
    summary = (
        f"golden replay on {runtime.provider}: {steps} greedy tokens {'identical' if same_tokens else 'DIFFER'}"
        f"{'' if own_argmax else ' (greedy_tokens NOT its logits argmax)'}, "
        f"max abs logit diff {max_abs:.2e} (tolerance {bound:.3g}, {artifact.precision})"
    )
    if tolerance.kl_mean_max is not None:
        kl = float(kl_divergence(golden.logits[:compared], logits[:compared]).mean())
        passed = passed and kl <= tolerance.kl_mean_max
        summary += f", mean KL {kl:.2e} over {compared} steps (tolerance {tolerance.kl_mean_max:g})"
    return GateResult(passed, summary)


def run_gate(runtime: DecoderRuntime, artifact: Artifact, step_token_budget: int = EngineLimits.step_token_budget) -> GateResult:
    problems = contract_problems(runtime.signature(), artifact)
    if problems:
        return GateResult(False, "KV contract mismatch: " + "; ".join(problems[:3]))
    served = replay_golden(runtime, artifact, step_token_budget)  # one row: a small artifact's decode graph runs it
    if runtime.chunkless_session is None or not served.passed:
        return served
    if runtime.splits_steps:  # the one row ran the decode graph alone: the chunk graph runs chunks beside decoding rows
        rows = replay_golden(runtime, artifact, step_token_budget, beside_a_row=True)  # and prompts prefilled together
        group = replay_golden(runtime, artifact, step_token_budget, in_a_group=True)
        return GateResult(rows.passed and group.passed, f"{served.summary}; beside a decoding row, through the chunk graph: "
                                                        f"{rows.summary}; prefilled in a group of two: {group.summary}")
    with runtime.step_graph_only():  # what steps of several rows run
        rows = replay_golden(runtime, artifact, step_token_budget)
    return GateResult(rows.passed, f"{served.summary}; through the step graph: {rows.summary}")


WARM_UP_NEW_TOKENS = 2  # the first from the prefill's logits, the second from a decode step
# Two rows joining one after the other give a step of each kind the serving loop runs: a prompt chunk alone, a chunk
# beside a decoding row, a decode alone. Before 2026-11-29 every row of the batch was warmed this way (the rows join one
# chunk a step and leave after their second token, so no step ever held more than two rows): the same three kinds of
# step, repeated, which cost a Llama-3.1-8B start 23 s on an AVX2 machine and bought its first requests nothing
# (bench/startup.py).
WARM_UP_ROWS = 2
# A chunk of two tokens takes the multi-token path as one of 8 did, at a quarter of its compute (an 8 B model's
# warm-up: 1.58 s instead of 2.85 on that machine, bench/startup.py --cold).
WARM_UP_PROMPT = 2


def chunk_warm_up_prompts(allowance: int, tail: int, most_tokens: int) -> list[int]:
    """The prompt lengths that, joining one after another beside one decoding row, run every chunk length the scheduler
    gives a chunk beside one row (Scheduler.chunk_allowance(1): its allowance and tail), first from an empty row, then
    (the longer prompts' second chunks) after a first chunk of the allowance; none over most_tokens."""
    whole = list(range(1, allowance + tail + 1))  # each one chunk, from column 0
    second = [allowance + length for length in range(tail + 1, allowance + tail + 1)]  # a chunk of the allowance, then this
    return [length for length in whole + second if length <= most_tokens]


def warm_chunk_lengths(batch, step_token_budget: int, kv_budget: int | None) -> None:
    """Run a prompt chunk of every length chunk_warm_up_prompts makes beside a decoding row (where chunks run padded,
    of every length they run at: batch.pads_chunks), on the serving path: on
    CUDA each new chunk length's first run through the chunk (or step) graph cost ~50-100 ms (bench/results/h200.md,
    third loan: the GroupQueryAttention of the chunk, and the If's set-up), which every stream then waited for. Its
    decoding row ends with the last chunk, so no step without a chunk runs: none of these first runs is timed into the
    step costs (drafts.StepCosts measures a chunk against a plain step of as many rows)."""
    config = batch.config
    scheduler = Scheduler(batch, step_token_budget, kv_budget=kv_budget)
    scheduler.prompt_group_rows = 1  # one after another (warm_prompt_groups runs the groups' shapes)
    held = scheduler.budget_tokens()
    most = config.n_ctx - 1 if held is None else min(config.n_ctx - 1, held // 2)
    allowance, tail = scheduler.chunk_allowance(1)
    lengths = chunk_warm_up_prompts(allowance, tail, most)
    if batch.pads_chunks:  # chunks run at a few lengths: a prompt for each length they run at
        ran, kept = set(), []
        for length in lengths:
            chunks = [(0, length)] if length <= allowance + tail else [(0, allowance), (allowance, length - allowance)]
            padded = {batch.runtime.prompt_length(tokens, config.n_ctx - start) for start, tokens in chunks}
            if not padded <= ran:
                kept.append(length)
                ran |= padded
        lengths = kept
    # The joiners' first tokens differ, so none finds an earlier one's K/V in the prompt cache and skips its chunk.
    joiners = [_greedy_sequence(-10 - i, [(i + 3 + 7 * j) % config.vocab_size for j in range(length)], 1)
               for i, length in enumerate(lengths)]
    chunks = sum(1 if length <= allowance + tail else 2 for length in lengths)
    companion = _greedy_sequence(-9, [0], max(1, min(most, chunks + 1)))  # decoding beside every joiner's chunks, then done
    failures = [e for _, e in scheduler.drive([companion] + joiners) if isinstance(e, BaseException)]
    if failures:
        raise failures[0]
    scheduler.forget_cached()


def prompt_group_shapes(scheduler: Scheduler) -> list[tuple[int, int]]:
    """Every (rows, length) a prompt group of scheduler's may run (Scheduler.prompt_group) where its runtime pads a
    group's length to a few sizes (pads_prompts), smallest first; none where it groups no prompts or pads none."""
    runtime, config = scheduler.batch.runtime, scheduler.batch.config
    if scheduler.prompt_group_rows < 2 or not scheduler.step_token_budget or not runtime.pads_prompts:
        return []
    tokens, _ = scheduler.chunk_allowance(0)  # the most a group takes: beside no decoding row
    most_rows = min(scheduler.prompt_group_rows, scheduler.batch.max_rows)
    lengths = sorted({runtime.prompt_length(n, config.n_ctx) for n in range(1, min(tokens // 2, config.n_ctx - 1) + 1)})
    return [(rows, length) for length in lengths for rows in range(2, min(most_rows, tokens // length) + 1)]


def warm_prompt_groups(batch, step_token_budget: int) -> None:
    """Run a prompt group of every shape prompt_group_shapes gives, in the empty pool's first rows (given back after):
    each shape's first run through the chunk graph on CUDA costs what a new chunk length's does."""
    shapes = prompt_group_shapes(Scheduler(batch, step_token_budget))
    vocab = batch.config.vocab_size
    for rows, length in shapes:
        batch.runtime.run_prompts(batch.pool, 0, [[(i + 3) % vocab] for i in range(rows)], length, with_logits=False)
    for row in range(max((rows for rows, _ in shapes), default=0)):
        batch.pool.discard(row)


def warm_up(batch, artifact: Artifact, step_token_budget: int = EngineLimits.step_token_budget, kv_budget: int | None = None,
            chunk_lengths: bool | None = None) -> None:
    """Run each kind of step the serving loop runs once through the serving path (WARM_UP_ROWS rows with short prompts),
    so the first requests pay no first-run costs; the batch is empty afterwards. A batch of fixed-shape decode steps
    then binds (and captures) every shape it may run, at every row count. The prompt cache forgets the warm-up's rows:
    no request should find their made-up tokens. chunk_lengths: also a chunk of every length beside a decoding row
    (warm_chunk_lengths) and a prompt group of every shape (warm_prompt_groups); None: on CUDA, where a new chunk
    length's first run stalls the streams (on the CPU it costs nothing a step shows, and an 8 B model's warm-up would
    spend seconds on it)."""
    config = batch.config  # as served: its context may be cut (serve --max-context)
    prompt_len = max(1, min(WARM_UP_PROMPT, config.n_ctx // 2))
    new_tokens = max(1, min(WARM_UP_NEW_TOKENS, config.n_ctx - prompt_len))
    scheduler = Scheduler(batch, step_token_budget, kv_budget=kv_budget)  # the warm-up's rows: the server's are made after it
    scheduler.prompt_group_rows = 1  # the rows join one after the other, for each kind of step (and groups' below)
    held = scheduler.budget_tokens()
    if held is not None and held < MIN_BUDGET_TOKENS:
        raise UserError(f"--kv-cache-memory {kv_budget} holds {held} tokens of this model's K/V ({scheduler.token_bytes} bytes each); "
                        f"give it at least {MIN_BUDGET_TOKENS * scheduler.token_bytes} ({MIN_BUDGET_TOKENS} tokens)")
    if held is not None:  # each row within the K/V budget (at least kv_budget.MIN_BUDGET_TOKENS)
        new_tokens = max(1, min(new_tokens, held - prompt_len))
    rows = [_greedy_sequence(-1 - i, [i % config.vocab_size] * prompt_len, new_tokens) for i in range(min(WARM_UP_ROWS, batch.max_rows))]
    results = scheduler.drive(rows)  # a failure anywhere counts
    failures = [e for _, e in results if isinstance(e, BaseException)]
    if failures:
        raise failures[0]
    scheduler.forget_cached()
    if (batch.runtime.device == "cuda" if chunk_lengths is None else chunk_lengths) and batch.max_rows > 1:
        warm_chunk_lengths(batch, step_token_budget, kv_budget)
        warm_prompt_groups(batch, step_token_budget)
    if batch.fixed_decode:
        scheduler.prepare_decode_shapes()
