"""The scheduler loop: decides what each model step runs, hands it to the batch on the step thread, and
delivers every sequence's event to its caller on the event loop.

One step (step_plan.StepPlan) is one model call over the batch (two where prompts prefill together, below):
  - every row whose prompt is in the cache decodes one token (decode never waits for a prefill); in a step with no
    chunk, one of them may also check drafts of its next tokens (drafts.py: its grammar's forced tokens or prompt
    lookup, as many as the step times measured say pay), through the chunk part of the graph;
  - one row's prompt advances by a chunk: with rows decoding, the chunk gets what is left of the per-step
    token budget after them, cut further to what keeps the step within --step-time-bound of a decode-only step by
    the step times measured (drafts.StepCosts), so a long prompt never stalls the streams already running; with nobody
    decoding (or budget 0, no limit) the whole rest of the prompt goes in one step; a chunk that would
    leave a tail of at most a quarter of the budget takes the tail too (a step of its own would cost the
    running streams a whole step's gap for a few tokens);
  - a longrope model's row whose next token would take it past the original context turns by the long factors from
    there; Phi-3's is first prefilled again, whole, its K/V turned long (transformers recomputes its cache there): it
    waits its turn as a prompt does, then decodes on; a prompt already past the original context turns long from the
    start;
  - a waiting request joins when no other prompt is being prefilled and a row is free, so no row sits in
    the batch idle while it waits for its turn; it takes its row as the step is planned (kv_rows.KvRows.join), its
    prompt starting past what the prompt cache held of it, so requests sharing a prefix with one still being
    prefilled wait for it and then take it instead of each computing it again;
  - where the runtime splits its steps (CUDA), the requests at the head of the queue that share nothing with the
    prompt cache or each other join together instead and prefill whole as rows of one call beside the decoding rows'
    own (prompt_group; the step's two model calls): a step with prompt tokens costs there mostly a fixed part (an
    H200's gpt2 step: 4.75 ms with a chunk of any size against 0.87 ms without), so one prompt a step held the batch
    near as many rows as a request has new tokens (bench/scheduler_emulation.py).
The scheduler owns the rows (kv_rows.KvRows): every join, release, refill and long-rope turn is made here, and the
plan hands the batch the rows as they stand; the batch assembles one model call's arrays and hands results back.
Cancelled sequences leave as the next step is planned, finished ones at the end of theirs.

While rows are running, the step thread plans and runs step after step itself (Scheduler._run_steps), handing
each step's events to the event loop without waiting for it: the loop's round trip (waking it, planning there,
handing the next step back to the step thread) would otherwise sit between every two model calls of a stream. A step
whose tokens no caller streams (answers taken whole), none of them a sequence's last, waits for the next hand-over, at
most UNSTREAMED_HANDOFF_NS: woken every step, the loop's work runs beside the model call on the core ONNX Runtime's
second thread wants (the quoting model's whole answers over HTTP, batch 1, by hand: 1.19x the tokens a second held
back, 1.09x with speculation). The
queue is a deque that both threads use (the loop appends and withdraws, a plan pops); a step's plan reads the
cancellations the loop set. An empty batch, or a closing scheduler, hands the loop back its turn.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .drafts import DraftState, PromptLookup, SuffixCache, most_drafts
from .kv_rows import KvRows
from .model_info import LiveCounts, SequenceKv
from .prompt_cache import BLOCK_TOKENS
from .sequence import Sequence, StepEvent
from .step_plan import StepPlan, StepResults

log = logging.getLogger(__name__)

# The most fresh prompts one step prefills together (prompt_group): each (rows, length) a group runs is a shape a CUDA
# server warms up (service/process/gate.py), so rows and the lengths' buckets stay few.
MAX_PROMPT_GROUP = 16

# Steps whose tokens no caller streams reach the loop at least this often: its gauges and metrics stay this fresh.
UNSTREAMED_HANDOFF_NS = 50_000_000


def step_thread() -> ThreadPoolExecutor:
    """The one thread a scheduler runs its model steps on. The server also runs the parity gate and the warm-up on
    it: ONNX Runtime keeps CUDA graphs in the context of the thread that captured them (runtime.GRAPH_ID)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step")


@dataclass
class StepDone:
    """A step that ran, as the step thread saw it when it ended: its results, and for the metrics the prompt tokens
    each sequence that joined reused and computed, and the batch as the step left it; when it ended, and whether the
    loop should have it now (a token a caller streams, a sequence's last event)."""

    results: StepResults
    prompts: list[tuple[int, int]]
    running: int
    kv_bytes: int
    cached_rows: int
    queued: int
    cached_bytes: int
    drafted: int = 0  # draft tokens the step checked
    accepted: int = 0  # of them, those taken
    ended_ns: int = 0
    urgent: bool = True


class StepFailed(Exception):
    """A model step raised (its cause): the plan it ran, and the steps before it that the loop has not been given."""

    def __init__(self, plan: StepPlan, undelivered: list[StepDone]):
        super().__init__("the model step failed")
        self.plan, self.undelivered = plan, undelivered


def _call_soon(loop: asyncio.AbstractEventLoop, callback, steps: list[StepDone]) -> None:
    try:
        loop.call_soon_threadsafe(callback, steps)
    except RuntimeError:  # the loop closed: nobody is left to tell
        pass


class Handoff:
    """A thread that passes finished steps to the event loop (call_soon_threadsafe), so the step thread never makes the
    system call that wakes the loop itself: the GIL it would let go there goes to the loop, and the step thread would
    wait for the loop's work before its next model call. Handing over (a SimpleQueue put) keeps the GIL; this thread
    takes it when the step thread leaves it, inside the model call. Started at the first hand-over."""

    def __init__(self, deliver):
        self._deliver = deliver  # called on the loop with each list of steps handed over
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._state = threading.Lock()  # the step thread hands over and flushes while another thread may close
        # lists handed over (written by the step thread alone) and passed on (by this thread alone): equal, a flush
        # has nothing to wait for, and skips a marker's round trip through this thread (two thread wake-ups, ~0.2 ms
        # at a request's end on a 2-core VM)
        self._handed = self._passed = 0

    def hand_over(self, loop: asyncio.AbstractEventLoop, steps: list[StepDone]) -> None:
        with self._state:
            if not self._closed:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._pass_on, name="kvserve-handoff", daemon=True)
                    self._thread.start()
                self._handed += 1
                self._queue.put((loop, steps))
                return
        _call_soon(loop, self._deliver, steps)  # a step that ended after close: passed on directly

    def flush(self) -> None:
        """Wait until everything handed over so far is in the loop's queue of callbacks."""
        with self._state:
            if self._thread is None or self._closed:  # closed: the thread passes on what precedes its stop, then ends
                return
            if self._passed == self._handed:  # every list handed over is in the loop's queue already
                return
            passed = threading.Event()
            self._queue.put(passed)
        passed.wait()

    def close(self) -> None:
        with self._state:
            self._closed = True
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)  # after every item and flush handed in before it
        if thread is not None:
            thread.join()

    def _pass_on(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            loop, steps = item
            _call_soon(loop, self._deliver, steps)
            self._passed += 1
            del item, loop, steps  # while this waits for the next, it holds no step's sequences


class Scheduler:
    """Owns the waiting queue, the rows (kv_rows.KvRows over the batch's pool) and the loop; the batch
    (batch.SlotBatch) runs each step's model call."""

    def __init__(self, batch, step_token_budget: int, metrics=None, executor: ThreadPoolExecutor | None = None,
                 speculation: bool = False, draft_cache_tokens: int = 0, step_time_bound: int = 0,
                 prompt_cache: bool = True, kv_budget: int | None = None, kv_events=None):
        """prompt_cache: finished rows keep their K/V for later prompts that begin alike; kv_budget: bytes the K/V of the
        rows and the prompt cache may take (kv_rows.py; on the CPU provider only, where the pool's memory follows what
        it holds; None: no bound); kv_events: where the prompt cache's changes are published (kv_events.KvEvents)."""
        self.batch = batch
        runtime = batch.runtime
        self.kv = KvRows(batch.pool, runtime.device, batch.config.n_layer, prompt_cache,
                         kv_budget if runtime.device == "cpu" else None)
        if kv_events is not None and self.kv.prefixes is not None:
            self.kv.prefixes.events = kv_events
        self.step_token_budget = step_token_budget  # 0: no limit
        # On the CPU a decoding row costs a step about what a chunk token does, so the rows take their share of the
        # budget. On CUDA a step reads the weights once whatever its rows (an H200's captured gpt2 step: 0.67 ms at 1
        # row, 0.93 at 16), and rows taking the budget left a prompt a token or two a step once as many rows decoded:
        # under load the batch stayed near the budget's size (bench/scheduler_emulation.py).
        self.budget_counts_rows = runtime.device != "cuda"
        # Fresh prompts prefill together as rows of one call where the runtime splits its steps anyway and joins keep
        # rows dense, so that joiners' rows are consecutive (the call binds them as one block); 1: a prompt a step.
        self.prompt_group_rows = MAX_PROMPT_GROUP if runtime.splits_steps and self.kv.compact else 1
        self.step_time_bound = step_time_bound / 100  # a step with a chunk or drafts, in plain steps' time (0: no bound)
        batch.step_costs.bound = self.step_time_bound
        self.speculation = speculation  # decoding rows may check drafts (drafts.py) where the step costs say it pays
        self.outputs = SuffixCache(draft_cache_tokens if speculation else 0)  # finished outputs later rows draft from
        self.most_drafts = most_drafts(batch.pool.ring)  # a step's drafts in one row
        self.metrics = metrics
        self.waiting: deque[Sequence] = deque()
        self._owns_executor = executor is None  # a thread handed in is its giver's to close
        self._executor = step_thread() if executor is None else executor
        self._handoff = Handoff(self._deliver)
        self._closing = False  # read by the step thread between steps (_run_steps)
        self._wakeup = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()

    # --- the queue (event loop) ------------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.idle.clear()
        self._wakeup.set()

    def withdraw(self, seq: Sequence) -> None:
        """A caller went away: a waiting sequence leaves the queue now, a running one at the next step."""
        try:
            self.waiting.remove(seq)
        except ValueError:
            self._wakeup.set()

    # --- planning ---------------------------------------------------------------------------------------

    # --- what the rows hold (read by the engine, on the event loop) ----------------------------------------------

    def sequences(self) -> list[Sequence]:
        """Every sequence holding a row or waiting for one."""
        return list(self.kv.rows) + list(self.waiting)

    def free_rows(self) -> int:
        return self.kv.free_rows()

    def budget_tokens(self) -> int | None:
        """Tokens of K/V one row may hold under the K/V budget (None: no budget)."""
        return self.kv.budget_tokens()

    @property
    def token_bytes(self) -> int:
        """Bytes of K/V one token takes: K and V, every layer."""
        return self.kv.token_bytes

    def live(self) -> LiveCounts:
        """The sequences in rows and the K/V each holds, those waiting, the prompt cache's rows and bytes, the budget."""
        kv = self.kv
        rows = [(s, kv.held_bytes(s)) for s in kv.rows]
        return LiveCounts(active=len(rows), queued=len(self.waiting), cached_rows=kv.cached_rows(), kv_bytes=sum(b for _, b in rows),
                          sequences=[SequenceKv(s.id, s.total_tokens, b) for s, b in rows], cached_kv_bytes=kv.cached_bytes(),
                          kv_budget_bytes=kv.budget_bytes or 0)

    def forget_cached(self) -> None:
        """The prompt cache lets go of every row it keeps (the warm-up's made-up prompts)."""
        self.kv.forget_cached()

    # --- planning ---------------------------------------------------------------------------------------

    def chunk_allowance(self, decoding_rows: int) -> tuple[int, int]:
        """A prompt chunk beside decoding rows (plan, before the step-time bound cuts it): (the tokens it takes: the
        budget, less the rows where they count, at least one; the tail a prompt that far from its end finishes with in
        the same step)."""
        counted = decoding_rows if self.budget_counts_rows else 0
        return max(self.step_token_budget - counted, 1), self.step_token_budget // 4

    def plan(self) -> StepPlan:
        """The next step: rows cancelled since the last one leave, a waiting sequence may join (taking its row now),
        and the plan carries the rows as they then stand."""
        kv = self.kv
        kv.release([s for s in kv.rows if s.cancelled])
        rows = list(kv.rows)
        config = self.batch.config
        long_after = config.long_rope_after
        if long_after is not None:  # a row whose next token takes it past the original context turns long
            for seq in rows:
                cached = kv.held[seq].cached_tokens
                if not seq.prefilling and not seq.long_rope and cached >= long_after:
                    if config.long_rope_recompute_at is not None:
                        kv.refill(seq)  # prefilled again, whole
                    else:  # what it cached stays as it was turned
                        seq.long_rope, seq.long_rope_from = True, cached
        decode = [s for s in rows if not s.prefilling]
        prefilling = [s for s in rows if s.prefilling]
        joining = []
        if not prefilling and (group := self.prompt_group(decode)):
            for seq in group:  # the queue's head, in order: each takes the row after the last (rows stay dense)
                self.waiting.popleft()
                seq.admitted_ns = time.monotonic_ns()
                seq.long_rope = self._starts_long(seq)
                kv.join(seq)
            return StepPlan(joining=group, decode=decode, prompts=group, slots=list(kv.slots), held=kv.held)
        if not prefilling and self.waiting and kv.free_rows() > 0 and kv.fits(self.waiting[0]):  # in order: none overtakes
            joining = [self.waiting.popleft()]
            joining[0].admitted_ns = time.monotonic_ns()
            joining[0].long_rope = self._starts_long(joining[0])
            kv.join(joining[0])  # past what the prompt cache held of its prompt
            prefilling = joining
        if not prefilling:
            if self.speculation and decode:
                return self._with_drafts(decode)
            return StepPlan(decode=decode, slots=list(kv.slots), held=kv.held)
        chunk = prefilling[0]
        remaining = len(chunk.prefill_ids) - kv.held[chunk].cached_tokens
        tokens = remaining
        if decode and self.step_token_budget:
            allowance, tail = self.chunk_allowance(len(decode))
            # measured against the chunk it would be: a cut that halves what a budget's chunk adds may not halve a short
            # prompt's, and where a chunk's cost is mostly fixed (CUDA) each cut step pays that part again
            cut = None
            if self.step_time_bound:
                cut = self.batch.step_costs.chunk_cut(len(decode), self.step_time_bound, min(allowance, remaining))
            if cut is not None:  # the steps measured say a budget's chunk would stall the streams, and a smaller one less
                allowance, tail = cut, cut // 4
            if remaining > allowance + tail:
                tokens = allowance
        return StepPlan(joining=joining, decode=decode, chunk=chunk, chunk_tokens=tokens, slots=list(kv.slots), held=kv.held)

    def prompt_group(self, decode: list[Sequence]) -> list[Sequence]:
        """The waiting sequences at the head of the queue that join this step together and prefill whole as rows of one
        call (runtime.DecoderRuntime.run_prompts), none if fewer than two would: while each finds nothing in the prompt
        cache and shares no index block with an earlier one (it waits for that one's row instead), a row is free, the
        K/V budget holds them all, and rows x their padded length (runtime.prompt_length: each row runs the longest's
        tokens) stay within what a chunk beside these decoding rows may take (chunk_allowance, cut by the step-time
        bound as a chunk would be; under a K/V budget, every row's padding within the most it may write). Not where the
        step token budget is 0 (no limit): a step's size would have no bound."""
        if self.prompt_group_rows < 2 or len(self.waiting) < 2 or not self.step_token_budget:
            return []
        tokens, _ = self.chunk_allowance(len(decode))
        runtime, n_ctx = self.batch.runtime, self.batch.config.n_ctx
        first, second = self.waiting[0].prompt_ids, self.waiting[1].prompt_ids
        if 2 * runtime.prompt_length(max(len(first), len(second)), n_ctx) > tokens:  # no pair fits: ask the cache nothing
            return []
        group, ran = self._gather_group(tokens)
        if group and decode and self.step_time_bound:  # cut as a chunk of the group's tokens would be
            cut = self.batch.step_costs.chunk_cut(len(decode), self.step_time_bound, ran)
            if cut is not None:
                group, _ = self._gather_group(cut)
        return group

    def _starts_long(self, seq: Sequence) -> bool:
        """Whether seq's prompt is past a longrope model's original context, so it turns long from its first token."""
        long_after = self.batch.config.long_rope_after
        return long_after is not None and len(seq.prompt_ids) > long_after

    def _gather_group(self, tokens: int) -> tuple[list[Sequence], int]:
        """prompt_group's sequences within `tokens` (rows x padded length), and the tokens they run; none if fewer than
        two."""
        kv, runtime, config = self.kv, self.batch.runtime, self.batch.config
        most_rows = min(self.prompt_group_rows, kv.free_rows())
        group: list[Sequence] = []
        longest, least_reserved = 0, config.n_ctx
        for seq in self.waiting:
            prompt = seq.prompt_ids
            length = runtime.prompt_length(max(longest, len(prompt)), config.n_ctx)
            reserved = min(least_reserved, kv.reservation_tokens(seq))
            if len(group) == most_rows or (len(group) + 1) * length > tokens or (kv.budget_bytes is not None and reserved < length):
                break
            seq.long_rope = self._starts_long(seq)  # as it would join: the prompt cache keeps the two kinds apart
            block = prompt[:BLOCK_TOKENS]
            if kv.reusable_prompt_tokens(seq) or not kv.fits(*group, seq) or any(
                    len(prompt) > BLOCK_TOKENS < len(other.prompt_ids) and other.prompt_ids[:BLOCK_TOKENS] == block for other in group):
                break
            group.append(seq)
            longest, least_reserved = max(longest, len(prompt)), reserved
        if len(group) < 2:
            return [], 0
        return group, len(group) * runtime.prompt_length(longest, config.n_ctx)

    def _with_drafts(self, decode: list[Sequence]) -> StepPlan:
        """A decode step in which the row with the most worth drafting (drafts.py) checks its drafts: from its grammar
        when that forces tokens, else from its own tokens, as many as the step costs say pay for its acceptance so far;
        no row drafts where none has drafts or none would pay."""
        costs, held = self.batch.step_costs, self.kv.held
        slots = list(self.kv.slots)
        if not costs.may_pay(len(decode)):  # not even drafts all taken would pay in a step of this many rows
            return StepPlan(decode=decode, slots=slots, held=held)
        long_after = self.batch.config.long_rope_after
        best, best_drafts, best_grammar, best_gain = None, [], False, 0.0
        for seq in decode:
            if not seq.speculate or seq.forced or seq.answer_constraint is not None:
                continue  # opted out, or its next tokens are not the model's alone
            state = seq.drafts
            if state is None:
                state = seq.drafts = DraftState(PromptLookup(seq.prompt_ids + seq.generated))
            if state.unchecked is not None:
                state.check_unused()
            matcher = seq.constraint.matcher if seq.constraint is not None else None
            if matcher is None and state.resting:  # its lookup rests (a grammar's forced tokens never do)
                state.resting -= 1
                continue
            most = min(self.most_drafts, seq.max_new_tokens - len(seq.generated) - 1)
            if long_after is not None and not seq.long_rope:  # never past the turn to the long factors
                most = min(most, long_after - held[seq].cached_tokens - 1)
            if most <= 0:
                continue
            drafts = matcher.compute_ff_tokens()[:most] if matcher is not None else []
            grammar = bool(drafts)
            if not drafts:  # its grammar forces nothing here: its own tokens may still guess (a string it repeats)
                if state.resting:
                    state.resting -= 1
                    continue
                drafts = state.lookup.propose(most) or self.outputs.propose(state.lookup.tokens, most)
                if not drafts:
                    state.missed()
                    continue
                state.found()
            if matcher is not None and drafts:  # only what its grammar allows: the masks take them in turn
                drafts = drafts[: matcher.validate_tokens(drafts)]
            if not drafts:
                continue
            acceptance = state.grammar_acceptance if grammar else state.acceptance
            k = costs.best_count(acceptance, len(decode), len(drafts))
            gain = acceptance.expected_tokens(k)
            if k and gain > best_gain:
                if best is not None and not best_grammar:
                    best.drafts.found_unused(best_drafts)
                best, best_drafts, best_grammar, best_gain = seq, drafts[:k], grammar, gain
            elif not grammar:
                state.found_unused(drafts)
        return StepPlan(decode=decode, draft_row=best, drafts=best_drafts, grammar_drafts=best_grammar, slots=slots, held=held)

    def run_step(self, plan: StepPlan, before_model=None) -> StepResults:
        """Carry out plan on the batch (one model call), then the rows that finished in it leave."""
        results = self.batch.run(plan, before_model)
        self.kv.release([s for s in self.kv.rows if s.finished])
        self.kv.publish_events()
        return results

    def drive(self, sequences: list[Sequence]) -> StepResults:
        """Run sequences to their end on this thread, step by step as the loop would: the load-time gate and
        warm-up go through exactly the serving path. Returns every step's results in order."""
        for seq in sequences:
            self.waiting.append(seq)
        results: StepResults = []
        while self.waiting or self.kv.rows:
            plan = self.plan()
            if not (plan.decode or plan.chunk or plan.prompts):
                raise RuntimeError(f"the K/V budget ({self.kv.budget_bytes} bytes) holds none of the waiting sequences")
            results += self.run_step(plan)
        return results

    def prepare_decode_shapes(self) -> None:
        """Bind (and capture) every fixed decode shape of the batch, whose rows must all be free (batch.py)."""
        if self.kv.slots:
            raise RuntimeError("decode shapes are prepared on an empty batch")
        self.batch.prepare_decode_shapes()

    # --- the loop -----------------------------------------------------------------------------------------

    async def run_forever(self) -> None:
        while True:
            if not self.kv.rows and not self.waiting:
                self.idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._step()

    async def _step(self) -> None:
        """One batch step, and the steps the step thread runs on from it. Its own coroutine, so no sequence outlives the
        step in a local variable."""
        loop = asyncio.get_running_loop()
        plan = self.plan()
        try:
            done = await loop.run_in_executor(self._executor, self._run_steps, plan, loop)
        except StepFailed as failed:  # the model step itself failed: every sequence in it fails once, none hangs
            done = failed.undelivered + [self._step_done(failed.plan, self._fail_step(failed.plan, failed.__cause__))]
        self._deliver(done)

    def _run_steps(self, plan: StepPlan, loop: asyncio.AbstractEventLoop) -> list[StepDone]:
        """On the step thread: run plan, then plan and run the next step here for as long as rows are running and the
        scheduler is not closing. The steps done are handed to the loop just before the next model call, which leaves
        the GIL to the loop while the model runs: handed over any earlier, the loop's work per token (the callers'
        events, gRPC) would hold the GIL while this thread prepares the step. Returns the steps not yet handed over
        (the loop delivers them, then waits for work when the batch is empty)."""
        pending: list[StepDone] = []

        def hand_over() -> None:  # an urgent step goes before the next model call: only the newest can be one
            if pending and (pending[-1].urgent or time.monotonic_ns() - pending[0].ended_ns >= UNSTREAMED_HANDOFF_NS):
                self._handoff.hand_over(loop, pending[:])
                pending.clear()

        while True:
            try:
                pending.append(self._step_done(plan, self.run_step(plan, hand_over)))
            except Exception as exc:
                self._handoff.flush()  # what was handed over reaches the loop before the failure
                raise StepFailed(plan, pending) from exc
            if not self.kv.rows or self._closing:
                self._handoff.flush()  # in order: what was handed over, then what this returns
                return pending
            plan = self.plan()

    def _step_done(self, plan: StepPlan, results: StepResults) -> StepDone:
        kv = self.kv
        prompts = [(seq.reused_prompt_tokens, len(seq.prompt_ids) - seq.reused_prompt_tokens)
                   for seq in plan.joining if self._ran_chunk(seq, results)]
        if self.outputs.capacity:
            for seq, event in results:  # finished outputs, for later rows' drafts (a request that opted out gives none)
                if seq.speculate and isinstance(event, StepEvent) and event.finish is not None:
                    self.outputs.add(seq.prompt_ids, seq.generated)
        urgent = any(seq.streamed or not isinstance(event, StepEvent) or event.finish is not None for seq, event in results)
        drafted = accepted = 0
        if plan.draft_row is not None:
            taken = [event.token_id for seq, event in results if seq is plan.draft_row and isinstance(event, StepEvent)]
            if taken:  # it ran (it was not cancelled first): its drafts up to the first it did not take were accepted
                drafted = len(plan.drafts)
                accepted = next((i for i, (token, draft) in enumerate(zip(taken, plan.drafts)) if token != draft), min(len(taken), drafted))
        return StepDone(results, prompts, len(kv.rows), kv.kv_bytes(), kv.cached_rows(), len(self.waiting), kv.cached_bytes(), drafted, accepted,
                        time.monotonic_ns(), urgent)

    def _ran_chunk(self, seq: Sequence, results: StepResults) -> bool:
        """Whether a sequence that joined this step ran its first chunk (it was not cancelled first): its row holds more
        than it reused, or, finished within the step and gone from its row, it has a result."""
        hold = self.kv.held.get(seq)
        return hold.cached_tokens > seq.reused_prompt_tokens if hold is not None else any(s is seq for s, _ in results)

    def _deliver(self, steps: list[StepDone]) -> None:
        """On the event loop: each sequence's event to its caller, and each step's metrics, step by step (its tokens timed
        when the step ended, which for a step held back is not when the loop has it)."""
        metrics = self.metrics
        for done in steps:
            now = done.ended_ns
            if metrics is not None:
                for reused, computed in done.prompts:
                    metrics.on_prompt(reused, computed)
            for seq, event in done.results:
                if not seq.cancelled:
                    seq.events.put_nowait(event)
                    if metrics is not None and isinstance(event, StepEvent):
                        metrics.on_token(seq.arrival_ns, seq.last_sent_ns, now)
                        seq.last_sent_ns = now
            if metrics is not None:
                stepped = len({id(seq) for seq, _ in done.results})  # a row that took drafts has an event a token
                metrics.on_step(stepped, done.running, done.queued, done.kv_bytes, done.cached_rows, done.cached_bytes,
                                len(done.results), done.drafted, done.accepted)

    def _fail_step(self, plan: StepPlan, exc: Exception) -> StepResults:
        # Every sequence holding a row fails; the pool's contents being unknown after a failed step, the prompt cache
        # forgets its rows too.
        results = [(seq, exc) for seq in self.kv.clear()]
        failed = {id(seq) for seq, _ in results}
        results += [(seq, exc) for seq in plan.joining if id(seq) not in failed]  # never got a row
        log.exception("model step failed; failing the %d sequences in it", len(results), exc_info=exc)
        for seq, _ in results:
            seq.finished = True
        return results

    def stop(self) -> None:
        """No step starts after the one in flight (the step thread reads this between steps)."""
        self._closing = True

    def close(self) -> None:
        self.stop()
        self._handoff.close()
        if self._owns_executor:
            self._executor.shutdown(wait=True)
