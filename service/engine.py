"""The engine: takes requests, checks them against the model and the limits, queues them, and streams each
sequence's events back to its caller. What runs in each model step is the scheduler's (scheduler.py); the
rows and their KV cache are the batch's (kv_slots.py);
a request's own state and events are its Sequence's (sequence.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets

from kvserve.contract.chat import ChatMessage, ChatTemplate, TemplateError
from kvserve.contract.tokenizer import Tokenizer
from kvserve.contract.config import DecoderConfig
from kvserve.runtime import DecoderRuntime

from .kv_slots import SlotBatch
from .limits import MAX_SCALE, MIN_SCALE, EngineLimits
from .sampling import SamplingParams, nth_seed
from .scheduler import Scheduler
from .sequence import GenerationRequest, Sequence
from .structured import FormatCompiler, FormatError
from .text import IncrementalDecoder, StopSequences

log = logging.getLogger(__name__)

# Prompt tokens the text decoder reads before the first new one: enough for a character split across byte
# tokens and for a leading space that depends on what precedes it.
PROMPT_CONTEXT_TOKENS = 6

MAX_ROLE_LENGTH = 64  # characters of a chat message's role
MAX_PENALTY = 2.0  # presence and frequency penalties, as OpenAI bounds them
MAX_BIAS, MAX_LOGIT_BIAS = 100.0, 300  # a logit bias's size and how many tokens one request may bias (OpenAI's bounds)
MAX_TOP_LOGPROBS = 20  # alternatives reported with each token
MAX_N = 8  # completions of one prompt a request: each a sequence with its own row (the prompt computed once, then copied)

# --- errors the servicer maps to status codes (see server.ErrorInterceptor) ---------------------------


class EngineError(Exception):
    """Base of the errors a request can meet in the engine."""


class InvalidArgument(EngineError):
    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class QueueFull(EngineError):
    pass


class Unavailable(EngineError):
    """Not serving (loading, or draining for shutdown)."""


class SequenceFailed(EngineError):
    """An unexpected failure of this request alone."""


# --- the engine (runs on the event loop) --------------------------------------------------------------


class Engine:
    """Accepts requests, runs the scheduler loop, streams each sequence's events back to its caller."""

    def __init__(
        self, runtime: DecoderRuntime, config: DecoderConfig, tokenizer: Tokenizer, limits: EngineLimits, metrics=None, batch=None,
        step_thread=None, chat_template: ChatTemplate | None = None,
    ):
        if limits.max_batch_size < 1 or limits.max_queue < 0 or limits.step_token_budget < 0:
            raise ValueError("max_batch_size must be >= 1, max_queue >= 0 and step_token_budget >= 0")
        self.runtime, self.config, self.tokenizer, self.limits = runtime, config, tokenizer, limits
        self.chat_template = chat_template  # None: the model has none, and conversations are refused
        self.formats = FormatCompiler(tokenizer, config.vocab_size, config.eos_token_ids, limits.max_response_format_bytes)
        self.batch = batch if batch is not None else SlotBatch(runtime, config, limits.max_batch_size, prompt_cache=limits.prompt_cache)
        self.scheduler = Scheduler(self.batch, limits.step_token_budget, metrics, executor=step_thread)
        self._ids = itertools.count(1)
        self._accepting = True
        self._task: asyncio.Task | None = None
        self.metrics = metrics  # service.metrics.Metrics or None

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
        for seq in list(self.batch.rows) + list(self.scheduler.waiting):
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

    def check_text(self, field_name: str, text: str) -> None:
        size = len(text.encode("utf-8", errors="replace"))
        if size > self.limits.max_text_bytes:
            raise InvalidArgument(field_name, f"{size} bytes of text; at most {self.limits.max_text_bytes}")

    def make_sequence(self, request: GenerationRequest) -> Sequence:
        """Validate a request against the model and limits; every refusal names its field."""
        config = self.config
        if sum(p is not None for p in (request.prompt_ids, request.prompt_text, request.prompt_messages)) > 1:
            raise InvalidArgument("prompt", "give one of text, token_ids or messages")
        if request.prompt_ids is not None:
            prompt = list(request.prompt_ids)
            field_name = "prompt.token_ids"
        elif request.prompt_messages is not None:
            prompt = self.render_conversation(list(request.prompt_messages))
            field_name = "prompt.messages"
        else:
            self.check_text("prompt.text", request.prompt_text or "")
            prompt = self.tokenizer.encode(request.prompt_text or "")
            field_name = "prompt.text"
        if not prompt:
            raise InvalidArgument(field_name, "the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < config.vocab_size]
        if bad:
            raise InvalidArgument(field_name, f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
        room = config.n_ctx - len(prompt)
        if room < 1:
            raise InvalidArgument(
                field_name, f"the prompt has {len(prompt)} tokens; the context holds {config.n_ctx} including at least one new token"
            )
        max_new = request.max_new_tokens or room
        if max_new > room:
            raise InvalidArgument(
                "max_new_tokens", f"{max_new} new tokens do not fit: the prompt has {len(prompt)} of the {config.n_ctx}-token context ({room} left)"
            )
        params = request.sampling
        if not (params.temperature == 0 or MIN_SCALE <= params.temperature <= MAX_SCALE):
            raise InvalidArgument("sampling.temperature", f"must be 0 (greedy) or in [{MIN_SCALE:g}, {MAX_SCALE:g}], got {params.temperature}")
        if params.top_k < 0:
            raise InvalidArgument("sampling.top_k", f"must be >= 0, got {params.top_k}")
        if not 0 < params.top_p <= 1:
            raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {params.top_p}")
        if not MIN_SCALE <= params.repetition_penalty <= MAX_SCALE:
            raise InvalidArgument("sampling.repetition_penalty", f"must be in [{MIN_SCALE:g}, {MAX_SCALE:g}], got {params.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(params, name) <= MAX_PENALTY:
                raise InvalidArgument(f"sampling.{name}", f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(params, name)}")
        if not 0 <= params.min_p <= 1:
            raise InvalidArgument("sampling.min_p", f"must be in [0, 1], got {params.min_p}")
        if len(params.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument("sampling.logit_bias", f"{len(params.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        for token, bias in params.logit_bias:
            if not 0 <= token < config.vocab_size:
                raise InvalidArgument("sampling.logit_bias", f"token id {token} is outside the vocabulary [0, {config.vocab_size})")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise InvalidArgument("sampling.logit_bias", f"the bias of token {token} must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias}")
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}")
        if request.top_logprobs and not request.return_logprobs:
            raise InvalidArgument("top_logprobs", "alternatives come with the log-probabilities: set return_logprobs too")
        limits = self.limits
        if len(request.stop_sequences) > limits.max_stop_sequences:
            raise InvalidArgument("stop_sequences", f"{len(request.stop_sequences)} stop sequences; at most {limits.max_stop_sequences}")
        longest = max((len(stop) for stop in request.stop_sequences), default=0)
        if longest > limits.max_stop_length:
            raise InvalidArgument("stop_sequences", f"a stop sequence of {longest} characters; at most {limits.max_stop_length}")
        bad = [t for t in request.stop_token_ids if not 0 <= t < config.vocab_size]
        if bad:
            raise InvalidArgument("stop_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids.update(config.eos_token_ids)
        constraint = None
        if request.response_format is not None:
            try:
                constraint = self.formats.compile(request.response_format)
            except FormatError as exc:
                raise InvalidArgument(exc.field, exc.message) from None
        if params.seed == 0:
            params = SamplingParams(**{**params.__dict__, "seed": secrets.randbits(63)})
        return Sequence(
            id=next(self._ids),
            prompt_ids=prompt,
            max_new_tokens=max_new,
            params=params,
            stop_ids=frozenset(stop_ids),
            return_logprobs=request.return_logprobs,
            top_logprobs=request.top_logprobs,
            decoder=IncrementalDecoder(self.tokenizer, context=prompt[-PROMPT_CONTEXT_TOKENS:]),
            stops=StopSequences(request.stop_sequences),
            constraint=constraint,
            blocked_ids=tuple(config.eos_token_ids) if constraint is not None and request.ignore_eos else (),
        )

    def render_conversation(self, messages: list[ChatMessage]) -> list[int]:
        """A conversation's prompt tokens: rendered by the model's chat template, the assistant's turn opened."""
        field_name = "prompt.messages"
        if self.chat_template is None:
            raise InvalidArgument(field_name, "this model has no chat template (its artifact has no chat_template.jinja and no "
                                  "chat_template in tokenizer_config.json): send text or token_ids")
        if not messages:
            raise InvalidArgument(field_name, "the conversation has no messages")
        if len(messages) > self.limits.max_chat_messages:
            raise InvalidArgument(field_name, f"{len(messages)} messages; at most {self.limits.max_chat_messages}")
        for index, message in enumerate(messages):
            if not message.role or len(message.role) > MAX_ROLE_LENGTH:
                raise InvalidArgument(f"{field_name}[{index}].role", f"must be 1 to {MAX_ROLE_LENGTH} characters, got {len(message.role)}")
        size = sum(len(m.content.encode("utf-8", errors="replace")) for m in messages)
        if size > self.limits.max_text_bytes:
            raise InvalidArgument(field_name, f"{size} bytes of content; at most {self.limits.max_text_bytes}")
        try:
            text = self.chat_template.render(messages)
        except TemplateError as exc:
            raise InvalidArgument(field_name, str(exc)) from None
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens

    async def generate(self, request: GenerationRequest):
        """Stream StepEvents for one request; the last carries the finish. Closing the stream early (client
        cancelled, disconnected, deadline) frees the sequence's cache within one step."""
        if not self._accepting:
            raise Unavailable("the server is shutting down")
        seq = await asyncio.to_thread(self.make_sequence, request)  # tokenizing: off the event loop
        # max_queue counts the requests that must wait for a row to free up: those a free row will take do not
        if len(self.scheduler.waiting) >= self.limits.max_queue + self.batch.free_rows():
            raise QueueFull(
                f"the queue is full ({self.limits.max_queue} requests waiting for one of {self.limits.max_batch_size} rows); retry later"
            )
        seq.events = asyncio.Queue()
        self.scheduler.submit(seq)
        try:
            while True:
                event = await seq.events.get()
                if isinstance(event, EngineError):  # ended by the server (see stop_streams): its own status
                    raise event
                if isinstance(event, FormatError):  # the request's format failed during generation
                    raise InvalidArgument(event.field, event.message)
                if isinstance(event, BaseException):
                    raise SequenceFailed(f"generation failed: {type(event).__name__}: {event}") from event
                yield event
                if event.finish is not None:
                    return
        finally:
            if not seq.finished:
                seq.cancelled = True
                self.scheduler.withdraw(seq)

    async def generate_n(self, request: GenerationRequest, n: int):
        """n completions of request, each its own sequence (seeds seed, seed + 1, ...): yields (index, StepEvent) as the
        steps make them, each completion ending with its finish. Every completion has its first token before the first
        event is yielded, so a refusal of any (a bad request, a full queue) comes before anything was sent; a failure
        later ends the stream with its error. Closing the stream cancels every sequence still running."""
        if not 1 <= n <= MAX_N:
            raise InvalidArgument("n", f"must be in [1, {MAX_N}], got {n}")
        streams = [self.generate(dataclasses.replace(request, sampling=nth_seed(request.sampling, i))) for i in range(n)]
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
            pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams) if firsts[i].result().finish is None]
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

    def stats(self) -> dict:
        rows = list(self.batch.rows)
        row_bytes = self.batch.row_bytes()
        return {
            "active": len(rows),
            "cached": self.batch.cached_rows(),
            "queued": len(self.scheduler.waiting),
            "kv_bytes": row_bytes * len(rows),
            "sequences": [(s.id, s.total_tokens, row_bytes) for s in rows],
        }
