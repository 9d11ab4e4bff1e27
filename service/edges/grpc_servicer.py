"""The gRPC servicer: protobuf -> engine domain -> protobuf, nothing else. Errors are raised and become status codes in
grpc_errors.ErrorInterceptor; what a GetModelInfo reports is the App's (model_info.ModelInfo), translated here."""

from __future__ import annotations

import contextlib
from typing import Protocol

import grpc

from kvserve.contract.chat import ChatMessage, ToolCall
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from ..core.engine import Engine
from ..core.engine_errors import InvalidArgument
from ..core.limits import limit_values
from ..core.model_info import ModelInfo
from ..core.sampling import SamplingParams
from ..core.sequence import Finish, FinishReason, GenerationRequest, StepEvent
from ..core.structured import FormatKind, ResponseFormat
from ..core.tool_calls import ToolChoice, ToolRequest
from .tokenizing import TokenizeProcess

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.END_OF_SEQUENCE: pb.FINISH_REASON_END_OF_SEQUENCE,
    FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS,
}


class Serving(Protocol):
    """What the servicer asks of the process serving it (app.App)."""

    def ready_engine(self) -> Engine: ...

    def ready_tokenizing(self) -> TokenizeProcess: ...

    def model_info(self) -> ModelInfo: ...


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """protobuf -> engine domain -> protobuf; nothing else."""

    def __init__(self, serving: Serving):
        self.serving = serving

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        engine = self.serving.ready_engine()
        domain = _to_domain(request, context.invocation_metadata())
        batched = request.batch_tokens
        to_proto = _batch_proto if batched else _to_proto  # a list of events a response, or one
        if request.n <= 1:
            async with contextlib.aclosing(engine.generate(domain, batched)) as events:
                async for event in events:
                    yield to_proto(event, engine.tokenizer)
            return
        async with contextlib.aclosing(engine.generate_n(domain, request.n, batched)) as events:
            async for index, event in events:
                response = to_proto(event, engine.tokenizer)
                response.index = index
                yield response

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        self.serving.ready_engine().validator.check_text("text", request.text)  # held to the prompt's limit
        return await self.serving.ready_tokenizing().respond(request.text)  # the serialized response: bytes pass through

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        return _model_info_proto(self.serving.model_info())


def _model_info_proto(info: ModelInfo) -> pb.GetModelInfoResponse:
    config, live = info.config, info.live
    return pb.GetModelInfoResponse(
        config=pb.ModelConfig(
            vocab_size=config.vocab_size, context_length=config.n_ctx, d_model=config.d_model,
            num_heads=config.n_head, num_layers=config.n_layer, eos_token_id=config.eos_token_id,
            architecture=config.architecture, model_type=config.model_type, num_key_value_heads=config.n_kv_head,
            head_dim=config.head_dim, eos_token_ids=config.eos_token_ids,
        ),
        manifest_sha256=info.manifest_sha256,
        dtype=info.dtype,
        kv_dtype=info.kv_dtype,
        execution_provider=info.provider,
        provider_note=info.provider_note,
        limits=pb.Limits(max_total_tokens=info.max_total_tokens, **limit_values(info.limits)),
        live=pb.LiveCounts(
            active_sequences=live.active, queued_sequences=live.queued, kv_slots_in_use=live.active, cached_rows=live.cached_rows,
            kv_cache_bytes=live.kv_bytes,
            cached_kv_cache_bytes=live.cached_kv_bytes,
            kv_cache_budget_bytes=live.kv_budget_bytes,
            sequences=[pb.SequenceKv(sequence_id=s.id, tokens=s.tokens, kv_cache_bytes=s.kv_bytes) for s in live.sequences],
        ),
        parity_gate=pb.ParityGate(passed=info.gate.passed, overridden=info.gate.overridden, summary=info.gate.summary),
        tokenizer=info.tokenizer,
        kv_cache=info.kv_cache,
        attention=info.attention,
        chat=info.chat,
        tool_call_format=info.tool_call_format,
    )


def _to_domain(request: pb.GenerateRequest, metadata=()) -> GenerationRequest:
    """The engine's request; metadata: the call's, whose W3C trace context (traceparent, tracestate) it carries."""
    sampling = request.sampling
    prompt = request.WhichOneof("prompt")
    trace = {key: value for key, value in metadata or () if key in ("traceparent", "tracestate") and isinstance(value, str)}
    return GenerationRequest(
        traceparent=trace.get("traceparent"),
        tracestate=trace.get("tracestate"),
        prompt_text=request.text if prompt == "text" else None,
        prompt_ids=tuple(request.token_ids.ids) if prompt == "token_ids" else None,
        prompt_messages=tuple(_message(m) for m in request.messages.messages) if prompt == "messages" else None,
        chat_template_kwargs=request.messages.chat_template_kwargs or None if prompt == "messages" else None,
        tools=_tools(request.messages) if prompt == "messages" else None,
        max_new_tokens=request.max_new_tokens,
        sampling=SamplingParams(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p or 1.0,
            repetition_penalty=sampling.repetition_penalty or 1.0,
            seed=sampling.seed,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            min_p=sampling.min_p,
            logit_bias=tuple(sorted(sampling.logit_bias.items())),
        ),
        stop_sequences=tuple(request.stop_sequences),
        stop_token_ids=tuple(request.stop_token_ids),
        return_logprobs=request.return_logprobs,
        top_logprobs=request.top_logprobs,
        ignore_eos=request.ignore_eos,
        min_new_tokens=request.min_new_tokens,
        skip_special_tokens=not request.keep_special_tokens,
        include_stop_sequence=request.include_stop_sequence,
        thinking_token_budget=request.thinking_token_budget if request.HasField("thinking_token_budget") else None,
        speculation=not request.HasField("speculation") or request.speculation,
        response_format=_response_format(request.response_format) if request.HasField("response_format") else None,
    )


def _message(message: pb.ChatMessage) -> ChatMessage:
    return ChatMessage(message.role, message.content, tuple(ToolCall(c.id, c.name, c.arguments) for c in message.tool_calls),
                       message.tool_call_id or None, message.name or None)


TOOL_CHOICES = {pb.TOOL_CHOICE_MODE_UNSPECIFIED: ToolChoice.AUTO, pb.TOOL_CHOICE_MODE_AUTO: ToolChoice.AUTO,
                pb.TOOL_CHOICE_MODE_NONE: ToolChoice.NONE, pb.TOOL_CHOICE_MODE_REQUIRED: ToolChoice.REQUIRED}


def _tools(conversation: pb.Conversation) -> ToolRequest | None:
    choice = conversation.tool_choice
    if not conversation.tools:
        if choice.WhichOneof("choice") == "function" or choice.mode == pb.TOOL_CHOICE_MODE_REQUIRED:
            raise InvalidArgument("tool_choice", "needs tools")
        return None
    parallel = conversation.parallel_tool_calls if conversation.HasField("parallel_tool_calls") else True
    if choice.WhichOneof("choice") == "function":
        return ToolRequest(conversation.tools, ToolChoice.FUNCTION, choice.function, parallel)
    if choice.mode not in TOOL_CHOICES:
        raise InvalidArgument("tool_choice.mode", f"unknown mode {choice.mode}")
    return ToolRequest(conversation.tools, TOOL_CHOICES[choice.mode], "", parallel)


FORMAT_KINDS = {"json_schema": FormatKind.JSON_SCHEMA, "json_object": FormatKind.JSON_OBJECT, "regex": FormatKind.REGEX,
                "lark_grammar": FormatKind.GRAMMAR}


def _response_format(message: pb.ResponseFormat) -> ResponseFormat:
    kind = message.WhichOneof("format")
    if kind is None:
        raise InvalidArgument("response_format", "set one of json_schema, json_object, regex or lark_grammar")
    return ResponseFormat(FORMAT_KINDS[kind], "" if kind == "json_object" else getattr(message, kind))


def _to_proto(event: StepEvent, tokenizer) -> pb.GenerateResponse:
    response = pb.GenerateResponse(token=_token_proto(event, tokenizer))
    if event.finish is not None:
        response.finish.CopyFrom(_finish_proto(event.finish))
    return response


def _batch_proto(events: list[StepEvent], tokenizer) -> pb.GenerateResponse:
    """One response of a batch_tokens stream: the events' tokens, in order, and the last one's finish."""
    response = pb.GenerateResponse(tokens=[_token_proto(event, tokenizer) for event in events])
    if events[-1].finish is not None:
        response.finish.CopyFrom(_finish_proto(events[-1].finish))
    return response


def _token_proto(event: StepEvent, tokenizer) -> pb.Token:
    token = pb.Token(id=event.token_id, text_delta=event.text, logprob=event.logprob, tool_call_delta=event.call_text,
                     reasoning_delta=event.reasoning)
    if event.top_logprobs:
        pieces = tokenizer.pieces([token for token, _ in event.top_logprobs])
        token.top_logprobs.extend(
            pb.TopLogprob(id=token, text=piece, logprob=logprob) for (token, logprob), piece in zip(event.top_logprobs, pieces))
    return token


def _finish_proto(finish: Finish) -> pb.FinishDetails:
    return pb.FinishDetails(
        reason=FINISH_REASONS[finish.reason], prompt_tokens=finish.prompt_tokens, generated_tokens=finish.generated_tokens,
        time_to_first_token_ns=finish.time_to_first_token_ns, total_ns=finish.total_ns, stop_sequence=finish.stop_sequence,
        cached_prompt_tokens=finish.cached_prompt_tokens, reasoning_tokens=finish.reasoning_tokens,
        accepted_draft_tokens=finish.accepted_draft_tokens, rejected_draft_tokens=finish.rejected_draft_tokens,
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in finish.tool_calls],
    )


