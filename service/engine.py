"""The engine: request lifecycle, continuous batching, sampling, stop rules and the batch's KV cache.

One scheduler loop owns the model. Each iteration is one step over the whole running batch:
  1. sequences whose client went away leave, and their cache rows are freed;
  2. every running sequence decodes one token, together, in one model call;
  3. waiting requests (as many as free rows allow) are prefilled together and join the batch.
A sequence that finishes leaves at the end of the step that finished it.

The batch's cache is P columns of (B, H, ., d_k) per layer and K/V, rows right-aligned: each row's newest
token sits in column P - 1 and shorter rows are left-padded (masked out by attention_mask). Position
ids are per row, so a row computes exactly what its sequence would alone. Between steps the cache stays
where the runtime put it (GPU memory under CUDA); it is reshaped on the host only when rows join or leave.
Whether those P columns are the whole tensor (concat artifacts) or the front of a larger buffer written in
place (inplace artifacts) is the runtime's business (runtime.DeviceCache); every row writes column P.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import secrets
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kvserve.export.io_contract import KV_SEQUENCE_AXIS
from kvserve.model.config import DecoderConfig

from .runtime import DecoderRuntime, DeviceCache
from .sampling import SamplingParams, choose, log_probability
from .text import IncrementalDecoder, StopSequences, Tokenizer

log = logging.getLogger(__name__)


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


# --- the domain ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationRequest:
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_new_tokens: int = 0  # 0: as many as fit in the context
    sampling: SamplingParams = SamplingParams()
    stop_sequences: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    return_logprobs: bool = False
    ignore_eos: bool = False


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP_SEQUENCE = "stop_sequence"
    END_OF_SEQUENCE = "end_of_sequence"


@dataclass(frozen=True)
class Finish:
    reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    time_to_first_token_ns: int
    total_ns: int
    stop_sequence: str = ""


@dataclass(frozen=True)
class StepEvent:
    """What one step produced for one sequence: a token and its text, and on the last step the finish."""

    token_id: int
    text: str
    logprob: float | None
    finish: Finish | None


@dataclass(eq=False)
class Sequence:
    """One request's generation state."""

    id: int
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    stop_ids: frozenset[int]
    return_logprobs: bool
    decoder: IncrementalDecoder
    stops: StopSequences
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    generated: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # tokens whose K/V are in the batch cache
    first_token_ns: int = 0
    cancelled: bool = False  # set from the event loop when the client goes away
    finished: bool = False
    captured_logits: list | None = None  # the parity gate records the logits behind each token
    last_sent_ns: int | None = None  # when the previous token was handed to the client (metrics)
    events: asyncio.Queue | None = None

    def __post_init__(self):
        self.rng = np.random.default_rng(self.params.seed)

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    def advance(self, logits: np.ndarray) -> StepEvent:
        """Take the next token from this sequence's logits (V,); apply stop rules; return the event."""
        now = time.monotonic_ns()
        if self.captured_logits is not None:
            self.captured_logits.append(logits.copy())
        seen = None
        if self.params.repetition_penalty != 1.0:
            seen = np.fromiter(itertools.chain(self.prompt_ids, self.generated), dtype=np.int64)
        token = choose(logits, self.params, self.rng, seen)
        logprob = log_probability(logits, token) if self.return_logprobs else None
        self.generated.append(token)
        if len(self.generated) == 1:
            self.first_token_ns = now
        text, stop = self.stops.push(self.decoder.push(token))
        reason = FinishReason.STOP_SEQUENCE if stop else None
        if reason is None and token in self.stop_ids:
            reason = FinishReason.END_OF_SEQUENCE
        if reason is None and len(self.generated) >= self.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason in (FinishReason.END_OF_SEQUENCE, FinishReason.LENGTH):
            tail, stop = self.stops.push(self.decoder.flush())  # the held-back bytes may complete a stop
            text += tail
            if stop:
                reason = FinishReason.STOP_SEQUENCE
            else:
                text += self.stops.flush()
        finish = None
        if reason is not None:
            self.finished = True
            finish = Finish(
                reason=reason,
                prompt_tokens=len(self.prompt_ids),
                generated_tokens=len(self.generated),
                time_to_first_token_ns=self.first_token_ns - self.arrival_ns,
                total_ns=now - self.arrival_ns,
                stop_sequence=stop or "",
            )
        return StepEvent(token_id=token, text=text, logprob=logprob, finish=finish)


# --- the running batch (runs on the step thread) ------------------------------------------------------


def _stack_right_aligned(parts: list[np.ndarray], width: int, columns: int) -> np.ndarray:
    """Rows of several (B_i, H, S_i, d_k) caches -> one (sum B_i, H, columns, d_k) whose first width columns
    hold every row right-aligned (zero columns on the left), the rest zero: one pass over the data, since
    joins under load move the whole batch's cache."""
    rows = sum(p.shape[0] for p in parts)
    out = np.zeros((rows,) + parts[0].shape[1:2] + (columns,) + parts[0].shape[3:], dtype=parts[0].dtype)  # (B, H, C, d_k)
    start = 0
    for part in parts:
        out[start : start + part.shape[0], :, width - part.shape[KV_SEQUENCE_AXIS] : width] = part
        start += part.shape[0]
    return out


def _left_pad_mask(mask: np.ndarray, width: int) -> np.ndarray:
    """(B, S) -> (B, width) with zero (padding) columns on the left."""
    return np.pad(mask, ((0, 0), (width - mask.shape[1], 0)))


class BatchRunner:
    """The rows of the running batch and their KV cache. Not thread-safe: one step thread calls it."""

    def __init__(self, runtime: DecoderRuntime, config: DecoderConfig):
        self.runtime = runtime
        self.config = config
        self.rows: list[Sequence] = []
        self.past: DeviceCache | None = None  # P columns in use, each (B, H, P, d_k) or a larger buffer
        self.mask = np.zeros((0, 0), dtype=np.int64)  # (B, P): 1 where a row has a real token
        self._bytes_per_cell = 2 * config.n_layer * config.n_head * config.d_head * np.dtype(runtime.kv_dtype).itemsize

    def kv_bytes(self) -> int:
        """Bytes of K/V held: B x capacity cells (padding and spare columns included) x K, V of every layer."""
        return len(self.rows) * self.row_bytes()

    def row_bytes(self) -> int:
        return (self.past.capacity if self.past is not None else 0) * self._bytes_per_cell

    def step(self, admitted: list[Sequence]) -> list[tuple[Sequence, StepEvent | BaseException]]:
        results: list[tuple[Sequence, StepEvent | BaseException]] = []
        self._remove([s for s in self.rows if s.cancelled])
        if self.rows:
            results += self._decode()
        if admitted:
            results += self._prefill(admitted)
        self._remove([s for s in self.rows if s.finished])
        return results

    def fail_all(self, error: BaseException) -> list[tuple[Sequence, BaseException]]:
        failed = [(s, error) for s in self.rows]
        self.rows, self.past, self.mask = [], None, np.zeros((0, 0), dtype=np.int64)
        return failed

    @staticmethod
    def _columns_ahead(rows: list[Sequence]) -> int:
        """Cache columns the rows' remaining decode steps will add: an inplace buffer sized for them never has
        to grow mid-flight (growing copies the whole batch's cache in one step, a pause every stream sees)."""
        return max((s.max_new_tokens - len(s.generated) for s in rows), default=0)

    def _advance_each(self, rows: list[Sequence], logits: np.ndarray):
        """logits (B, V): each row's next-token logits. One sequence's failure is that sequence's alone."""
        results = []
        for row, seq in enumerate(rows):
            try:
                results.append((seq, seq.advance(logits[row])))
            except Exception as exc:  # a bug in one request's sampling or text must not stop the others
                log.exception("sequence %d failed", seq.id)
                seq.finished = True
                results.append((seq, exc))
        return results

    def _decode(self):
        batch = len(self.rows)
        input_ids = np.array([[s.generated[-1]] for s in self.rows], dtype=np.int64)  # (B, 1)
        position_ids = np.array([[s.cached_tokens] for s in self.rows], dtype=np.int64)  # (B, 1)
        mask = np.concatenate([self.mask, np.ones((batch, 1), dtype=np.int64)], axis=1)  # (B, P + 1)
        out = self.runtime.run(input_ids, mask, position_ids, self.past)
        self.past, self.mask = out.present, mask
        for seq in self.rows:
            seq.cached_tokens += 1
        return self._advance_each(self.rows, out.logits[:, -1, :])

    def _prefill(self, admitted: list[Sequence]):
        width = max(len(s.prompt_ids) for s in admitted)
        input_ids = np.zeros((len(admitted), width), dtype=np.int64)  # (B_new, T), left-padded
        mask = np.zeros((len(admitted), width), dtype=np.int64)  # (B_new, T)
        for row, seq in enumerate(admitted):
            input_ids[row, width - len(seq.prompt_ids) :] = seq.prompt_ids
            mask[row, width - len(seq.prompt_ids) :] = 1
        position_ids = np.maximum(mask.cumsum(axis=1) - 1, 0)  # (B_new, T): real tokens count from 0
        ahead = width + max(s.max_new_tokens for s in admitted)
        empty = self.runtime.empty_past(len(admitted), self.config.n_head, self.config.d_head, room_for=ahead)
        out = self.runtime.run(input_ids, mask, position_ids, empty)
        for seq in admitted:
            seq.cached_tokens = len(seq.prompt_ids)
        results = self._advance_each(admitted, out.logits[:, -1, :])
        staying = [row for row, seq in enumerate(admitted) if not seq.finished]
        if staying:
            self._join([admitted[r] for r in staying], out.present, mask, staying)
        return results

    def _join(self, rows: list[Sequence], present: DeviceCache, mask: np.ndarray, keep: list[int]) -> None:
        """Append freshly prefilled rows to the batch, padding the narrower side on the left."""
        if not self.rows and len(keep) == mask.shape[0]:
            self.rows, self.mask, self.past = rows, mask, present  # the batch is just these rows: no copy
            return
        new = [a[keep] for a in self.runtime.to_host(present)]
        mask = mask[keep]
        if not self.rows:
            self.rows, self.mask = rows, mask
            self.past = self.runtime.to_device(new, room_for=self._columns_ahead(rows))
            return
        old = self.runtime.to_host(self.past)
        width = max(self.mask.shape[1], mask.shape[1])
        ahead = self._columns_ahead(self.rows + rows)
        columns = self.runtime.buffer_columns(width, ahead)
        stacked = [_stack_right_aligned([o, n], width, columns) for o, n in zip(old, new)]
        self.past = self.runtime.to_device(stacked, room_for=ahead, length=width)
        self.mask = np.concatenate([_left_pad_mask(self.mask, width), _left_pad_mask(mask, width)], axis=0)
        self.rows = self.rows + rows

    def _remove(self, leaving: list[Sequence]) -> None:
        """Free the rows of sequences that left, and the columns no remaining row uses."""
        if not leaving:
            return
        keep = [row for row, seq in enumerate(self.rows) if seq not in leaving]
        if not keep:
            self.rows, self.past, self.mask = [], None, np.zeros((0, 0), dtype=np.int64)
            return
        mask = self.mask[keep]
        first_used = int(np.argmax(mask.any(axis=0)))  # columns left of this are padding in every row
        self.rows = [self.rows[row] for row in keep]
        kept = [a[keep, :, first_used:] for a in self.runtime.to_host(self.past)]  # one copy
        self.past = self.runtime.to_device(kept, room_for=self._columns_ahead(self.rows))
        self.mask = mask[:, first_used:]


# --- the engine (runs on the event loop) --------------------------------------------------------------


@dataclass(frozen=True)
class EngineLimits:
    max_batch_size: int = 8
    max_queue: int = 64


class Engine:
    """Accepts requests, runs the scheduler loop, streams each sequence's events back to its caller."""

    def __init__(self, runtime: DecoderRuntime, config: DecoderConfig, tokenizer: Tokenizer, limits: EngineLimits, metrics=None):
        if limits.max_batch_size < 1 or limits.max_queue < 0:
            raise ValueError("max_batch_size must be >= 1 and max_queue >= 0")
        self.runtime, self.config, self.tokenizer, self.limits = runtime, config, tokenizer, limits
        self._runner = BatchRunner(runtime, config)
        self._waiting: deque[Sequence] = deque()
        self._ids = itertools.count(1)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step")
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = True
        self._task: asyncio.Task | None = None
        self.metrics = metrics  # service.metrics.Metrics or None

    # lifecycle

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvserve-scheduler")

    def stop_accepting(self) -> None:
        self._accepting = False

    async def drain(self, timeout: float) -> bool:
        """Wait until every admitted and waiting sequence finished; True if it happened within timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    # requests

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def make_sequence(self, request: GenerationRequest) -> Sequence:
        """Validate a request against the model and limits; every refusal names its field."""
        config = self.config
        if request.prompt_ids is not None and request.prompt_text is not None:
            raise InvalidArgument("prompt", "give text or token_ids, not both")
        if request.prompt_ids is not None:
            prompt = list(request.prompt_ids)
            field_name = "prompt.token_ids"
        else:
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
        if not params.temperature >= 0 or params.temperature == float("inf"):
            raise InvalidArgument("sampling.temperature", f"must be a finite number >= 0, got {params.temperature}")
        if params.top_k < 0:
            raise InvalidArgument("sampling.top_k", f"must be >= 0, got {params.top_k}")
        if not 0 < params.top_p <= 1:
            raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {params.top_p}")
        if not params.repetition_penalty > 0 or params.repetition_penalty == float("inf"):
            raise InvalidArgument("sampling.repetition_penalty", f"must be a finite number > 0, got {params.repetition_penalty}")
        bad = [t for t in request.stop_token_ids if not 0 <= t < config.vocab_size]
        if bad:
            raise InvalidArgument("stop_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
        stop_ids = set(request.stop_token_ids)
        if config.eos_token_id is not None and not request.ignore_eos:
            stop_ids.add(config.eos_token_id)
        if params.seed == 0:
            params = SamplingParams(**{**params.__dict__, "seed": secrets.randbits(63)})
        return Sequence(
            id=next(self._ids),
            prompt_ids=prompt,
            max_new_tokens=max_new,
            params=params,
            stop_ids=frozenset(stop_ids),
            return_logprobs=request.return_logprobs,
            decoder=IncrementalDecoder(self.tokenizer),
            stops=StopSequences(request.stop_sequences),
        )

    async def generate(self, request: GenerationRequest):
        """Stream StepEvents for one request; the last carries the finish. Closing the stream early (client
        cancelled, disconnected, deadline) frees the sequence's cache within one step."""
        if not self._accepting:
            raise Unavailable("the server is shutting down")
        seq = self.make_sequence(request)
        if len(self._waiting) >= self.limits.max_queue:
            raise QueueFull(f"the queue is full ({self.limits.max_queue} requests waiting); retry later")
        seq.events = asyncio.Queue()
        self._waiting.append(seq)
        self._idle.clear()
        self._wakeup.set()
        try:
            while True:
                event = await seq.events.get()
                if isinstance(event, BaseException):
                    raise SequenceFailed(f"generation failed: {type(event).__name__}: {event}") from event
                yield event
                if event.finish is not None:
                    return
        finally:
            if not seq.finished:
                seq.cancelled = True
                try:
                    self._waiting.remove(seq)  # still queued: its slot in the queue frees now
                except ValueError:
                    self._wakeup.set()  # running: the next step removes its row and frees its cache

    def stats(self) -> dict:
        rows = list(self._runner.rows)
        row_bytes = self._runner.row_bytes()
        return {
            "active": len(rows),
            "queued": len(self._waiting),
            "kv_bytes": row_bytes * len(rows),
            "sequences": [(s.id, s.total_tokens, row_bytes) for s in rows],
        }

    # the scheduler loop

    async def _loop(self) -> None:
        while True:
            if not self._runner.rows and not self._waiting:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._step()

    async def _step(self) -> None:
        """One batch step. Its own coroutine, so no sequence outlives the step in a local variable."""
        runner = self._runner
        admitted = []
        while self._waiting and len(runner.rows) + len(admitted) < self.limits.max_batch_size:
            admitted.append(self._waiting.popleft())
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._executor, runner.step, admitted)
        except Exception as exc:  # the model step itself failed: every sequence in it fails, none hangs
            log.exception("model step failed; failing the %d sequences in it", len(runner.rows) + len(admitted))
            results = runner.fail_all(exc) + [(s, exc) for s in admitted if s not in runner.rows]
            for seq, _ in results:
                seq.finished = True
        now = time.monotonic_ns()
        for seq, event in results:
            if not seq.cancelled:
                seq.events.put_nowait(event)
                if self.metrics is not None and isinstance(event, StepEvent):
                    self.metrics.on_token(seq.arrival_ns, seq.last_sent_ns, now)
                    seq.last_sent_ns = now
        if self.metrics is not None:
            self.metrics.on_step(len(results), len(runner.rows), len(self._waiting), runner.kv_bytes())
