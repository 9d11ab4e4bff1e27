"""One request's life in the engine: what was asked (GenerationRequest), its generation state (Sequence),
and what each step hands back to its caller (StepEvent, with a Finish on the last one)."""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from kvserve.contract.chat import ChatMessage, ToolCall

from .drafts import DraftState
from .sampling import SamplingParams, choose, log_probability, top_log_probabilities
from .structured import Constraint, FormatError, ResponseFormat
from .text import IncrementalDecoder, StopSequences
from .reasoning import ThinkingSplit
from .tool_call_text import CallDelta, ToolCallSplit
from .tool_calls import ToolRequest


@dataclass(frozen=True)
class GenerationRequest:
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    prompt_messages: tuple[ChatMessage, ...] | None = None  # a conversation, rendered by the model's chat template
    chat_template_kwargs: str | None = None  # a JSON object: extra variables for the template (with prompt_messages only)
    tools: ToolRequest | None = None  # functions the reply may call (with prompt_messages only): tool_calls.py
    max_new_tokens: int = 0  # 0: as many as fit in the context
    sampling: SamplingParams = SamplingParams()
    stop_sequences: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    return_logprobs: bool = False
    top_logprobs: int = 0  # with return_logprobs: this many likeliest alternatives each token
    ignore_eos: bool = False
    min_new_tokens: int = 0  # before this many new tokens, no stop token (end-of-sequence included) may be taken
    skip_special_tokens: bool = True  # special tokens' text left out of the output
    include_stop_sequence: bool = False  # a matched stop sequence ends the text
    response_format: ResponseFormat | None = None  # the output's structure (structured.py); None: free text
    thinking_token_budget: int | None = None  # a reasoning model's thinking bound in tokens; None: the server's default
    speculation: bool = True  # False: this request's steps check no drafts (where the server's --speculation is on)
    streamed: bool = True  # False: its caller takes the answer whole (a body, not a stream), so its tokens may reach the
    # event loop in bursts (scheduler.py UNSTREAMED_HANDOFF_NS)
    traceparent: str | None = None  # the caller's W3C trace context (HTTP headers, gRPC metadata), read when tracing is on
    tracestate: str | None = None


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP_SEQUENCE = "stop_sequence"
    END_OF_SEQUENCE = "end_of_sequence"
    TOOL_CALLS = "tool_calls"  # the reply ended with whole tool calls


@dataclass(frozen=True)
class Finish:
    reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    time_to_first_token_ns: int
    total_ns: int
    stop_sequence: str = ""
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V were reused from the prompt cache, not computed
    tool_calls: tuple[ToolCall, ...] = ()  # the reply's calls, parsed whole (with FinishReason.TOOL_CALLS)
    reasoning_tokens: int = 0  # of the generated tokens, those spent thinking (a reasoning model's, reasoning.py)
    accepted_draft_tokens: int = 0  # of the generated tokens, drafts the model's step agreed with (drafts.py)
    rejected_draft_tokens: int = 0  # drafts offered for it that the model's step did not keep


@dataclass(frozen=True)
class StepEvent:
    """What one step produced for one sequence: a token and its text, and on the last step the finish."""

    token_id: int
    text: str
    logprob: float | None
    finish: Finish | None
    top_logprobs: list[tuple[int, float]] | None = None  # (id, log-probability) of the likeliest tokens, when asked
    call_text: str = ""  # with tools: this step's text of the reply's tool calls, as the model wrote it (text: content only)
    call_deltas: tuple[CallDelta, ...] = ()  # and what it adds to each call: a name, then pieces of its arguments
    reasoning: str = ""  # a reasoning model's: this step's text of its thinking (text: the answer only)
    prompt_tokens: int = 0  # on a sequence's first token: its prompt's length (usage while streaming); else 0


@dataclass(eq=False)
class Sequence:
    """One request's generation state (the row it holds, and how far it has written it, are the scheduler's:
    kv_rows.HeldRow)."""

    id: int
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    stop_ids: frozenset[int]
    return_logprobs: bool
    decoder: IncrementalDecoder
    stops: StopSequences
    top_logprobs: int = 0  # the likeliest alternatives reported with each token's log-probability
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    generated: list[int] = field(default_factory=list)
    reused_prompt_tokens: int = 0  # the prompt tokens whose K/V it found in the cache when it joined (prompt_cache.py)
    admitted_ns: int = 0  # when it got a batch row (its wait in the queue ended)
    first_token_ns: int = 0
    cancelled: bool = False  # set from the event loop when the client goes away
    finished: bool = False
    captured_logits: list | None = None  # the parity gate records the logits behind each token
    last_sent_ns: int | None = None  # when the previous token was handed to the client (metrics)
    events: asyncio.Queue | None = None
    constraint: Constraint | None = None  # a response_format's grammar state: which tokens may come next
    blocked_ids: tuple[int, ...] = ()  # with a constraint: ids never taken though the format allows them (ignore_eos)
    tool_calls: ToolCallSplit | None = None  # with tools: splits the reply into content and calls (and constrains the calls)
    long_rope: bool = False  # a longrope model's: its K/V turn by the long factors (it is longer than the original context)
    long_rope_from: int = 0  # the first column turned long: past 0 when it crossed without its cache computed again
    refill_ids: list[int] | None = None  # every token so far, prefilled again, long, where it first grows past (scheduler.py)
    min_new_tokens: int = 0  # until this many are generated, stop_ids' logits are held back (vLLM's min_tokens)
    thinking: ThinkingSplit | None = None  # a reasoning model's conversation: splits its thinking from its answer
    thinking_budget: int = 0  # tokens it may think before it is made to answer (0: no bound)
    thinking_close_ids: tuple[int, ...] = ()  # the closing marker's ids, written for it once the budget is spent
    answer_constraint: Constraint | None = None  # a structure the answer is held to, from the end of the thinking
    forced: list[int] = field(default_factory=list)  # ids it takes next whatever the model says (the closing marker)
    reasoning_tokens: int = 0  # generated tokens spent thinking
    speculate: bool = True  # whether its steps may check drafts (the server's --speculation and the request's say)
    streamed: bool = True  # whether its caller streams its tokens (GenerationRequest.streamed)
    drafts: DraftState | None = None  # speculation's state for this row (drafts.py), made when it first may draft

    def __post_init__(self):
        self.rng = np.random.default_rng(self.params.seed)

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def prefill_ids(self) -> list[int]:
        """What its prefill puts in its row: the prompt, or every token so far when the row is computed again."""
        return self.prompt_ids if self.refill_ids is None else self.refill_ids

    @property
    def prefilling(self) -> bool:
        """Whether part of prefill_ids still has to go through the model (chunked prefill)."""
        return (not self.generated or self.refill_ids is not None) and not self.finished

    @property
    def takes_greedy_token(self) -> bool:
        """Whether the argmax of its logits is the token this sequence takes (greedy, with no repetition, presence or
        frequency penalty, no logit bias, no constraint and no log-probability): then it takes the graph's greedy token
        (runtime.Sampled)."""
        return (self.params.greedy and not self.params.changes_logits and not self.return_logprobs and self.constraint is None
                and len(self.generated) >= self.min_new_tokens)

    @property
    def needs_logits(self) -> bool:
        """Whether a step must read this sequence's logits back: it samples from them, or records them (the gate)."""
        return not self.takes_greedy_token or self.captured_logits is not None

    def advance(self, logits: np.ndarray | None, greedy_token: int | None = None, allowed: np.ndarray | None = None,
                draft: int | None = None) -> StepEvent:
        """Take the next token: greedy_token (the argmax of this sequence's logits, computed where the step ran) when
        the sequence takes it, else chosen from its logits (V,), among the allowed ones when it is
        constrained (allowed: the ids its mask allows, ascending); apply stop rules; return the event. Log-probabilities
        are the model's, before any mask. draft: the token guessed for this position (drafts.py), taken when it is the
        token chosen: a sampled row draws as it would without it (its seed's draws in the same order), so the draft is
        taken with probability p(draft), and otherwise the token is p's with the draft left out (speculative sampling's
        rule for a single guessed token), and the row's tokens are the ones it makes with drafts off, to the rounding of
        its logits (a draft check computes its positions together: docs/serving.md, "Speculation")."""
        now = time.monotonic_ns()
        if self.needs_logits and logits is None:
            raise ValueError(f"sequence {self.id} reads its logits, but the step returned only greedy tokens")
        if self.captured_logits is not None:
            self.captured_logits.append(logits.copy())
        if self.forced:  # the thinking budget is spent: the closing marker, whatever the model says
            token = self.forced.pop(0)
            logprob = log_probability(logits, token) if self.return_logprobs and logits is not None else None
        elif greedy_token is not None and self.takes_greedy_token:
            token, logprob = int(greedy_token), None
        else:
            seen = None
            if self.params.repetition_penalty != 1.0:
                seen = np.fromiter(itertools.chain(self.prompt_ids, self.generated), dtype=np.int64)
            held_back = len(self.generated) < self.min_new_tokens and self.stop_ids
            allowed_ids = self._allowed_ids(allowed) if self.constraint is not None else None
            sampled = logits
            if held_back and allowed_ids is not None:
                kept = np.setdiff1d(allowed_ids, list(self.stop_ids), assume_unique=True)
                allowed_ids = kept if kept.size else allowed_ids  # a structure that can only end, ends
            elif held_back:
                sampled = logits.copy()
                sampled[list(self.stop_ids)] = -np.inf
            token = choose(sampled, self.params, self.rng, seen, self.generated, allowed_ids)
            logprob = log_probability(logits, token) if self.return_logprobs else None
        top = top_log_probabilities(logits, self.top_logprobs) if self.top_logprobs else None
        self.generated.append(token)
        if self.drafts is not None:
            self.drafts.lookup.push(token)
            if draft is not None and token == draft:
                self.drafts.accepted += 1
        if self.constraint is not None and token not in self.stop_ids:  # an end-of-sequence token ends it instead
            self.constraint.accept(token)
        if len(self.generated) == 1:
            self.first_token_ns = now
        text, stop = self.stops.push(self.decoder.push(token))
        reason = FinishReason.STOP_SEQUENCE if stop else None
        if reason is None and (token in self.stop_ids or (self.constraint is not None and self.constraint.finished)):
            reason = FinishReason.END_OF_SEQUENCE  # the model ended it, or the structure is complete
        if reason is None and len(self.generated) >= self.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason in (FinishReason.END_OF_SEQUENCE, FinishReason.LENGTH):
            tail, stop = self.stops.push(self.decoder.flush())  # the held-back bytes may complete a stop
            text += tail
            if stop:
                reason = FinishReason.STOP_SEQUENCE
            else:
                text += self.stops.flush()
        reasoning = ""
        if self.thinking is not None:
            reasoning, text = self._think(text, finishing=reason is not None)
        call_text, deltas, calls = "", (), ()
        if self.tool_calls is not None:
            text, call_text, deltas = self.tool_calls.split(self, token, text, finishing=reason is not None)
            if reason is not None:
                calls = self.tool_calls.calls
                if calls and reason is FinishReason.END_OF_SEQUENCE:
                    reason = FinishReason.TOOL_CALLS
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
                cached_prompt_tokens=self.reused_prompt_tokens,
                tool_calls=calls,
                reasoning_tokens=self.reasoning_tokens,
                accepted_draft_tokens=0 if self.drafts is None else self.drafts.accepted,
                rejected_draft_tokens=0 if self.drafts is None else self.drafts.drafted - self.drafts.accepted,
            )
        return StepEvent(token_id=token, text=text, logprob=logprob, finish=finish, top_logprobs=top, call_text=call_text,
                         call_deltas=tuple(deltas), reasoning=reasoning, prompt_tokens=len(self.prompt_ids) if len(self.generated) == 1 else 0)

    def _think(self, text: str, finishing: bool) -> tuple[str, str]:
        """(thinking, answer) of this step's text; counts the token as thinking, forces the closing marker once the budget
        is spent, and holds the answer to its structure from its first token."""
        split = self.thinking
        was_thinking = split.thinking
        reasoning, text = split.split(text, finishing)
        if was_thinking or split.thinking:
            self.reasoning_tokens += 1
        if split.thinking and self.thinking_budget and self.reasoning_tokens >= self.thinking_budget and not self.forced:
            self.forced = list(self.thinking_close_ids)
            self.thinking_budget = 0  # spent: forced once
        if not split.thinking and self.answer_constraint is not None and (was_thinking or not split.thought):
            self.constraint, self.answer_constraint = self.answer_constraint, None
        return reasoning, text

    def _allowed_ids(self, allowed: np.ndarray | None) -> np.ndarray:
        """The ids this sequence may take next, ascending: its mask's (allowed), less the blocked ones."""
        if allowed is None:
            raise ValueError(f"sequence {self.id} is constrained, but the step computed no mask for it")
        self.constraint.check()
        ids = allowed
        if self.blocked_ids:
            ids = np.setdiff1d(ids, self.blocked_ids, assume_unique=True)
        if not ids.size:
            raise FormatError("response_format", "no token may follow (only end-of-sequence, which ignore_eos refuses)")
        return ids
