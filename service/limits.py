"""What the server allows: the engine's limits and the bounds on sampling parameters, defined once.

Plain Python (no onnxruntime, no torch), so the command line reads its defaults from here without loading
the runtime. Every limit is a `kvserve serve` flag and a KVSERVE_* variable (docs/serving.md, "The gRPC API").
"""

from __future__ import annotations

from dataclasses import dataclass

# Temperature (when not 0) and repetition penalty divide or multiply logits: outside these bounds a float32
# logit overflows to inf (a penalty of 1e-45 made every sampled token the same id) and sampling sees NaN.
MIN_SCALE, MAX_SCALE = 1e-6, 1e6

# A request message's size at most, in bytes (gRPC's own default).
DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20

# A call's metadata at most, counted as HTTP/2 counts a header list (name + value + 32 bytes an entry): larger is
# refused with RESOURCE_EXHAUSTED naming the size. gRPC's own limit (8 KiB) refuses with an empty message (its
# message lists the metadata, which no longer fits), so the transport's limit is raised far above ours.
MAX_METADATA_BYTES = 16 * 1024
TRANSPORT_METADATA_BYTES = 2**20


@dataclass(frozen=True)
class EngineLimits:
    max_batch_size: int = 8  # sequences decoding at once: rows of the batch
    max_queue: int = 64  # requests waiting for a row; 0: none wait
    # The most tokens one step runs while streams are decoding: every decoding row's token, then a prompt
    # chunk with the rest. Smaller keeps the running streams' gaps even; larger gets a new prompt its first
    # token sooner (docs/benchmarks.md, "Chunked prefill"). 0: no limit (a prompt is prefilled whole).
    step_token_budget: int = 32
    max_stop_sequences: int = 16  # per request
    max_stop_length: int = 256  # characters of one stop sequence
    max_text_bytes: int = 256 * 1024  # UTF-8 bytes of a prompt's or a Tokenize request's text (a conversation's contents together)
    max_chat_messages: int = 256  # messages in one conversation
    max_response_format_bytes: int = 64 * 1024  # UTF-8 bytes of a response_format's schema, pattern or grammar
    # Finished sequences' rows keep their K/V, and a prompt that begins like one of them prefills only the rest
    # (service/prompt_cache.py); off: every prompt is prefilled from its first token.
    prompt_cache: bool = True
