"""A request checked against the model and the limits, and made into a Sequence: every refusal is an InvalidArgument
that names the field (gRPC's name; the HTTP edge names the OpenAI parameter instead). Runs off the event loop
(tokenizing and rendering a conversation take time)."""

from __future__ import annotations

import itertools
import json
import secrets
from collections.abc import Callable

from kvserve.contract.chat import RESERVED_TEMPLATE_VARIABLES, ChatMessage, ChatTemplate, TemplateError
from kvserve.contract.config import DecoderConfig
from kvserve.contract.tokenizer import Tokenizer

from .engine_errors import InvalidArgument
from .limits import MAX_BIAS, MAX_PENALTY, MAX_SCALE, MIN_SCALE, EngineLimits
from .reasoning import ThinkingSplit, opens_thinking, thinking_markers
from .sampling import SamplingParams
from .sequence import GenerationRequest, Sequence
from .structured import FormatCompiler, FormatError
from .text import IncrementalDecoder, StopSequences, encodable, refuse_lone_surrogates
from .tool_calls import ToolCalling, ToolChoice

# Prompt tokens the text decoder reads before the first new one: enough for a character split across byte
# tokens and for a leading space that depends on what precedes it.
PROMPT_CONTEXT_TOKENS = 6
# Text longer than this is tokenized by the encoder given (the server's tokenizing process); shorter, here: a round
# trip to another process would cost a short prompt more than its tokenizing.
OFFLOAD_CHARACTERS = 4096
# A request this small is validated on the event loop (validates_inline): handing it to a thread and back costs two
# thread wake-ups, 0.6 ms on a 2-core AMD EPYC VM, where the default model's tokenizer took 0.14 ms for 256 characters of
# English (0.60 for 1,024) and checking 4,096 ids less; anything larger, a conversation (its chat template's rendering)
# and any grammar to compile go to a thread, so no request holds up the loop.
INLINE_CHARACTERS = 256
INLINE_TOKEN_IDS = 4096

# encoder(text, add_special_tokens, most): text's ids, or their count when there are more than `most`
Encoder = Callable[[str, bool, int], "list[int] | int"]


def validates_inline(request: GenerationRequest) -> bool:
    """Whether make_sequence costs request less on the event loop than on a thread: no structure to compile, and a
    prompt of at most INLINE_TOKEN_IDS ids or INLINE_CHARACTERS characters of text (a conversation never: rendering
    its template is not bounded by its length)."""
    if request.response_format is not None or request.tools is not None or request.prompt_messages is not None:
        return False
    if request.prompt_ids is not None:
        return len(request.prompt_ids) <= INLINE_TOKEN_IDS
    return len(request.prompt_text or "") <= INLINE_CHARACTERS


def check_sizes(request: GenerationRequest, limits: EngineLimits, context: int | None = None) -> None:
    """What a request's size alone refuses, before anything reads it further: its prompt text or its conversation's
    contents over max_text_bytes, more messages or stop sequences than the limits, its token ids beyond the context
    (when given), its response_format over max_response_format_bytes. The HTTP edge's body worker makes the same checks,
    so nothing oversized travels back into the server process."""
    if request.prompt_ids is not None and context is not None and len(request.prompt_ids) >= context:
        raise too_long("prompt.token_ids", len(request.prompt_ids), context)
    if request.prompt_messages is not None and len(request.prompt_messages) > limits.max_chat_messages:
        raise InvalidArgument("prompt.messages", f"{len(request.prompt_messages)} messages; at most {limits.max_chat_messages}")
    if len(request.stop_sequences) > limits.max_stop_sequences:
        raise InvalidArgument("stop_sequences", f"{len(request.stop_sequences)} stop sequences; at most {limits.max_stop_sequences}")
    if request.prompt_text is not None:
        check_text_size("prompt.text", request.prompt_text, limits.max_text_bytes)
    if request.prompt_messages is not None:
        # A turn's calls and a tool turn's call id and name are content too.
        size = sum(len(text.encode("utf-8", errors="replace")) for m in request.prompt_messages
                   for text in (m.content, m.tool_call_id or "", m.name or "", *(c.arguments + c.name + c.id for c in m.tool_calls)))
        if size > limits.max_text_bytes:
            raise InvalidArgument("prompt.messages", f"{size} bytes of content; at most {limits.max_text_bytes}")
    if request.chat_template_kwargs is not None:
        size = len(request.chat_template_kwargs.encode("utf-8", errors="replace"))
        if size > limits.max_chat_template_kwargs_bytes:
            raise InvalidArgument("chat_template_kwargs", f"{size} bytes; at most {limits.max_chat_template_kwargs_bytes}")
    if request.response_format is not None:
        size = len(request.response_format.text.encode("utf-8", errors="replace"))
        if size > limits.max_response_format_bytes:
            raise InvalidArgument("response_format", f"{size} bytes; at most {limits.max_response_format_bytes}")
    if request.tools is not None:
        size = len(request.tools.tools.encode("utf-8", errors="replace"))
        if size > limits.max_tools_bytes:
            raise InvalidArgument("tools", f"{size} bytes of JSON; at most {limits.max_tools_bytes}")


def too_long(field_name: str, tokens: int, context: int) -> InvalidArgument:
    return InvalidArgument(field_name, f"the prompt has {tokens} tokens; the context holds {context} including at least one new token")


def check_text_size(field_name: str, text: str, limit: int) -> None:
    size = len(text.encode("utf-8", errors="replace"))
    if size > limit:
        raise InvalidArgument(field_name, f"{size} bytes of text; at most {limit}")


class RequestValidator:
    """Turns GenerationRequests into Sequences for one model under one set of limits."""

    def __init__(self, config: DecoderConfig, tokenizer: Tokenizer, limits: EngineLimits, chat_template: ChatTemplate | None = None,
                 encoder: Encoder | None = None, kv_budget_tokens: int | None = None):
        """encoder: where long texts are tokenized (default: here, with tokenizer); kv_budget_tokens: the most tokens of
        K/V a sequence may hold under the server's budget (kv_budget.py; None: no budget)."""
        self.config, self.tokenizer, self.limits = config, tokenizer, limits
        self.kv_budget_tokens = kv_budget_tokens
        self.encoder = encoder
        self.chat_template = chat_template  # None: the model has none, and conversations are refused
        self.formats = FormatCompiler(tokenizer, config.vocab_size, config.eos_token_ids, limits.max_response_format_bytes,
                                      limits.max_schema_depth)
        self.tool_calling = ToolCalling(chat_template, tokenizer, self.formats, limits)
        self.thinking_markers = thinking_markers(chat_template.source if chat_template is not None else None)
        close = self.thinking_markers.close if self.thinking_markers is not None else ""
        self.thinking_close_ids = tuple(tokenizer.encode(close, add_special_tokens=False)) if close else ()
        self._ids = itertools.count(1)

    def check_text(self, field_name: str, text: str) -> None:
        check_text_size(field_name, text, self.limits.max_text_bytes)

    def make_sequence(self, request: GenerationRequest) -> Sequence:
        """Validate a request against the model and limits; every refusal names its field."""
        config, limits = self.config, self.limits
        if sum(p is not None for p in (request.prompt_ids, request.prompt_text, request.prompt_messages)) > 1:
            raise InvalidArgument("prompt", "give one of text, token_ids or messages")
        check_sizes(request, limits)
        tools, split, tools_constraint = self._tools(request)
        if request.prompt_ids is not None:
            prompt = list(request.prompt_ids)
            field_name = "prompt.token_ids"
        elif request.prompt_messages is not None:
            field_name = "prompt.messages"
            conversation = self.conversation_text(list(request.prompt_messages), request.chat_template_kwargs, tools)
            prompt = self._encode(field_name, conversation, add_special_tokens=False)  # the template wrote the special tokens
        else:
            field_name = "prompt.text"
            prompt = self._encode(field_name, request.prompt_text or "", add_special_tokens=True)
        if not prompt:
            raise InvalidArgument(field_name, "the prompt is empty")
        room = config.n_ctx - len(prompt)
        if room < 1:  # first: what follows reads every id, and this bounds them by the context
            raise self._too_long(field_name, len(prompt))
        bad = [t for t in prompt if not 0 <= t < config.vocab_size]
        if bad:
            raise InvalidArgument(field_name, f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
        max_new = request.max_new_tokens or room
        if max_new > room:
            raise InvalidArgument(
                "max_new_tokens", f"{max_new} new tokens do not fit: the prompt has {len(prompt)} of the {config.n_ctx}-token context ({room} left)"
            )
        if self.kv_budget_tokens is not None:  # what may wait for memory that frees later, and what never fits
            budget_room = self.kv_budget_tokens - len(prompt)
            budget = f"the server's K/V budget holds {self.kv_budget_tokens} tokens (--kv-cache-memory)"
            if budget_room < 1:
                raise InvalidArgument(field_name, f"the prompt has {len(prompt)} tokens; {budget}, including at least one new token")
            if not request.max_new_tokens:
                max_new = min(max_new, budget_room)  # as many as fit
            elif max_new > budget_room:
                raise InvalidArgument("max_new_tokens", f"{max_new} new tokens after a {len(prompt)}-token prompt do not fit: {budget}, "
                                      f"so at most {budget_room} new tokens")
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
        if len(params.logit_bias) > limits.max_logit_bias:
            raise InvalidArgument("sampling.logit_bias", f"{len(params.logit_bias)} entries; at most {limits.max_logit_bias}")
        for token, bias in params.logit_bias:
            if not 0 <= token < config.vocab_size:
                raise InvalidArgument("sampling.logit_bias", f"token id {token} is outside the vocabulary [0, {config.vocab_size})")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise InvalidArgument("sampling.logit_bias", f"the bias of token {token} must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias}")
        if not 0 <= request.top_logprobs <= limits.max_top_logprobs:
            raise InvalidArgument("top_logprobs", f"must be in [0, {limits.max_top_logprobs}], got {request.top_logprobs}")
        if request.top_logprobs and not request.return_logprobs:
            raise InvalidArgument("top_logprobs", "alternatives come with the log-probabilities: set return_logprobs too")
        longest = max((len(stop) for stop in request.stop_sequences), default=0)
        if longest > limits.max_stop_length:
            raise InvalidArgument("stop_sequences", f"a stop sequence of {longest} characters; at most {limits.max_stop_length}")
        if not 0 <= request.min_new_tokens <= max_new:
            raise InvalidArgument("min_new_tokens", f"must be in [0, max_new_tokens = {max_new}], got {request.min_new_tokens}")
        if len(request.stop_token_ids) > limits.max_stop_sequences:
            raise InvalidArgument("stop_token_ids", f"{len(request.stop_token_ids)} stop tokens; at most {limits.max_stop_sequences}")
        bad = [t for t in request.stop_token_ids if not 0 <= t < config.vocab_size]
        if bad:
            raise InvalidArgument("stop_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids.update(config.eos_token_ids)
        constraint = tools_constraint
        if request.response_format is not None:
            try:
                constraint = self.formats.compile(request.response_format)
            except FormatError as exc:
                raise InvalidArgument(exc.field, exc.message) from None
        budget = self.limits.thinking_token_budget if request.thinking_token_budget is None else request.thinking_token_budget
        if request.thinking_token_budget is not None and not 1 <= request.thinking_token_budget <= config.n_ctx:
            raise InvalidArgument("thinking_token_budget", f"must be in [1, {config.n_ctx}] (the context), got {request.thinking_token_budget}")
        thinking, answer_constraint = None, None
        if request.prompt_messages is not None and self.thinking_markers is not None:
            # A structure the reply is held to from its first token leaves it no room to open a thinking; one the prompt
            # opened is thought through first, the structure holding the answer after it.
            inside = opens_thinking(conversation, self.thinking_markers)
            thinking = ThinkingSplit(self.thinking_markers, inside, may_open=constraint is None)
            if inside and constraint is not None:
                constraint, answer_constraint = None, constraint
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
            decoder=IncrementalDecoder(self.tokenizer, context=prompt[-PROMPT_CONTEXT_TOKENS:], skip_special_tokens=request.skip_special_tokens),
            stops=StopSequences(request.stop_sequences, include_stop=request.include_stop_sequence),
            min_new_tokens=request.min_new_tokens,
            constraint=constraint,
            blocked_ids=tuple(config.eos_token_ids) if (constraint or answer_constraint) is not None and request.ignore_eos else (),
            tool_calls=split,
            thinking=thinking,
            thinking_budget=budget if thinking is not None else 0,
            thinking_close_ids=self.thinking_close_ids,
            answer_constraint=answer_constraint,
            speculate=request.speculation,
            streamed=request.streamed,
        )

    def _tools(self, request: GenerationRequest):
        """(the tools the template renders, the sequence's content/calls split, the constraint it starts with)."""
        if request.tools is None:
            return None, None, None
        if request.prompt_messages is None:
            raise InvalidArgument("tools", "tools come with a conversation (messages), which the chat template renders them into")
        if request.response_format is not None and request.tools.choice is not ToolChoice.NONE:
            raise InvalidArgument("tools", "a reply held to tool calls cannot also follow response_format: send one, or tool_choice none")
        tools, functions = self.tool_calling.read(request.tools)
        split, constraint = self.tool_calling.start(request.tools, functions)
        return tools, split, constraint

    def render(self, request: GenerationRequest) -> tuple[str | None, list[int]]:
        """(the prompt's text as the model reads it, its token ids) exactly as generating request would have them: the
        request goes through every check make_sequence runs, so a request refused there is refused here with the same
        message. The text: the chat template's rendering of a conversation, a text prompt as given, None for token ids."""
        prompt_ids = self.make_sequence(request).prompt_ids
        if request.prompt_messages is not None:
            tools, _, _ = self._tools(request)
            return self.conversation_text(list(request.prompt_messages), request.chat_template_kwargs, tools), prompt_ids
        return request.prompt_text if request.prompt_ids is None else None, prompt_ids

    def render_conversation(self, messages: list[ChatMessage], template_kwargs: str | None = None, tools: list[dict] | None = None) -> list[int]:
        """A conversation's prompt tokens: rendered by the model's chat template (given template_kwargs' variables, a JSON
        object, and the tools the reply may call), the assistant's turn opened."""
        return self._encode("prompt.messages", self.conversation_text(messages, template_kwargs, tools), add_special_tokens=False)  # the template wrote the special tokens

    def conversation_text(self, messages: list[ChatMessage], template_kwargs: str | None = None, tools: list[dict] | None = None) -> str:
        """render_conversation's text, before it is tokenized; every refusal names its field."""
        field_name = "prompt.messages"
        if self.chat_template is None:
            raise InvalidArgument(field_name, "this model has no chat template (its artifact has no chat_template.jinja and no "
                                  "chat_template in tokenizer_config.json): send text or token_ids")
        if not messages:
            raise InvalidArgument(field_name, "the conversation has no messages")
        for index, message in enumerate(messages):
            if not message.role or len(message.role) > self.limits.max_role_length:
                raise InvalidArgument(f"{field_name}[{index}].role", f"must be 1 to {self.limits.max_role_length} characters, got {len(message.role)}")
            for number, call in enumerate(message.tool_calls):
                try:
                    arguments = json.loads(call.arguments)
                except (ValueError, RecursionError):
                    arguments = None
                where = f"{field_name}[{index}].tool_calls[{number}].arguments"
                if not isinstance(arguments, dict):
                    raise InvalidArgument(where, "must be a JSON object (as text)")
                refuse_lone_surrogates(arguments, where)
        variables = _template_variables(template_kwargs)
        try:
            text = self.chat_template.render(messages, variables=variables, tools=tools)
        except TemplateError as exc:
            raise InvalidArgument(field_name, str(exc)) from None
        if not encodable(text):  # whatever the checks above missed: no tokenizer encodes a lone surrogate
            raise InvalidArgument(field_name, "the rendered conversation is not valid Unicode (a lone surrogate)")
        return text

    def _encode(self, field_name: str, text: str, add_special_tokens: bool) -> list[int]:
        """text's ids; a long text by the encoder, which counts what does not fit the context instead of returning it."""
        if self.encoder is None or len(text) <= OFFLOAD_CHARACTERS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        ids = self.encoder(text, add_special_tokens, self.config.n_ctx - 1)
        if isinstance(ids, int):
            raise self._too_long(field_name, ids)
        return ids

    def _too_long(self, field_name: str, tokens: int) -> InvalidArgument:
        return too_long(field_name, tokens, self.config.n_ctx)


def _template_variables(template_kwargs: str | None) -> dict:
    """chat_template_kwargs' JSON object as the template's extra variables; any other JSON, or a name the template is
    already given, refused by name."""
    if template_kwargs is None:
        return {}
    try:
        variables = json.loads(template_kwargs)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidArgument("chat_template_kwargs", f"not valid JSON ({type(exc).__name__})") from None
    if not isinstance(variables, dict):
        raise InvalidArgument("chat_template_kwargs", f"must be a JSON object, got {type(variables).__name__}")
    refuse_lone_surrogates(variables, "chat_template_kwargs")
    reserved = sorted(set(variables) & RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise InvalidArgument("chat_template_kwargs", f"{reserved[0]!r} is set by the server, not by chat_template_kwargs")
    return variables
