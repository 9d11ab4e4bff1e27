"""A request checked against the model and the limits, and made into a Sequence: every refusal is an InvalidArgument
that names the field (gRPC's name; the HTTP edge names the OpenAI parameter instead). Runs off the event loop
(tokenizing and rendering a conversation take time)."""

from __future__ import annotations

import itertools
import secrets

from kvserve.contract.chat import ChatMessage, ChatTemplate, TemplateError
from kvserve.contract.config import DecoderConfig
from kvserve.contract.tokenizer import Tokenizer

from .engine_errors import InvalidArgument
from .limits import MAX_BIAS, MAX_PENALTY, MAX_SCALE, MIN_SCALE, EngineLimits
from .sampling import SamplingParams
from .sequence import GenerationRequest, Sequence
from .structured import FormatCompiler, FormatError
from .text import IncrementalDecoder, StopSequences

# Prompt tokens the text decoder reads before the first new one: enough for a character split across byte
# tokens and for a leading space that depends on what precedes it.
PROMPT_CONTEXT_TOKENS = 6


class RequestValidator:
    """Turns GenerationRequests into Sequences for one model under one set of limits."""

    def __init__(self, config: DecoderConfig, tokenizer: Tokenizer, limits: EngineLimits, chat_template: ChatTemplate | None = None):
        self.config, self.tokenizer, self.limits = config, tokenizer, limits
        self.chat_template = chat_template  # None: the model has none, and conversations are refused
        self.formats = FormatCompiler(tokenizer, config.vocab_size, config.eos_token_ids, limits.max_response_format_bytes,
                                      limits.max_schema_depth)
        self._ids = itertools.count(1)

    def check_text(self, field_name: str, text: str) -> None:
        size = len(text.encode("utf-8", errors="replace"))
        if size > self.limits.max_text_bytes:
            raise InvalidArgument(field_name, f"{size} bytes of text; at most {self.limits.max_text_bytes}")

    def make_sequence(self, request: GenerationRequest) -> Sequence:
        """Validate a request against the model and limits; every refusal names its field."""
        config, limits = self.config, self.limits
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
            if not message.role or len(message.role) > self.limits.max_role_length:
                raise InvalidArgument(f"{field_name}[{index}].role", f"must be 1 to {self.limits.max_role_length} characters, got {len(message.role)}")
        size = sum(len(m.content.encode("utf-8", errors="replace")) for m in messages)
        if size > self.limits.max_text_bytes:
            raise InvalidArgument(field_name, f"{size} bytes of content; at most {self.limits.max_text_bytes}")
        try:
            text = self.chat_template.render(messages)
        except TemplateError as exc:
            raise InvalidArgument(field_name, str(exc)) from None
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens
