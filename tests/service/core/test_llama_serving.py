"""A Llama-family artifact llama_server over gRPC: concurrent streams equal transformers' generate, the model info
names the architecture and its K/V heads, the KV bytes count K/V heads, and any of several EOS ids stops."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from kvserve.contract.artifact import open_artifact
from kvserve.export.parity import artifact_greedy
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from ...conftest import FUSED_DTYPES, LLAMA_CONFIGS, PROVIDER
from ...hf_reference import hf_greedy
from ..conftest import collect, start_server

NAME = "llama gqa 4:1 head_dim 24 untied"  # standard attention (head_dim 24 cannot be fused)
# exported with fused attention, in float16 under CUDA; Qwen3's per-head norms run before the operator rotates; the
# window is the operator's local_window_size
FUSED = ["mistral gqa 2:1 head_dim 32 untied", "qwen3 gqa 2:1 head_dim 32 qk-norm yarn tied", "mistral sliding window 7 head_dim 16",
         "gemma2 gqa 2:1 head_dim 16 softcaps sliding 5", "gemma3 multi-query head_dim 32 qk-norm two bases linear-rope sliding 6",
         "phi3 multi-head head_dim 16 sliding 6 tied", "smollm3 gqa 2:1 head_dim 16 nope every 2nd sliding 5 tied"]
PROMPTS = [[(11 * i + 5 * j) % 290 + 3 for j in range(length)] for i, length in enumerate((1, 4, 7, 12, 19, 26, 40, 55))]
STEPS = 34


def serve(llama_artifact, name, **export):
    """transformers' model of LLAMA_CONFIGS[name], its artifact and a stub of the artifact's server. 4 rows for 8 streams
    and a budget of 8 tokens a step: streams wait, join, leave, and long prompts prefill in chunks."""
    hf, _, artifact = llama_artifact(name, **export)
    running = start_server(artifact, max_batch_size=4, max_queue=64, step_token_budget=8)
    with grpc.insecure_channel(running.target) as channel:
        yield hf, artifact, pb_grpc.GenerationServiceStub(channel)
    running.stop()


@pytest.fixture(scope="module")
def llama_server(llama_artifact):
    yield from serve(llama_artifact, NAME)


@pytest.fixture(scope="module", params=FUSED)
def llama_fused_server(llama_artifact, request):
    yield from serve(llama_artifact, request.param, dtype=FUSED_DTYPES[0], attention="fused")


def greedy(ids, n, **extra):
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=n, ignore_eos=True, **extra)


def test_eight_concurrent_streams_generate_what_transformers_generates(llama_server):
    hf, _, stub = llama_server
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: collect(stub, greedy(p, STEPS), timeout=120)[0], PROMPTS))
    np.testing.assert_array_equal(np.array(together), hf_greedy(hf, PROMPTS, STEPS))


def test_eight_concurrent_streams_through_fused_attention_generate_what_transformers_generates(llama_fused_server):
    """The same 8 streams through a GroupQueryAttention graph: decode-only steps (each If's one-operator branch),
    chunks beside decoding rows (the two-operator branch), a lone prompt's chunk as the step's one row."""
    hf, artifact, stub = llama_fused_server
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.attention == "fused"
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: collect(stub, greedy(p, STEPS), timeout=120)[0], PROMPTS))
    # float16 (under CUDA) is not held to eager's greedy tokens (contract/tolerances.py): there the reference is the
    # artifact's own rows, stepped together without joins, leaves or chunks
    expected = hf_greedy(hf, PROMPTS, STEPS) if info.dtype == "float32" else artifact_greedy(artifact, PROMPTS, STEPS, PROVIDER)
    np.testing.assert_array_equal(np.array(together), expected)


def test_a_prompt_cache_hit_longer_than_the_window_generates_what_transformers_generates(llama_fused_server):
    """Rows keep every column's K/V (windowed layers included), so a cached prefix reaching past the window is reused
    whole, and the continuation is the one a cold prompt gets."""
    hf, _, stub = llama_fused_server
    first = PROMPTS[4]  # 19 tokens: longer than the sliding window
    ids, _, finish = collect(stub, greedy(first, 12))
    longer = first + ids + [7, 8, 9]
    ids, _, finish = collect(stub, greedy(longer, 16))
    assert finish.cached_prompt_tokens >= len(first)
    if stub.GetModelInfo(pb.GetModelInfoRequest()).dtype == "float32":
        assert ids == hf_greedy(hf, [longer], 16)[0].tolist()


# standard attention, whose windowed layers' rows are rings (DecoderConfig.kv_ring): every layer (Mistral's), or beside
# whole-context ones (Gemma 3's)
RINGS = ["mistral sliding window 7 head_dim 16", "gemma3 multi-query head_dim 32 qk-norm two bases linear-rope sliding 6"]


@pytest.fixture(scope="module", params=RINGS)
def llama_ring_server(llama_artifact, request):
    yield from serve(llama_artifact, request.param, attention="standard")


def test_ring_rows_serve_what_transformers_generates_past_the_window(llama_ring_server):
    """8 streams in 4 rows, joining, leaving and prefilling in chunks of 8 beside decoding rows, each far past its ring;
    a row holds at most the ring of its windowed layers' K/V."""
    hf, artifact, stub = llama_ring_server
    ring = open_artifact(artifact).kv_ring
    assert ring is not None and 19 + STEPS > ring + 16
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: collect(stub, greedy(p, STEPS), timeout=120)[0], PROMPTS))
    np.testing.assert_array_equal(np.array(together), hf_greedy(hf, PROMPTS, STEPS))


def test_a_ring_row_holds_at_most_its_ring_of_each_windowed_layer(llama_ring_server):
    """A sequence far past its ring leaves a cached row whose bytes are its whole-context layers' K/V for every position it
    wrote and its windowed layers' for a ring (the CPU pool commits memory as rows write it; under CUDA a row is its
    whole width: the context and a scratch column, a ring and its scratch column)."""
    _, artifact, _ = llama_ring_server
    opened = open_artifact(artifact)
    config, ring = opened.config, opened.kv_ring
    running = start_server(artifact, max_batch_size=1)
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            collect(stub, greedy([5, 6, 7], 120))
            live = stub.GetModelInfo(pb.GetModelInfoRequest()).live
    finally:
        running.stop()
    column = 2 * config.n_kv_head * config.head_dim * 4  # K and V of one position of one layer, float32
    windowed, written = len(config.sliding_layers), 3 + 120 - 1  # the last token is never fed back
    assert live.cached_rows == 1 and written > ring
    if PROVIDER == "cpu":
        assert live.cached_kv_cache_bytes == column * ((config.n_layer - windowed) * written + windowed * ring)
    else:
        assert live.cached_kv_cache_bytes == column * ((config.n_layer - windowed) * (config.n_ctx + 1) + windowed * (ring + 1))


def test_ring_rows_reuse_a_cached_prefix_inside_and_past_the_window_and_refuse_one_their_ring_lost(llama_ring_server):
    """A prompt cache hit inside the ring; one past it that stops within 16 positions of the row's end (a conversation's
    next turn); a prefix of a row that wrote far past it is not taken (its ring no longer holds that prefix's window),
    and the prompt is computed cold: every continuation is transformers'."""
    hf, artifact, stub = llama_ring_server
    ring = open_artifact(artifact).kv_ring
    first = [(3 * j + 11) % 290 + 3 for j in range(ring - 6)]  # shorter than the ring
    ids, _, _ = collect(stub, greedy(first, 4))
    inside = first + [41, 42]
    ids, _, finish = collect(stub, greedy(inside, 8))
    assert finish.cached_prompt_tokens == len(first) and ids == hf_greedy(hf, [inside], 8)[0].tolist()
    second = [(5 * j + 7) % 290 + 3 for j in range(19)]
    ids, _, _ = collect(stub, greedy(second, 2 * ring))  # the row writes 19 + 2 R - 1 positions, wrapping its rings
    turn = second + ids + [7, 8, 9]
    more, _, finish = collect(stub, greedy(turn, 16))
    assert finish.cached_prompt_tokens >= len(second) + len(ids) - 1 and more == hf_greedy(hf, [turn], 16)[0].tolist()
    third = [(7 * j + 5) % 290 + 3 for j in range(20)]
    ids, _, _ = collect(stub, greedy(third, 2 * ring))
    apart = third + [9, 9, 9, 9]  # shares 20 positions (a whole block and more) with a row that wrote 19 + 2 R
    more, _, finish = collect(stub, greedy(apart, 8))
    assert finish.cached_prompt_tokens == 0 and more == hf_greedy(hf, [apart], 8)[0].tolist()


def test_ring_rows_under_a_cut_context_keep_their_scratch_tokens_out_of_the_rings(llama_ring_server):
    """--max-context narrows the pool; the graph's scratch position stays the exported context's (io_contract), so the
    scratch tokens of idle rows and of a prefilling row never land in a ring: streams joining beside rows that hold
    cached rings generate transformers' tokens."""
    hf, artifact, _ = llama_ring_server
    prompts = PROMPTS[3:7]
    running = start_server(artifact, max_batch_size=3, step_token_budget=8, max_context=90)
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            with ThreadPoolExecutor(len(prompts)) as pool:
                together = list(pool.map(lambda p: collect(stub, greedy(p, STEPS), timeout=120)[0], prompts))
            again = collect(stub, greedy(prompts[0], STEPS))[0]  # from the prompt cache, beside cached rows
    finally:
        running.stop()
    np.testing.assert_array_equal(np.array(together), hf_greedy(hf, prompts, STEPS))
    assert again == together[0]


def test_model_info_names_the_architecture_and_its_kv_heads(llama_server):
    hf, _, stub = llama_server
    _, config = LLAMA_CONFIGS[NAME]
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    got = info.config
    assert (got.architecture, got.model_type, got.num_heads, got.num_key_value_heads, got.head_dim) == ("llama", "llama", 8, 2, 24)
    assert (got.num_layers, got.d_model, got.context_length) == (config["num_hidden_layers"], config["hidden_size"], config["max_position_embeddings"])
    assert list(got.eos_token_ids) == [hf.config.eos_token_id] and got.eos_token_id == hf.config.eos_token_id
    assert info.parity_gate.passed and info.attention == "standard"
    stream = stub.Generate(greedy([5, 6, 7], 100), timeout=60)
    next(stream)
    (seq,) = stub.GetModelInfo(pb.GetModelInfoRequest()).live.sequences
    # a token's K and V of every layer's 2 K/V heads (not 8), float32, for each token written (the last is not yet)
    token = 2 * config["num_hidden_layers"] * 2 * 24 * 4
    held = seq.kv_cache_bytes // token  # under CUDA the pool is allocated whole: the row, every column
    assert seq.kv_cache_bytes % token == 0 and (seq.tokens - 1 <= held <= seq.tokens if PROVIDER == "cpu" else held == got.context_length + 1)  # and the scratch column
    stream.cancel()


def test_any_of_several_eos_ids_ends_the_stream(make_hf_llama, tmp_path_factory):
    """generation_config.json lists two EOS ids; the stream ends at whichever the model generates first."""
    from kvserve.export.pipeline import export_artifact
    from kvserve.model.checkpoint import load_checkpoint

    model_type, config = LLAMA_CONFIGS["qwen2 gqa 3:1 qkv-bias tied"]
    prompt = [9, 8, 7, 6]
    hf, _ = make_hf_llama(model_type, seed=3, **config)
    continuation = hf_greedy(hf, [prompt], 24)[0].tolist()
    stop_at = next(i for i in range(3, 24) if continuation[i] not in continuation[:i])  # a token first generated here
    never = next(t for t in range(399, 0, -1) if t not in continuation)
    eos_ids = [never, continuation[stop_at]]
    _, checkpoint = make_hf_llama(model_type, seed=3, generation={"eos_token_id": eos_ids}, **config)
    out = tmp_path_factory.mktemp("eos-list") / "artifact"
    export_artifact(load_checkpoint(checkpoint), {"kind": "checkpoint", "path": str(checkpoint)}, out, provider=PROVIDER)  # auto attention: what this provider serves
    running = start_server(out, max_batch_size=2)
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            ids, _, finish = collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=24))
            assert ids == continuation[: stop_at + 1] and finish.reason == pb.FINISH_REASON_END_OF_SEQUENCE
            ids, _, finish = collect(stub, greedy(prompt, 24))  # ignore_eos: every id passes
            assert ids == continuation and finish.reason == pb.FINISH_REASON_LENGTH
            assert list(stub.GetModelInfo(pb.GetModelInfoRequest()).config.eos_token_ids) == eos_ids
    finally:
        running.stop()


PHI3_LONGROPE = next(name for name in LLAMA_CONFIGS if name.startswith("phi3") and "longrope" in name)
LLAMA_LONGROPE = next(name for name in LLAMA_CONFIGS if name.startswith("llama") and "longrope" in name)


# float32 throughout, held to transformers token for token: under CUDA, whose fused kernel is float16 only, both models
# run the standard graph instead
LONGROPE = ([(PHI3_LONGROPE, "fused"), (PHI3_LONGROPE, "standard"), (LLAMA_LONGROPE, "fused")] if "float32" in FUSED_DTYPES
            else [(PHI3_LONGROPE, "standard"), (LLAMA_LONGROPE, "standard")])


@pytest.fixture(scope="module", params=LONGROPE, ids=[f"{name.split()[0]}-{attention}" for name, attention in LONGROPE])
def longrope_server(llama_artifact, request):
    name, attention = request.param
    yield from serve(llama_artifact, name, attention=attention)


def test_longrope_streams_past_the_original_context_generate_what_transformers_generates(longrope_server):
    """Phi-3's factors chosen per row: rows crossing the original context mid-stream (each prefilled again, long, in
    chunks beside the rows decoding), prompts past it from the start, rows that stay within; 4 rows for 6 streams."""
    hf, artifact, stub = longrope_server
    after = hf.config.rope_parameters["original_max_position_embeddings"]
    prompts = [[(7 * j + i) % 290 + 3 for j in range(length)] for i, length in enumerate((after - 9, after - 1, after, after + 7, 5, 30))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: collect(stub, greedy(p, 20), timeout=120)[0], prompts))
    np.testing.assert_array_equal(np.array(together), hf_greedy(hf, prompts, 20))


def test_a_longrope_prompt_never_reuses_the_other_factor_sets_cached_prefix(longrope_server):
    """A finished row's K/V are cached for later prompts that begin alike, but only for prompts that turn by the same
    factors: a long prompt starting with a short row's tokens, and a short prompt starting with a long row's, compute
    their prefixes (and still equal transformers); a long prompt sharing a long row's prefix reuses it."""
    hf, _, stub = longrope_server
    after = hf.config.rope_parameters["original_max_position_embeddings"]
    short = [(5 * j) % 290 + 7 for j in range(after - 24)]
    collect(stub, greedy(short, 4))  # cached: its row turned short
    longer = short + [(3 * j) % 290 + 11 for j in range(40)]  # past the original context: turned long
    ids, _, finish = collect(stub, greedy(longer, 8))
    assert finish.cached_prompt_tokens == 0 and ids == hf_greedy(hf, [longer], 8)[0].tolist()
    fresh = [(11 * j) % 290 + 5 for j in range(after + 10)]
    collect(stub, greedy(fresh, 4))  # cached: its row turned long
    within = fresh[: after - 20]  # only that long row holds this prefix
    ids, _, finish = collect(stub, greedy(within, 8))
    assert finish.cached_prompt_tokens == 0 and ids == hf_greedy(hf, [within], 8)[0].tolist()
    again = longer + [9, 9, 9]
    ids, _, finish = collect(stub, greedy(again, 8))
    assert finish.cached_prompt_tokens >= len(longer) - 16 and ids == hf_greedy(hf, [again], 8)[0].tolist()


def test_a_row_that_crossed_the_original_context_is_cached_as_the_kind_its_columns_hold(longrope_server):
    """Phi-3's crossing row was prefilled again, long: a long prompt that begins with its tokens reuses them, a short one
    nothing. Another model's crossing row kept its short columns and turned long after: a short prompt reuses up to the
    crossing, a long one nothing. Every continuation still equals transformers'."""
    hf, _, stub = longrope_server
    after = hf.config.rope_parameters["original_max_position_embeddings"]
    crossing = [(13 * j) % 290 + 4 for j in range(after - 4)]
    ids, _, _ = collect(stub, greedy(crossing, 12))  # crosses at its 5th token
    written = crossing + ids[:-1]  # what its row holds when it leaves (the last token is never fed)
    within, beyond = written[: after - 2], written + [7, 7, 7]
    reused = {}
    for prompt in (within, beyond):
        got, _, finish = collect(stub, greedy(prompt, 6))
        assert got == hf_greedy(hf, [prompt], 6)[0].tolist()
        reused[len(prompt) > after] = finish.cached_prompt_tokens
    if hf.config.model_type == "phi3":
        assert reused[False] == 0 and reused[True] >= len(written) - 16
    else:
        assert reused[False] >= after - 2 - 16 and reused[True] == 0
