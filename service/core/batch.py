"""The running batch: carries out each step the scheduler plans (step_plan.StepPlan) in one model call over the pool's
rows as the plan lays them out (the scheduler's kv_rows.KvRows own which sequence holds which row and every row move;
the batch moves none), then hands each sampled row's logits or greedy token to its sequence. One step thread calls it.

A step runs, in one model call, one token for every row that decodes and one chunk of one row's prompt
(contract/io_contract.py, the slots layout). A row with nothing to decode this step (the one whose prompt the chunk
belongs to, or a free row below the last used one) is fed a scratch token written at the pool's last column, which no
real token ever occupies. Decode rows read only the columns up to the longest of them; a chunk reads its own row. So
when no prompt chunk runs and one row is much longer than the rest (a long prompt now decoding), that row's token
goes through the chunk instead, and the others read their own short widths, not the long one's. A row that checks
drafts (step_plan.StepPlan.draft_row) goes through the chunk the same way, its last token and its drafts, with logits
at each: it takes tokens until one differs from its draft (_check_drafts), and its length counts only the columns it
kept.

A batch with fixed_decode (the runtime captures CUDA graphs) runs each decode-only step at a bucketed shape instead
(decode_shape: rows and width rounded up to powers of two; a fused artifact's decode graph reads each row's own
length, so its shapes are row counts alone), every shape bound, and captured, at warm-up (prepare_decode_shapes);
the rows beyond the batch's run scratch tokens. Steps with a chunk keep exact shapes.

A step whose sampled rows all take the graph's greedy token (Sequence.takes_greedy_token: greedy, no penalty, no logit
bias, no constraint, no log-probabilities) asks the runtime for those tokens alone, so its logits never leave the
device; one row that needs them, or records its logits (the load gate's), makes the step read them (needs_logits).

A step with constrained rows (a response_format, structured.py) computes their masks on a thread of its own while
the model runs, samples the unconstrained rows first, then each constrained row among the ids its mask allows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from kvserve.contract.config import DecoderConfig
from kvserve.contract.io_contract import STANDARD
from kvserve.runtime import DecoderRuntime, decode_shape, decode_shapes, pool_capacity

from .drafts import StepCosts
from .kv_rows import HeldRow
from .sequence import Sequence
from .step_plan import StepPlan, StepResults
from .structured import FormatError, TokenMasks

log = logging.getLogger(__name__)

# A decoding row takes the chunk's place (when free) once it is this much longer than every other row:
# reading its width in every row would cost more than the extra row the decode part then computes.
SOLO_MIN_RATIO, SOLO_MIN_EXTRA = 2, 32


def needs_logits(seqs: list[Sequence]) -> bool:
    """Whether a step sampling for seqs must read their logits back, or their greedy tokens will do."""
    return any(seq.needs_logits for seq in seqs)


def advance_each(seqs: list[Sequence], logits: np.ndarray | None, greedy_tokens: np.ndarray,
                 rows: list[int] | None = None, masks=None) -> StepResults:
    """logits (K, V) (None: a step that returned greedy tokens alone) and greedy_tokens (K,):
    seqs[i]'s are row rows[i] (default: row i), read in place, not copied; masks (None: no row is constrained): waits
    for the constrained ones' allowed tokens (SlotBatch._start_masks), called after every unconstrained one has its
    token. One sequence's failure is that sequence's alone."""
    results: StepResults = []
    order = range(len(seqs))
    if masks is not None:  # unconstrained first (a stable sort), while the masks finish
        order = sorted(order, key=lambda i: seqs[i].constraint is not None)
    allowed = None
    for i in order:
        seq = seqs[i]
        row = i if rows is None else rows[i]
        try:
            if seq.constraint is not None and allowed is None and masks is not None:
                allowed = masks()
            mask = allowed.get(seq) if allowed is not None and seq.constraint is not None else None
            results.append((seq, seq.advance(None if logits is None else logits[row], greedy_tokens[row], mask)))
        except FormatError as exc:  # the request's format failed (outgrew its limits): its error, not a bug
            log.info("sequence %d: %s", seq.id, exc)
            seq.finished = True
            results.append((seq, exc))
        except Exception as exc:  # a bug in one request's sampling or text must not stop the others
            log.exception("sequence %d failed", seq.id)
            seq.finished = True
            results.append((seq, exc))
    return results


class SlotBatch:
    """The running batch over one SlotPool's rows. Not thread-safe: one step thread calls it."""

    def __init__(self, runtime: DecoderRuntime, config: DecoderConfig, max_rows: int, fixed_decode: bool | None = None):
        """fixed_decode: run decode-only steps at bucketed shapes (runtime.run_decode); default: when the runtime
        captures them as CUDA graphs."""
        self.runtime, self.config, self.max_rows = runtime, config, max_rows
        self.pool = runtime.new_pool(max_rows, config.n_kv_head, config.d_head, pool_capacity(config))  # every row's K/V
        self.fixed_decode = runtime.captures_decode if fixed_decode is None else fixed_decode
        if self.fixed_decode and not runtime.decodes_fixed:
            raise ValueError("fixed-shape decode steps need a standard slots graph or a fused one's decode graph (a fused step "
                             "graph's If cannot be captured; its artifact has no decode.onnx: re-export it)")
        self._masks: TokenMasks | None = None  # made for the first constrained sequence
        self.step_costs = StepCosts()  # what decode steps of each size took (the scheduler sizes drafts by it)

    # --- one step --------------------------------------------------------------------------------------

    def run(self, plan: StepPlan, before_model: Callable[[], None] | None = None) -> StepResults:
        """Carry out plan over plan.slots: one model call (none when nothing is left to run; a row cancelled since the
        plan was made sits it out), before_model called just before it."""
        held = plan.held
        decode = [s for s in plan.decode if s in held and not s.cancelled]
        chunk = plan.chunk if plan.chunk is not None and plan.chunk in held and not plan.chunk.cancelled else None
        draft_row = plan.draft_row if plan.draft_row in decode and chunk is None else None
        if plan.prompts:
            return self._step_with_prompts(plan.slots, held, decode, plan.prompts, before_model)
        if not (decode or chunk):
            return []
        return self._step(plan.slots, held, decode, chunk, plan.chunk_tokens, before_model, draft_row,
                          plan.drafts if draft_row else (), plan.grammar_drafts)

    @staticmethod
    def _solo(decode: list[Sequence], held: dict[Sequence, HeldRow]) -> Sequence | None:
        """The decoding row to run through the chunk this step, if one is far longer than the others."""
        if len(decode) < 2:
            return None
        longest, second = sorted(decode, key=lambda s: held[s].cached_tokens)[-1:-3:-1]
        far = held[longest].cached_tokens >= SOLO_MIN_RATIO * held[second].cached_tokens + SOLO_MIN_EXTRA
        return longest if far else None

    @property
    def pads_chunks(self) -> bool:
        """Whether a prompt chunk runs at a padded length (runtime.prompt_length): where the runtime pads prompts, in a
        fused graph (a standard graph's ring rows would take the padding into their windows)."""
        return self.runtime.pads_prompts and self.runtime.attention != STANDARD

    def decode_shape(self, used_rows: int, width: int) -> tuple[int, int]:
        """The fixed (rows, width) a decode-only step over the pool's first used_rows rows, reading width columns, runs
        at; width 0 for a fused decode graph, which reads each row's own columns."""
        rows, columns = decode_shape(used_rows, width, self.max_rows, self.config.n_ctx)
        return rows, columns if self.runtime.attention == STANDARD else 0

    def decode_shapes(self) -> list[tuple[int, int]]:
        """Every shape decode_shape can return for this pool, smallest first."""
        if self.runtime.attention != STANDARD:
            return sorted({(rows, 0) for rows, _ in decode_shapes(self.max_rows, self.config.n_ctx)})
        return decode_shapes(self.max_rows, self.config.n_ctx)

    def close(self) -> None:
        """The batch is no longer used: the runtime forgets the decode steps bound to its pool (and their CUDA graphs)."""
        self.runtime.release_pool(self.pool)
        if self._masks is not None:
            self._masks.close()

    def _start_masks(self, sampling: list[Sequence], drafts: dict[Sequence, list[int]] | None = None):
        """Start computing the allowed tokens of the constrained sequences among sampling, beside the model step that
        follows (and the unconstrained rows' sampling after it); returns a function that waits for them
        ({sequence: the ids it may take, ascending}), or None when none is constrained. A step waits only for what
        is left of them then, each bounded by llguidance's fuel. drafts: a row's drafts, whose mask at each position
        (the drafts before it taken) comes back as a list, one a position."""
        constrained = [seq for seq in sampling if seq.constraint is not None]
        if not constrained:
            return None
        if self._masks is None:
            self._masks = TokenMasks(self.config.vocab_size)
        return self._masks.start(constrained, drafts).result

    def prepare_decode_shapes(self) -> None:
        """Bind (and, under CUDA graphs, capture) every decode shape now, before any row is used (the scheduler asks
        this of an empty pool), so no request waits for a capture; on the thread that will run the steps (the graphs
        are that thread's). Every row runs a scratch token, written at the scratch column no real token is read from."""
        scratch = self.pool.scratch
        for rows, width in self.decode_shapes():
            positions = np.full(rows, scratch, dtype=np.int64)  # (B,)
            self.runtime.run_decode(self.pool, np.zeros(rows, np.int64), positions, np.ones((rows, width), np.int64) if width else None)

    def _decode_fixed(self, slots: list[Sequence | None], held: dict[Sequence, HeldRow], decode: list[Sequence],
                      before_model: Callable[[], None] | None) -> StepResults:
        """A decode-only step at its fixed shape (decode_shape): rows past the batch's, and holes, run a scratch token."""
        decode_rows = [held[seq] for seq in decode]
        width = int(max(row.cached_tokens for row in decode_rows)) + 1
        rows, columns = self.decode_shape(len(slots), width)
        input_ids = np.zeros(rows, dtype=np.int64)  # (B,)
        position_ids = np.full(rows, self.pool.scratch, dtype=np.int64)  # (B,): scratch unless a row decodes
        for seq, row in zip(decode, decode_rows):
            input_ids[row.index] = seq.generated[-1]
            position_ids[row.index] = row.cached_tokens
        attention_mask = (np.arange(columns)[None, :] <= position_ids[:, None]).astype(np.int64) if columns else None  # (B, W)
        masks = self._start_masks(decode)
        started = time.perf_counter()
        sampled = self.runtime.run_decode(self.pool, input_ids, position_ids, attention_mask, needs_logits(decode), before_model,
                                          self._long_rope(slots, rows))  # B rows
        for row in decode_rows:
            row.cached_tokens += 1
        results = advance_each(decode, sampled.logits, sampled.greedy_tokens, [row.index for row in decode_rows], masks)
        self.step_costs.record(len(decode), 0, time.perf_counter() - started)
        return results

    def _step(self, slots: list[Sequence | None], held: dict[Sequence, HeldRow], decode: list[Sequence],
              chunk: Sequence | None, chunk_tokens: int, before_model: Callable[[], None] | None,
              draft_row: Sequence | None = None, drafts=(), grammar_drafts: bool = False) -> StepResults:
        if self.fixed_decode and chunk is None and draft_row is None:
            return self._decode_fixed(slots, held, decode, before_model)
        # A fused graph reads each row's own columns only, so no row needs to step aside but one checking drafts.
        solo = draft_row
        if solo is None and chunk is None and self.runtime.attention == STANDARD:
            solo = self._solo(decode, held)
        if solo is not None:
            decode = [s for s in decode if s is not solo]
        decode_rows = [held[seq] for seq in decode]
        pool = self.pool
        rows = len(slots)
        scratch = pool.scratch
        input_ids = np.zeros(rows, dtype=np.int64)  # (B,): free rows and the chunk's row get a scratch token
        position_ids = np.full(rows, scratch, dtype=np.int64)  # (B,)
        for seq, row in zip(decode, decode_rows):
            input_ids[row.index] = seq.generated[-1]
            position_ids[row.index] = row.cached_tokens  # its position, and the column it is written at
        attention_mask = None  # a fused graph reads each row's own length from its position
        if self.runtime.attention == STANDARD:
            width = int(max((row.cached_tokens for row in decode_rows), default=0)) + 1
            attention_mask = (np.arange(width)[None, :] <= position_ids[:, None]).astype(np.int64)  # (B, W)
        logits_index = [row.index for row in decode_rows]
        start, piece, completes = 0, np.zeros(0, dtype=np.int64), False
        if solo is not None:  # a decode token and its drafts, fed as a chunk of its own row, logits at each
            start, piece = held[solo].cached_tokens, np.array([solo.generated[-1], *drafts], dtype=np.int64)  # (1 + k,)
            logits_index.extend(range(rows, rows + len(piece)))
        elif chunk is not None:
            start = held[chunk].cached_tokens
            piece = np.asarray(chunk.prefill_ids[start : start + chunk_tokens], dtype=np.int64)  # (T,)
            completes = start + len(piece) == len(chunk.prefill_ids)
            if completes:
                logits_index.append(rows + len(piece) - 1)  # the prompt's last token: the first new one follows
            advanced = len(piece)  # the prompt tokens it takes
            if self.pads_chunks:  # its padding written past its end, where its next tokens overwrite it before any step reads it
                padded = self.runtime.prompt_length(advanced, self.config.n_ctx - start)
                piece = np.concatenate([piece, np.zeros(padded - advanced, np.int64)])  # (T',)
                held[chunk].written_columns = max(held[chunk].written_columns, start + padded)
        chunk_row = solo if solo is not None else chunk
        decoded = decode + ([solo] if solo is not None else [])  # a token each
        sampling = decoded + ([chunk] if completes else [])  # logits_index's order
        masks = self._start_masks(sampling, {solo: list(drafts)} if drafts else None)
        started = time.perf_counter()
        sampled = self.runtime.run_slots(
            pool, input_ids, position_ids, attention_mask, piece, start, held[chunk_row].index if chunk_row is not None else 0,
            np.asarray(logits_index, dtype=np.int64), needs_logits(sampling), before_model, self._long_rope(slots, rows),
            chunk_row is not None and chunk_row.long_rope,
        )
        for row in decode_rows:
            row.cached_tokens += 1
        if drafts:
            results = advance_each(decode, sampled.logits, sampled.greedy_tokens, masks=masks)
            results += self._check_drafts(solo, held[solo], list(drafts), grammar_drafts, sampled, len(decode), masks)
        else:
            if solo is not None:
                held[solo].cached_tokens += 1
            if chunk is not None:
                held[chunk].cached_tokens = start + advanced
                if completes:
                    chunk.refill_ids = None  # a row prefilled again decodes on
            results = advance_each(sampling, sampled.logits, sampled.greedy_tokens, masks=masks)
        # What the scheduler sizes drafts and chunks by: the model call and the tokens taken from it (a sampled row draws
        # at each draft it checks, ~170 us a draw on the default model against a ~1 ms step), for a decode step plain or
        # with drafts, and what a prompt chunk adds beside decoding rows.
        if chunk is None:
            self.step_costs.record(len(decode) + (solo is not None), len(drafts), time.perf_counter() - started)
        elif decode:
            # by the prompt tokens it took, as the scheduler cuts chunks: padded, a cut to 4 tokens runs 16, which timed
            # as 16 would never be the small chunk that tells whether cutting pays (drafts.ChunkCosts), so it is cut again
            self.step_costs.record_chunk(len(decode), advanced, time.perf_counter() - started)
        return results

    def _step_with_prompts(self, slots: list[Sequence | None], held: dict[Sequence, HeldRow], decode: list[Sequence],
                           prompts: list[Sequence], before_model: Callable[[], None] | None) -> StepResults:
        """A step whose fresh prompts prefill whole as consecutive rows of one call (runtime.run_prompts), after the
        decoding rows' own call over the rows below theirs (they joined last: the decode step's shape is the decoding
        rows' alone). A prompt cancelled since the plan runs with the others (its row is its own until the next plan)
        and gets no event."""
        rows = [held[seq] for seq in prompts]
        first = rows[0].index
        if [row.index for row in rows] != list(range(first, first + len(rows))):
            raise RuntimeError(f"a prompt group's rows are not consecutive: {[row.index for row in rows]}")
        started = time.perf_counter()
        results = self._step(slots[:first], held, decode, None, 0, before_model) if decode else []
        live = [i for i, seq in enumerate(prompts) if not seq.cancelled]
        sampling = [prompts[i] for i in live]
        ids = [seq.prefill_ids for seq in prompts]
        length = self.runtime.prompt_length(max(len(prompt) for prompt in ids), self.config.n_ctx)
        masks = self._start_masks(sampling)
        long_rope = np.array([seq.long_rope for seq in prompts], np.int64) if self.runtime.long_rope else None  # (B,)
        sampled = self.runtime.run_prompts(self.pool, first, ids, length, needs_logits(sampling), None if decode else before_model,
                                           long_rope)
        for seq, row, prompt in zip(prompts, rows, ids):
            row.cached_tokens = len(prompt)
            row.written_columns = max(row.written_columns, length)  # its padding's columns too, never read
        results += advance_each(sampling, sampled.logits, sampled.greedy_tokens, live, masks)
        if decode:  # what the prompts added to the decoding rows' step, as a chunk of all their tokens would
            self.step_costs.record_chunk(len(decode), len(prompts) * length, time.perf_counter() - started)
        return results

    @staticmethod
    def _check_drafts(seq: Sequence, row: HeldRow, drafts: list[int], grammar: bool, sampled, first: int, masks) -> StepResults:
        """seq ran [its last token, *drafts] with logits at each (sampled's rows first, first + 1, ...): it takes a token
        at each position in turn (Sequence.advance, with that position's draft), until one differs from the draft, it
        finishes, or its sampling changes regime mid-way (a tool call or an answer's structure begins: the masks and
        logits this step computed no longer apply); the rest are rolled back: its length counts the columns kept."""
        start = row.cached_tokens
        constraint = seq.constraint
        logits, greedy = sampled.logits, sampled.greedy_tokens
        allowed = None
        seq.drafts.drafted += len(drafts)
        accepted_before = seq.drafts.accepted  # Sequence.advance counts each draft taken
        results: StepResults = []
        for i in range(len(drafts) + 1):
            if i and (seq.constraint is not constraint or (logits is None and seq.needs_logits)):
                break
            draft = drafts[i] if i < len(drafts) else None
            try:
                if constraint is not None and allowed is None:
                    allowed = masks()[seq]  # one mask a position (TokenMasks, with the drafts taken in turn)
                mask = allowed[i] if constraint is not None and i < len(allowed) else None
                if constraint is not None and mask is None:
                    break  # past the drafts its grammar allowed
                event = seq.advance(None if logits is None else logits[first + i], greedy[first + i], mask, draft)
            except FormatError as exc:
                log.info("sequence %d: %s", seq.id, exc)
                seq.finished = True
                results.append((seq, exc))
                break
            except Exception as exc:  # a bug in one request's sampling or text must not stop the others
                log.exception("sequence %d failed", seq.id)
                seq.finished = True
                results.append((seq, exc))
                break
            results.append((seq, event))
            if event.token_id != draft or seq.finished:
                break
        taken = len(results)  # positions whose K/V the row keeps: its last token and the drafts taken before the last event
        row.cached_tokens = start + taken
        row.written_columns = max(row.written_columns, start + len(drafts) + 1)
        seq.drafts.record(len(drafts), seq.drafts.accepted - accepted_before, grammar)
        return results

    def _long_rope(self, slots: list[Sequence | None], rows: int) -> np.ndarray | None:
        """(rows,) 1 where a longrope model's row turns by the long factors (None: the graph has no such input)."""
        if not self.runtime.long_rope:
            return None
        slots = slots[:rows] + [None] * (rows - len(slots))
        return np.array([seq is not None and seq.long_rope for seq in slots], np.int64)
