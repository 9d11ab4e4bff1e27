"""The engine: takes requests, admits them to the queue (or refuses them when it is full), streams each sequence's
events back to its caller, fans a request for n completions out into n sequences, and starts, drains and stops the
scheduler loop. A request is checked and made into a Sequence by validation.py; what runs in each model step is the
scheduler's (scheduler.py); the rows and their KV cache are the batch's (batch.py, kv_rows.py); a request's own state
and events are its Sequence's (sequence.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from kvserve.contract.chat import ChatTemplate
from kvserve.contract.config import DecoderConfig
from kvserve.contract.tokenizer import Tokenizer
from kvserve.runtime import DecoderRuntime

from .batch import SlotBatch
from .engine_errors import EngineError, InvalidArgument, QueueFull, SequenceFailed, Unavailable
from .limits import EngineLimits, out_of_bounds
from .model_info import LiveCounts
from .sampling import nth_seed
from .scheduler import Scheduler
from .sequence import GenerationRequest
from .structured import FormatError
from .validation import Encoder, RequestValidator, validates_inline

log = logging.getLogger(__name__)


class Engine:
    """Accepts requests, runs the scheduler loop, streams each sequence's events back to its caller."""

    def __init__(
        self, runtime: DecoderRuntime, config: DecoderConfig, tokenizer: Tokenizer, limits: EngineLimits, metrics=None, batch=None,
        step_thread=None, chat_template: ChatTemplate | None = None, encoder: Encoder | None = None, tracer=None, model_name: str = "",
        kv_budget: int | None = None, kv_events=None,
    ):
        """encoder: where long prompts are tokenized (validation.Encoder; the server's tokenizing process); tracer: a
        tracing.RequestTracer, or None (traces off: nothing is done for them); kv_budget: bytes the K/V rows and the
        prompt cache may take (None: no bound); kv_events: where the prompt cache's changes go (None: nowhere)."""
        problem = out_of_bounds(limits)
        if problem is not None:
            raise ValueError(problem)
        self.runtime, self.config, self.tokenizer, self.limits = runtime, config, tokenizer, limits
        self.chat_template = chat_template  # None: the model has none, and conversations are refused
        self.batch = batch if batch is not None else SlotBatch(runtime, config, limits.max_batch_size)
        self.scheduler = Scheduler(self.batch, limits.step_token_budget, metrics, executor=step_thread, speculation=limits.speculation,
                                   draft_cache_tokens=limits.draft_cache_tokens, step_time_bound=limits.step_time_bound,
                                   prompt_cache=limits.prompt_cache, kv_budget=kv_budget, kv_events=kv_events)
        self.validator = RequestValidator(config, tokenizer, limits, chat_template, encoder, kv_budget_tokens=self.scheduler.budget_tokens())
        self._accepting = True
        self._task: asyncio.Task | None = None
        self.metrics = metrics  # service.metrics.Metrics or None
        self.tracer, self.model_name = tracer, model_name

    # lifecycle

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.scheduler.run_forever(), name="kvserve-scheduler")

    def stop_accepting(self) -> None:
        self._accepting = False

    async def drain(self, timeout: float) -> bool:
        """Wait until every admitted and waiting sequence finished; True if it happened within timeout."""
        try:
            await asyncio.wait_for(self.scheduler.idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def stop_streams(self, reason: str) -> None:
        """End every stream still running or waiting with UNAVAILABLE(reason): after the drain period, so no
        caller is cut off without a status. The step in flight finishes first."""
        await self.close()
        error = Unavailable(reason)
        for seq in self.scheduler.sequences():
            if not seq.finished and seq.events is not None:
                seq.finished = True
                seq.events.put_nowait(error)

    async def close(self) -> None:
        self.scheduler.stop()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.scheduler.close()

    # requests

    def _admit(self, sequences: int) -> None:
        """QueueFull unless the batch has room for sequences more now: max_queue counts the requests that must wait for
        a row to free up, not those a free row will take. Unavailable first while shutting down."""
        if not self._accepting:
            raise Unavailable("the server is shutting down")
        if len(self.scheduler.waiting) + sequences > self.limits.max_queue + self.scheduler.free_rows():
            raise QueueFull(
                f"the queue is full ({self.limits.max_queue} requests waiting for one of {self.limits.max_batch_size} rows); retry later"
            )

    async def generate(self, request: GenerationRequest, batched: bool = False):
        """Stream StepEvents for one request; the last carries the finish. batched: lists of them instead, each every
        event ready when the caller asks (a step's accepted drafts; the steps that ran while the caller was busy), so a
        caller that writes one message a list writes fewer. Closing the stream early (client cancelled, disconnected,
        deadline) frees the sequence's cache within one step."""
        if not self._accepting:
            raise Unavailable("the server is shutting down")
        if validates_inline(request):  # cheaper than the round trip to a thread
            seq = self.validator.make_sequence(request)
        else:  # tokenizing: off the event loop
            seq = await asyncio.to_thread(self.validator.make_sequence, request)
        self._admit(1)
        seq.events = asyncio.Queue()
        self.scheduler.submit(seq)
        finish, failure, waiting = None, None, None
        try:
            while True:
                event = waiting if waiting is not None else await seq.events.get()
                waiting = None
                if isinstance(event, EngineError):  # ended by the server (see stop_streams): its own status
                    failure = event
                    raise event
                if isinstance(event, FormatError):  # the request's format failed during generation
                    failure = InvalidArgument(event.field, event.message)
                    raise failure
                if isinstance(event, BaseException):
                    failure = SequenceFailed(f"generation failed: {type(event).__name__}: {event}")
                    raise failure from event
                if not batched:
                    finish = event.finish  # before the yield: a consumer may stop at the last event without resuming us
                    yield event
                else:
                    events = [event]
                    while events[-1].finish is None and not seq.events.empty():
                        event = seq.events.get_nowait()
                        if isinstance(event, BaseException):  # raised once the tokens before it are out
                            waiting = event
                            break
                        events.append(event)
                    finish = events[-1].finish
                    yield events
                if finish is not None:
                    return
        finally:
            if not seq.finished:
                seq.cancelled = True
                self.scheduler.withdraw(seq)
            if self.tracer is not None:
                self.tracer.record(seq, finish, self.tracer.caller_context(request.traceparent, request.tracestate), self.model_name,
                                   request.prompt_messages is not None, failure)

    async def render(self, request: GenerationRequest) -> tuple[str | None, list[int]]:
        """request's prompt text and token ids as generate would see them, refused as generate would refuse it; nothing
        runs on the model (the render endpoints: a router tokenizes through the server it routes to)."""
        if not self._accepting:
            raise Unavailable("the server is shutting down")
        return await asyncio.to_thread(self.validator.render, request)

    async def generate_n(self, request: GenerationRequest, n: int, batched: bool = False):
        """n completions of request, each its own sequence (seeds seed, seed + 1, ...): yields (index, StepEvent) as the
        steps make them (batched: (index, list of StepEvents), as generate's), each completion ending with its finish.
        Every completion has its first token before the first event is yielded, so a refusal of any (a bad request, a
        full queue) comes before anything was sent; a failure later ends the stream with its error. Closing the stream
        cancels every sequence still running."""
        if not 1 <= n <= self.limits.max_n:
            raise InvalidArgument("n", f"must be in [1, {self.limits.max_n}], got {n}")
        # All n asked for at once: one at a time, a completion that finished while another was being tokenized would
        # make room for the last (the refusal then hung on thread timing: tests/service/core/test_engine.py met it under load).
        self._admit(n)
        request_span = None
        if self.tracer is not None and n > 1:  # one trace: the n sequences' spans under one of the request's
            request_span, (parent, state) = self.tracer.start_request(
                self.tracer.caller_context(request.traceparent, request.tracestate), n, self.model_name)
            request = dataclasses.replace(request, traceparent=parent, tracestate=state)
        streams = [self.generate(dataclasses.replace(request, sampling=nth_seed(request.sampling, i)), batched) for i in range(n)]
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream) -> None:
            try:
                async for event in stream:
                    merged.put_nowait((index, event))
            except EngineError as exc:
                merged.put_nowait((index, exc))
            finally:
                merged.put_nowait((index, None))

        firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
        pumps = []
        try:
            await asyncio.gather(*firsts)  # every one admitted, or the whole call refused
            finished = [(first.result()[-1] if batched else first.result()).finish is not None for first in firsts]
            pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams) if not finished[i]]
            for index, first in enumerate(firsts):
                yield index, first.result()
            running = len(pumps)
            while running:
                index, event = await merged.get()
                if event is None:
                    running -= 1
                elif isinstance(event, EngineError):
                    raise event
                else:
                    yield index, event
        finally:
            for task in firsts + pumps:
                task.cancel()
            await asyncio.gather(*firsts, *pumps, return_exceptions=True)  # each out of its stream before it closes
            for stream in streams:
                await stream.aclose()
            if request_span is not None:
                request_span.end()

    def live(self) -> LiveCounts:
        return self.scheduler.live()
