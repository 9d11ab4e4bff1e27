"""The ONNX graph's I/O contract: names, symbolic axes and dtypes, defined once.

Imported by export/ (to name the graph) and by service/ (to drive it), so this module imports neither
torch nor onnxruntime. The names are the ones Optimum's causal-LM export and onnxruntime-genai use, so
other tools can drive a kvserve artifact:

    input_ids                   (batch_size, sequence_length)                         int64
    attention_mask              (batch_size, past_sequence_length + sequence_length)  int64, 0 = padding
    position_ids                (batch_size, sequence_length)                         int64
    past_key_values.{i}.key     (batch_size, num_heads, past_sequence_length, head_dim)   model dtype
    past_key_values.{i}.value   (batch_size, num_heads, past_sequence_length, head_dim)   model dtype
 -> logits                      (batch_size, sequence_length, vocab_size)             float32
    present.{i}.key             (batch_size, num_heads, past_sequence_length + sequence_length, head_dim)
    present.{i}.value           (batch_size, num_heads, past_sequence_length + sequence_length, head_dim)

One graph serves both phases: a prefill passes past_sequence_length = 0. num_heads in the K/V shapes is the
model's K/V head count (num_key_value_heads): fewer than its query heads for a grouped-query model.

That is the `concat` KV cache: present is a new tensor, past plus this step. kvserve exports it for tools
that drive the graph Optimum-style and verifies it by parity; the server does not serve it (its decode step
copies the whole cache).

The `slots` cache is what the server runs (and export's default): the cache is a pool of rows, one per
sequence, each left-aligned (the token at position p lives in column p) with its own length, and one step
runs one new token for every row plus a chunk of one row's prompt, in a single pass over the weights:

    input_ids                   (batch_size, 1)                                        int64, a token per row
    position_ids                (batch_size, 1)                                        int64, = its write column
    attention_mask              (batch_size, decode_width)                             int64, columns each row reads
    chunk_ids                   (1, chunk_length)                                      int64, may be 0 long
    chunk_position_ids          (1, chunk_length)                                      int64
    chunk_attention_mask        (1, chunk_width)                                       int64, columns the chunk reads
    chunk_slot                  (1,)                                                   int64, the chunk's row
    logits_index                (num_logits,)                                          int64, of the B + T tokens
    past_key_values.{i}.key     (batch_size, num_heads, cache_capacity, head_dim)      K/V dtype (KV_DTYPES)
    past_key_values.{i}.value   (batch_size, num_heads, cache_capacity, head_dim)      K/V dtype (KV_DTYPES)
 -> logits                      (num_logits, vocab_size)                               float32
    greedy_tokens               (num_logits,)                                          int64, argmax of each logits row
    present.{i}.key / .value    (batch_size, num_heads, cache_capacity, head_dim)      past with this step written

A row with nothing to decode runs a scratch token at the last column of the context its pool serves (n_ctx for a whole
context; a column never read). A CPU pool's rows may be wider, padded to whole pages (runtime/pool.py): cache_capacity
is then more than n_ctx + 1, and the columns past the context are never written or read.

A sliding-window layer's rows are rings in a standard slots graph of a model that has one (config.DecoderConfig.kv_ring:
R = the window and RING_SLACK positions, when that is shorter than the context; the manifest's "kv_ring"): that layer's
K/V are (batch_size, num_heads, R + 1, head_dim), fixed, position p in column p mod R. Its scratch tokens run at the
model's context length, n_ctx (written in the ring's column R, and in a whole-context layer's last column however wide
its pool), so one scratch position serves every layer; the graph names it in its metadata (SCRATCH_POSITION), as a
server may cut the context it serves.

Only the tokens named by logits_index reach the LM head and the host: in serving, one per row that samples.
greedy_tokens is each of those rows' argmax (the first on a tie, as numpy's), computed where the step runs: a
step whose rows all choose greedily reads back K tokens instead of K x vocab_size logits (on a GPU, 128 bytes
instead of 3.2 MB for 16 gpt2 rows).

A `slots` graph's attention is `standard` (the ops above) or `fused` (GPT-2 and the Llama family, head_dim a
multiple of 16: ONNX Runtime's com.microsoft.GroupQueryAttention does the cache write and the attention, and
the Llama family's rotation, model/fused_attention.py). The operator reads each row's columns up to its last position and writes only the
rows it is given, so the graph has no masks and no chunk_slot: B rows take S new tokens each (decode rows,
S = 1, or a lone prompt chunk as the one row), and a chunk of T >= 0 tokens goes into a row of its own,
bound to that row of the same pool. Each layer's attention is an If on T: one operator without a chunk,
two with one (the rows', the chunk's), so a decode step runs one operator a layer. The operator needs at
least one row and one token in it:

    input_ids, position_ids     (batch_size, sequence_length)                          int64, consecutive positions;
                                                                                       the last = the row's last column
    chunk_ids                   (1, chunk_length)                                      int64, may be 0 long
    chunk_position_ids          (1, chunk_length)                                      int64
    logits_index                (num_logits,)                                          int64, of the B S row tokens
                                                                                       (row by row), then the chunk's
    past_key_values.{i}.*       (batch_size, num_heads, cache_capacity, head_dim)      the rows
    chunk_key_values.{i}.*      (1, num_heads, cache_capacity, head_dim)               the chunk's row
 -> logits, present.{i}.*       as above
    greedy_tokens               as above
    chunk_present.{i}.*         (1, num_heads, cache_capacity, head_dim)               the chunk's row, written
                                                                                       (passed through when T = 0)

A longrope model (Phi-3, Phi-4-mini: DecoderConfig.long_rope_after) turns a sequence by one of two sets of factors,
the long one once the sequence is longer than the original context, and which set a row's tokens take is the
server's to say (a prompt chunk cannot tell how long its prompt is). Its slots graphs, both attentions, take two
more inputs, after the K/V:

    long_rope                   (batch_size,)                                          int64, 1: the row turns long
    chunk_long_rope             (1,)                                                   int64, 1: the chunk turns long

Its concat graph takes none: like transformers, each row turns long when its last position is past the original
context, and a tool driving a Phi-3 graph that crosses it mid-sequence recomputes the row's cache (transformers' Phi-3
does; its other models do not).
"""

from __future__ import annotations

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
GREEDY_TOKENS = "greedy_tokens"

BATCH = "batch_size"
SEQUENCE = "sequence_length"
PAST = "past_sequence_length"
TOTAL = "past_sequence_length + sequence_length"
CAPACITY = "cache_capacity"

DECODE_WIDTH = "decode_width"
CHUNK = "chunk_length"
NUM_LOGITS = "num_logits"
CHUNK_IDS = "chunk_ids"
CHUNK_POSITION_IDS = "chunk_position_ids"
CHUNK_ATTENTION_MASK = "chunk_attention_mask"
CHUNK_WIDTH = "chunk_width"
CHUNK_SLOT = "chunk_slot"
LOGITS_INDEX = "logits_index"
LONG_ROPE = "long_rope"
CHUNK_LONG_ROPE = "chunk_long_rope"

# A ring graph's metadata key (ModelProto.metadata_props): the position its scratch tokens run at (the module docstring)
SCRATCH_POSITION = "kvserve.scratch_position"
# A decode graph's metadata key (export/decode_graph.py): its operators' total length stops at its rotary tables' rows,
# so it runs on a CPU pool wider than n_ctx + 1 columns (runtime/pool.py pads rows to whole pages); a decode graph
# exported before it was written does not, and its runtime keeps the pool unpadded.
DECODE_TOTAL_WITHIN_TABLES = "kvserve.decode_total_within_tables"

CONCAT, SLOTS = "concat", "slots"
STANDARD, FUSED = "standard", "fused"
ATTENTIONS = (STANDARD, FUSED)
KV_CACHES = (SLOTS, CONCAT)
DEFAULT_KV_CACHE = SLOTS  # what `kvserve export` writes unless told otherwise: the layout the server serves

DTYPES = ("float32", "float16")
# What a slots graph's K/V pool holds (manifest "kv_dtype"; the model's dtype unless export was told otherwise): float16
# halves a float32 model's cache, int8 quarters it (a scale per layer, K/V head and channel, calibrated at export and
# kept in the artifact: artifact.KV_SCALES_FILE). model/kv_storage.py defines the rounding; tolerances.py its bounds.
KV_DTYPES = ("float32", "float16", "int8")
# Weight quantizations an artifact may carry (manifest "quantization"): the graph's I/O is unchanged, its
# weight matrices are 8- or 4-bit. export/quantize.py makes them; tolerances.py says how close they must stay.
QUANTIZATIONS = ("int8", "int4")


# Bits of an int4 export's attention projections (Q/K/V and W_O; the manifest's quantization.attention_bits): 8 by default,
# which held parity where 4 did not on the small models (docs/parity.md, "Int4"); 4 reads 18% fewer bytes a step at the
# Qwen3-4B shape, every matrix in 4 bits as llama.cpp's Q4_0 has them (docs/models.md).
ATTENTION_BITS = (8, 4)


def attention_bits_refusal(scheme: str | None, bits: int | None) -> str | None:
    """Why `--attention-bits bits` cannot go with `--quantize scheme`, or None when it can (or none is given)."""
    if bits is None:
        return None
    if scheme != "int4":
        return f"--attention-bits {bits}: attention's bits are chosen in an int4 export (--quantize int4); int8 keeps 8"
    return None if bits in ATTENTION_BITS else f"--attention-bits {bits}: choose one of {', '.join(map(str, ATTENTION_BITS))}"


def quantize_block_refusal(scheme: str | None, block_size: int | None) -> str | None:
    """Why `--quantize-block block_size` cannot go with `--quantize scheme`, or None when it can (or none is given)."""
    if block_size is None:
        return None
    if scheme is None or block_size < 16 or block_size & (block_size - 1):
        return f"--quantize-block {block_size}: give a power of 2 from 16, with --quantize {' or '.join(QUANTIZATIONS)}"
    return None


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"present.{layer}.key", f"present.{layer}.value"


def chunk_past_names(layer: int) -> tuple[str, str]:
    return f"chunk_key_values.{layer}.key", f"chunk_key_values.{layer}.value"


def chunk_present_names(layer: int) -> tuple[str, str]:
    return f"chunk_present.{layer}.key", f"chunk_present.{layer}.value"


def input_names(n_layer: int, kv_cache: str = CONCAT, attention: str = STANDARD, long_rope: bool = False) -> list[str]:
    """long_rope: the model is a longrope one (its slots graphs take the rows' and the chunk's choice of factors)."""
    rope = [LONG_ROPE, CHUNK_LONG_ROPE] if long_rope and kv_cache == SLOTS else []
    if attention == FUSED:
        step = [INPUT_IDS, POSITION_IDS, CHUNK_IDS, CHUNK_POSITION_IDS, LOGITS_INDEX]
        return step + [n for i in range(n_layer) for n in past_names(i)] + [n for i in range(n_layer) for n in chunk_past_names(i)] + rope
    if kv_cache == SLOTS:
        step = [INPUT_IDS, POSITION_IDS, ATTENTION_MASK, CHUNK_IDS, CHUNK_POSITION_IDS, CHUNK_ATTENTION_MASK, CHUNK_SLOT, LOGITS_INDEX]
    else:
        step = [INPUT_IDS, ATTENTION_MASK, POSITION_IDS]
    return step + [n for i in range(n_layer) for n in past_names(i)] + rope


def output_names(n_layer: int, kv_cache: str = CONCAT, attention: str = STANDARD) -> list[str]:
    step = [LOGITS, GREEDY_TOKENS] if kv_cache == SLOTS else [LOGITS]
    chunk = [n for i in range(n_layer) for n in chunk_present_names(i)] if attention == FUSED else []
    return step + [n for i in range(n_layer) for n in present_names(i)] + chunk


def kv_dtype_refusal(kv_dtype: str | None, dtype: str, kv_cache: str) -> str | None:
    """Why `--kv-dtype kv_dtype` cannot go with the rest of an export, or None when it can (or none is given)."""
    if kv_dtype is None or kv_dtype == dtype:
        return None
    if kv_dtype not in KV_DTYPES:
        return f"--kv-dtype {kv_dtype}: choose one of {', '.join(KV_DTYPES)}"
    if kv_cache != SLOTS:
        return f"--kv-dtype {kv_dtype}: a concat graph keeps K/V in the model's dtype (its tools feed them back); export the slots cache"
    if dtype != "float32" and kv_dtype == "float32":
        return f"--kv-dtype float32: a {dtype} graph computes its K/V in {dtype}; drop --kv-dtype"
    if dtype != "float32":
        return f"--kv-dtype {kv_dtype} rounds a float32 model's K/V; with --dtype {dtype} they are {dtype} already"
    return None


def io_spec(n_layer: int, n_kv_head: int, d_head: int, vocab_size: int, dtype: str, kv_cache: str = CONCAT,
            attention: str = STANDARD, kv_dtype: str | None = None, long_rope: bool = False,
            rings: dict[int, int] | None = None) -> dict[str, dict]:
    """Every graph input and output: {name: {"shape": [...], "dtype": ...}}; strings are symbolic axes. K/V are
    kv_dtype (a slots graph's; the model's dtype when None); long_rope: a longrope model's (see the module docstring);
    rings: {layer: columns} of a standard slots graph's ring layers (their rows that many columns wide, fixed)."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    kv_dtype = kv_dtype or dtype
    if (refusal := kv_dtype_refusal(kv_dtype, dtype, kv_cache)) is not None:
        raise ValueError(refusal)
    if kv_cache not in KV_CACHES:
        raise ValueError(f"unsupported KV cache {kv_cache!r}; choose one of {', '.join(KV_CACHES)}")
    if attention not in ATTENTIONS or (attention == FUSED and kv_cache != SLOTS):
        raise ValueError(f"unsupported attention {attention!r} for the {kv_cache} KV cache")
    if kv_cache == SLOTS:
        if rings and attention != STANDARD:
            raise ValueError("ring rows are a standard slots graph's")
        spec = _slots_spec(n_layer, n_kv_head, d_head, vocab_size, kv_dtype, attention)
        for layer, columns in (rings or {}).items():
            for name in past_names(layer) + present_names(layer):
                side = spec["inputs"] if name in spec["inputs"] else spec["outputs"]
                side[name]["shape"] = [BATCH, n_kv_head, columns, d_head]
        if long_rope:
            spec["inputs"][LONG_ROPE] = {"shape": [BATCH], "dtype": "int64"}
            spec["inputs"][CHUNK_LONG_ROPE] = {"shape": [1], "dtype": "int64"}
        return spec
    inputs = {
        INPUT_IDS: {"shape": [BATCH, SEQUENCE], "dtype": "int64"},
        ATTENTION_MASK: {"shape": [BATCH, TOTAL], "dtype": "int64"},
        POSITION_IDS: {"shape": [BATCH, SEQUENCE], "dtype": "int64"},
    }
    outputs = {LOGITS: {"shape": [BATCH, SEQUENCE, vocab_size], "dtype": "float32"}}
    for layer in range(n_layer):
        for name in past_names(layer):
            inputs[name] = {"shape": [BATCH, n_kv_head, PAST, d_head], "dtype": dtype}
        for name in present_names(layer):
            outputs[name] = {"shape": [BATCH, n_kv_head, TOTAL, d_head], "dtype": dtype}
    return {"inputs": inputs, "outputs": outputs}


def _slots_spec(n_layer: int, n_kv_head: int, d_head: int, vocab_size: int, kv_dtype: str, attention: str) -> dict[str, dict]:
    inputs = {
        INPUT_IDS: {"shape": [BATCH, 1], "dtype": "int64"},
        POSITION_IDS: {"shape": [BATCH, 1], "dtype": "int64"},
        ATTENTION_MASK: {"shape": [BATCH, DECODE_WIDTH], "dtype": "int64"},
        CHUNK_IDS: {"shape": [1, CHUNK], "dtype": "int64"},
        CHUNK_POSITION_IDS: {"shape": [1, CHUNK], "dtype": "int64"},
        CHUNK_ATTENTION_MASK: {"shape": [1, CHUNK_WIDTH], "dtype": "int64"},
        CHUNK_SLOT: {"shape": [1], "dtype": "int64"},
        LOGITS_INDEX: {"shape": [NUM_LOGITS], "dtype": "int64"},
    }
    outputs = {LOGITS: {"shape": [NUM_LOGITS, vocab_size], "dtype": "float32"}, GREEDY_TOKENS: {"shape": [NUM_LOGITS], "dtype": "int64"}}
    kv = {"shape": [BATCH, n_kv_head, CAPACITY, d_head], "dtype": kv_dtype}
    for layer in range(n_layer):
        inputs.update({name: dict(kv) for name in past_names(layer)})
        outputs.update({name: dict(kv) for name in present_names(layer)})
    if attention == FUSED:
        for name in (ATTENTION_MASK, CHUNK_ATTENTION_MASK, CHUNK_SLOT):
            del inputs[name]
        for name in (INPUT_IDS, POSITION_IDS):
            inputs[name]["shape"] = [BATCH, SEQUENCE]  # S new tokens a row
        row = {"shape": [1, n_kv_head, CAPACITY, d_head], "dtype": kv_dtype}
        for layer in range(n_layer):
            inputs.update({name: dict(row) for name in chunk_past_names(layer)})
            outputs.update({name: dict(row) for name in chunk_present_names(layer)})
    return {"inputs": inputs, "outputs": outputs}
