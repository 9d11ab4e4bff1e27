"""What the server allows, declared once: every limit a client meets and every knob of the batch is a field of
EngineLimits with its default, bounds and help. From those declarations come the `kvserve serve` flags and their
KVSERVE_* variables (kvserve/cli.py), GetModelInfo's limits (grpc_servicer.py), the HTTP and gRPC edges' checks
(both read the same EngineLimits), and the table in docs/serving.md ("Limits"), which tests/service/core/test_limits.py
holds to them. The fixed bounds on sampling parameters, which no flag changes, are declared here too.

Plain Python (no onnxruntime, no torch), so the command line reads its defaults from here without loading the runtime.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# Temperature (when not 0) and repetition penalty divide or multiply logits: outside these bounds a float32
# logit overflows to inf (a penalty of 1e-45 made every sampled token the same id) and sampling sees NaN.
MIN_SCALE, MAX_SCALE = 1e-6, 1e6
MAX_PENALTY = 2.0  # presence and frequency penalties, as OpenAI bounds them
MAX_BIAS = 100.0  # a logit bias's size, as OpenAI bounds it

# A call's metadata at most, counted as HTTP/2 counts a header list (name + value + 32 bytes an entry): larger is
# refused with RESOURCE_EXHAUSTED naming the size. gRPC's own limit (8 KiB) refuses with an empty message (its
# message lists the metadata, which no longer fits), so the transport's limit is raised far above ours.
MAX_METADATA_BYTES = 16 * 1024
TRANSPORT_METADATA_BYTES = 2**20

INT_MAX = 2**31 - 1  # a flag's upper bound where nothing smaller is meaningful (proto fields are uint32)


def declared(default, help: str, low: int | None = None, high: int | None = None):
    """A field of EngineLimits: its default, what it bounds (help), and the values a flag may set, [low, high]."""
    return field(default=default, metadata={"help": help, "low": low, "high": high})


@dataclass(frozen=True)
class EngineLimits:
    """Every serve-time limit, passed whole from the command line to the edges, the engine and the batch."""

    max_batch_size: int = declared(8, "sequences decoding at once: rows of the batch, each a whole context of K/V", 1, 4096)
    max_queue: int = declared(64, "requests waiting for a free row before RESOURCE_EXHAUSTED (HTTP 429); 0: none wait", 0, INT_MAX)
    # Smaller keeps the running streams' gaps even; larger gets a new prompt its first token sooner
    # (docs/benchmarks.md, "Chunked prefill").
    step_token_budget: int = declared(32, "tokens one step runs while streams decode: theirs (on the CPU; on CUDA none "
                                      "of them count), then a chunk of a new prompt, or where steps split new prompts "
                                      "prefilled together (rows x padded length); 0: no limit (a prompt is prefilled whole, "
                                      "alone)", 0, INT_MAX)
    # A prompt chunk beside decoding rows costs them a longer step: the chunk is cut to what keeps its step within this
    # share of a decode-only step, by the step times the server measures (service/core/drafts.py StepCosts).
    step_time_bound: int = declared(130, "percent of a decode-only step's time a step with a prompt chunk or drafts may take "
                                    "while streams decode (measured while serving; within --step-token-budget); 0: the "
                                    "budget alone", 0, 10_000)
    max_stop_sequences: int = declared(16, "stop sequences of one request", 1, INT_MAX)
    max_stop_length: int = declared(256, "characters of one stop sequence", 1, INT_MAX)
    max_text_bytes: int = declared(256 * 1024, "UTF-8 bytes of a prompt's text, a conversation's contents together (its tool "
                                   "calls and tool turns' ids included), or a Tokenize request's text", 1, INT_MAX)
    max_chat_messages: int = declared(256, "messages in one conversation", 1, INT_MAX)
    max_role_length: int = declared(64, "characters of a chat message's role", 1, 4096)
    max_chat_template_kwargs_bytes: int = declared(4096, "UTF-8 bytes of a conversation's chat_template_kwargs (as JSON)", 2, INT_MAX)
    max_tools: int = declared(128, "tools (functions) a chat request may offer", 1, 4096)
    max_tools_bytes: int = declared(64 * 1024, "UTF-8 bytes of a chat request's tools (as JSON)", 2, INT_MAX)
    max_response_format_bytes: int = declared(64 * 1024, "UTF-8 bytes of a response_format's schema, pattern or grammar", 1, INT_MAX)
    max_schema_depth: int = declared(32, "nested arrays and objects in a response_format's JSON schema", 1, 256)
    max_json_depth: int = declared(64, "nested arrays and objects in an HTTP request body (a response_format schema's included)",
                                   8, 512)
    max_message_bytes: int = declared(4 * 2**20, "bytes of one request message or HTTP body (gRPC: RESOURCE_EXHAUSTED; "
                                      "HTTP: 413)", 1, INT_MAX)
    # Every wait on a client is bounded, so a connection that stalls is closed, not held (docs/serving.md, "Limits").
    header_timeout_seconds: int = declared(10, "seconds a new connection has to send its request's headers (HTTP) or "
                                           "finish its handshake (gRPC)", 1, 3600)
    body_timeout_seconds: int = declared(30, "seconds an HTTP request has to send its whole body once its headers are in", 1, 3600)
    idle_timeout_seconds: int = declared(60, "seconds a connection with no request in flight stays open", 1, 86400)
    max_connections: int = declared(512, "HTTP connections open at once (a new one past it closes the longest-idle or stalled "
                                    "one, or with none is answered 503); gRPC calls in flight at once (more are refused "
                                    "RESOURCE_EXHAUSTED)", 1, 1_000_000)
    max_connections_per_address: int = declared(512, "HTTP connections open at once from one client address, shed as "
                                                "--max-connections sheds; lower it where clients connect directly, not "
                                                "through one proxy", 1, 1_000_000)
    max_n: int = declared(8, "completions of one prompt a request (n): each a sequence with its own row", 1, 64)
    max_stored_responses: int = declared(1000, "responses kept in memory for previous_response_id, retrieve and delete "
                                         "(/v1/responses), least recently used dropped first; 0: none kept", 0, 1_000_000)
    thinking_token_budget: int = declared(0, "tokens a reasoning model's reply may think before it is made to answer, where its "
                                          "request sets no thinking_token_budget; 0: no bound", 0, INT_MAX)
    max_top_logprobs: int = declared(20, "alternatives reported with each token (top_logprobs; /v1/completions' logprobs)", 0, 1000)
    max_logit_bias: int = declared(300, "tokens one request may bias (logit_bias entries)", 0, 1_000_000)
    # Finished sequences' rows keep their K/V, and a prompt that begins like one of them prefills only the rest
    # (service/core/kv_rows.py); off: every prompt is prefilled from its first token.
    prompt_cache: bool = declared(True, "keep finished sequences' K/V: a prompt that begins like an earlier one prefills only the rest")
    # A decoding row may guess its next tokens and have one step check them (service/core/drafts.py): its grammar's forced
    # tokens, or what followed its last tokens earlier in its prompt and output.
    speculation: bool = declared(True, "check guessed next tokens (a grammar's forced tokens, prompt lookup) in one step "
                                 "where the measured step costs say it pays (auto); off: one token a row a step")
    # Finished outputs drafted from by later requests (service/core/drafts.py SuffixCache): memory, and a timing channel
    # between requests (docs/serving.md, "Speculation").
    draft_cache_tokens: int = declared(32768, "tokens of recent outputs (across requests) speculation drafts from; 0: only a "
                                       "request's own text", 0, 1 << 24)


@dataclass(frozen=True)
class Declaration:
    """One limit as the command line, the environment and the docs name it."""

    name: str  # the EngineLimits field (and the GetModelInfo Limits field)
    default: int | bool
    low: int | None
    high: int | None
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def variable(self) -> str:
        return "KVSERVE_" + self.name.upper()

    @property
    def is_switch(self) -> bool:
        return isinstance(self.default, bool)


def declarations() -> list[Declaration]:
    """Every limit EngineLimits declares, in its order."""
    return [Declaration(f.name, f.default, f.metadata["low"], f.metadata["high"], f.metadata["help"])
            for f in dataclasses.fields(EngineLimits)]


def limit_values(limits: EngineLimits) -> dict[str, int | bool]:
    """{name: value} for every declared limit (GetModelInfo reports them all)."""
    return {f.name: getattr(limits, f.name) for f in dataclasses.fields(EngineLimits)}


def out_of_bounds(limits: EngineLimits) -> str | None:
    """The first limit outside its declared bounds, as `--flag must be in [low, high], got value`; None when all hold."""
    for declaration in declarations():
        value = getattr(limits, declaration.name)
        low, high = declaration.low, declaration.high
        if not declaration.is_switch and ((low is not None and value < low) or (high is not None and value > high)):
            return f"{declaration.flag} must be in [{low}, {high}], got {value}"
    return None


def markdown_table() -> str:
    """The limits as docs/serving.md lists them ("Limits"): one row a declaration (tests/service/core/test_limits.py checks
    the docs hold exactly this)."""
    rows = ["| limit | flag | variable | default | bounds |", "|---|---|---|---:|---|"]
    for d in declarations():
        default = ("on" if d.default else "off") if d.is_switch else f"{d.default:,}"
        bounds = "on / off" if d.is_switch else f"[{d.low:,}, {d.high:,}]"
        rows.append(f"| {d.help} | `{d.flag}` | `{d.variable}` | {default} | {bounds} |")
    return "\n".join(rows)
