"""The scheduler loop: decides what each model step runs, hands it to the batch on the step thread, and
delivers every sequence's event to its caller on the event loop.

One step (kv_slots.StepPlan) is one model call over the batch:
  - every row whose prompt is in the cache decodes one token (decode never waits for a prefill);
  - one row's prompt advances by a chunk: with rows decoding, the chunk gets what is left of the per-step
    token budget after them, so a long prompt never stalls the streams already running; with nobody
    decoding (or budget 0, no limit) the whole rest of the prompt goes in one step; a chunk that would
    leave a tail of at most a quarter of the budget takes the tail too (a step of its own would cost the
    running streams a whole step's gap for a few tokens);
  - a waiting request joins when no other prompt is being prefilled and a row is free, so no row sits in
    the batch idle while it waits for its turn; its prompt starts past what the prompt cache holds of it
    (kv_slots.SlotBatch.reusable_prompt_tokens), so requests sharing a prefix with one still being prefilled wait
    for it and then take it instead of each computing it again.
Cancelled sequences leave at the start of the next step, finished ones at the end of theirs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from .kv_slots import StepPlan, StepResults
from .sequence import Sequence, StepEvent

log = logging.getLogger(__name__)


def step_thread() -> ThreadPoolExecutor:
    """The one thread a scheduler runs its model steps on. The server also runs the parity gate and the warm-up on
    it: ONNX Runtime keeps CUDA graphs in the context of the thread that captured them (runtime.GRAPH_ID)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step")


class Scheduler:
    """Owns the waiting queue and the loop; the batch (kv_slots.SlotBatch) owns the rows."""

    def __init__(self, batch, step_token_budget: int, metrics=None, executor: ThreadPoolExecutor | None = None):
        self.batch = batch
        self.step_token_budget = step_token_budget  # 0: no limit
        self.metrics = metrics
        self.waiting: deque[Sequence] = deque()
        self._owns_executor = executor is None  # a thread handed in is its giver's to close
        self._executor = step_thread() if executor is None else executor
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

    def plan(self) -> StepPlan:
        batch = self.batch
        rows = [s for s in batch.rows if not s.cancelled]
        decode = [s for s in rows if not s.prefilling]
        prefilling = [s for s in rows if s.prefilling]
        joining = []
        if not prefilling and self.waiting and batch.free_rows() > 0:
            joining = [self.waiting.popleft()]
            prefilling = joining
        if not prefilling:
            return StepPlan(decode=decode)
        chunk = prefilling[0]
        done = self.batch.reusable_prompt_tokens(chunk) if joining else chunk.cached_tokens  # a joiner starts past its cached prefix
        remaining = len(chunk.prompt_ids) - done
        tokens = remaining
        if decode and self.step_token_budget:
            allowance = max(self.step_token_budget - len(decode), 1)
            if remaining > allowance + self.step_token_budget // 4:
                tokens = allowance
        return StepPlan(joining=joining, decode=decode, chunk=chunk, chunk_tokens=tokens)

    def drive(self, sequences: list[Sequence]) -> StepResults:
        """Run sequences to their end on this thread, step by step as the loop would: the load-time gate and
        warm-up go through exactly the serving path. Returns every step's results in order."""
        for seq in sequences:
            self.waiting.append(seq)
        results: StepResults = []
        while self.waiting or self.batch.rows:
            results += self.batch.run(self.plan())
        return results

    # --- the loop -----------------------------------------------------------------------------------------

    async def run_forever(self) -> None:
        while True:
            if not self.batch.rows and not self.waiting:
                self.idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._step()

    async def _step(self) -> None:
        """One batch step. Its own coroutine, so no sequence outlives the step in a local variable."""
        plan = self.plan()
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._executor, self.batch.run, plan)
        except Exception as exc:  # the model step itself failed: every sequence in it fails once, none hangs
            results = self._fail_step(plan, exc)
        now = time.monotonic_ns()
        if self.metrics is not None:
            for seq in plan.joining:
                if seq.slot is not None:
                    self.metrics.on_prompt(seq.reused_prompt_tokens, len(seq.prompt_ids) - seq.reused_prompt_tokens)
        for seq, event in results:
            if not seq.cancelled:
                seq.events.put_nowait(event)
                if self.metrics is not None and isinstance(event, StepEvent):
                    self.metrics.on_token(seq.arrival_ns, seq.last_sent_ns, now)
                    seq.last_sent_ns = now
        if self.metrics is not None:
            self.metrics.on_step(len(results), len(self.batch.rows), len(self.waiting), self.batch.kv_bytes(), self.batch.cached_rows())

    def _fail_step(self, plan: StepPlan, exc: Exception) -> StepResults:
        results = self.batch.fail_all(exc)
        failed = {id(seq) for seq, _ in results}
        results += [(seq, exc) for seq in plan.joining if id(seq) not in failed]  # never got a row
        log.exception("model step failed; failing the %d sequences in it", len(results), exc_info=exc)
        for seq, _ in results:
            seq.finished = True
        return results

    def close(self) -> None:
        if self._owns_executor:
            self._executor.shutdown(wait=True)
