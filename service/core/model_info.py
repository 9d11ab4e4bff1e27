"""What the server says about itself (GetModelInfo): the model, how it runs, its limits and its load, as the App
gathers them. The gRPC servicer turns it into protobuf; nothing here knows a transport."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.contract.config import DecoderConfig

from .limits import EngineLimits


@dataclass(frozen=True)
class GateResult:
    """The load gate's verdict on the artifact (process/gate.py): whether it replayed its golden tokens."""

    passed: bool
    summary: str
    overridden: bool = False  # failed, and served anyway (--allow-parity-failure)


@dataclass(frozen=True)
class SequenceKv:
    id: int
    tokens: int  # prompt + generated so far
    kv_bytes: int  # K/V its row holds


@dataclass(frozen=True)
class LiveCounts:
    active: int  # sequences holding a row
    queued: int  # requests waiting for one
    cached_rows: int  # free rows keeping a finished sequence's K/V (the prompt cache)
    kv_bytes: int  # K/V held by the active sequences
    sequences: list[SequenceKv]
    cached_kv_bytes: int = 0  # K/V held by the prompt cache's rows
    kv_budget_bytes: int = 0  # what both may take together (serve --kv-cache-memory); 0: no budget (CUDA)


@dataclass(frozen=True)
class ModelInfo:
    config: DecoderConfig  # the artifact's, its whole context
    max_total_tokens: int  # prompt + generated tokens a sequence may hold as served (--max-context)
    manifest_sha256: str
    dtype: str
    kv_dtype: str  # what the K/V pool holds (io_contract.KV_DTYPES)
    kv_cache: str
    attention: str
    provider: str  # the execution provider running the graph
    provider_note: str  # why CUDA or CUDA graphs are not used where they were asked for ("" when nothing to say)
    limits: EngineLimits
    live: LiveCounts
    gate: GateResult
    tokenizer: str
    chat: bool  # the model has a chat template
    tool_call_format: str = ""  # the format its template teaches for tool calls (tool_calls.CallFormat); "": tools refused
