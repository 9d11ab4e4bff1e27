"""Generate over a real gRPC channel: streaming, batching equivalence, sampling seeds, stop rules, errors."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from kvserve.model.generate import generate
from kvserve.service.core.validation import INLINE_CHARACTERS
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from ...conftest import PROVIDER, PROVIDER_NAMES
from ..conftest import collect

PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(length)] for i, length in enumerate((1, 3, 5, 9, 14, 20, 31, 47))]


def greedy(ids, n, **extra):
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=n, ignore_eos=True, **extra)


def test_a_stream_yields_every_token_and_finishes_with_details(stub):
    responses = list(stub.Generate(greedy([72, 105], 12), timeout=30))
    assert len(responses) == 12
    assert all(r.HasField("token") for r in responses)
    assert not any(r.HasField("finish") for r in responses[:-1])
    finish = responses[-1].finish
    assert finish.reason == pb.FINISH_REASON_LENGTH
    assert (finish.prompt_tokens, finish.generated_tokens) == (2, 12)
    assert 0 < finish.time_to_first_token_ns <= finish.total_ns


def test_the_fixture_model_generates_text_that_depends_on_the_prompt(tiny_model):
    # Otherwise "same tokens", "stop at token k" and "text before the stop" hold whatever the code does.
    continuations = [generate(tiny_model, [p], 24).tokens[0].tolist() for p in PROMPTS]
    assert len({tuple(c) for c in continuations}) == len(PROMPTS)
    assert all(len(set(c)) >= 5 for c in continuations)


def logprobs_of(stub, prompt, steps):
    return [(r.token.id, r.token.logprob) for r in stub.Generate(greedy(prompt, steps, return_logprobs=True), timeout=60)]


def assert_eager(got, tiny_model, prompt, steps):
    """got: [(token, logprob)]: the eager model's greedy tokens, and its log-probabilities within 1e-4."""
    eager = generate(tiny_model, [prompt], steps)
    assert [t for t, _ in got] == eager.tokens[0].tolist()[: len(got)]
    expected = torch.log_softmax(eager.step_logits[: len(got), 0].double(), dim=-1)
    assert max(abs(lp - expected[k, t].item()) for k, (t, lp) in enumerate(got)) <= 1e-4


def test_concurrent_greedy_streams_equal_each_request_alone_and_the_eager_reference(stub, tiny_model):
    steps = 24
    alone = [logprobs_of(stub, p, steps) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: logprobs_of(stub, p, steps), PROMPTS))
    assert [[t for t, _ in g] for g in together] == [[t for t, _ in g] for g in alone]
    for prompt, got in zip(PROMPTS, together):
        assert_eager(got, tiny_model, prompt, steps)


def test_a_seed_gives_the_same_sampled_tokens_whatever_else_runs(stub):
    def sampled(seed, prompt=(10, 20, 30)):
        sampling = pb.SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed)
        return collect(stub, greedy(list(prompt), 20, sampling=sampling))[0]

    alone = {seed: sampled(seed) for seed in (1234, 99)}
    with ThreadPoolExecutor(7) as pool:
        busy = [pool.submit(sampled, 7 + k, p) for k, p in enumerate(PROMPTS[:5])]  # they draw random numbers too
        together = {seed: pool.submit(sampled, seed) for seed in (1234, 99)}
        together = {seed: f.result() for seed, f in together.items()}
        [b.result() for b in busy]
    assert together == alone
    assert alone[1234] != alone[99]


def test_text_prompt_and_text_deltas(stub):
    ids, text, finish = collect(stub, pb.GenerateRequest(text="héllo", max_new_tokens=16, ignore_eos=True))
    assert finish.prompt_tokens == len("héllo".encode())
    assert text == bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_stop_token_ids_end_the_sequence_at_the_first_one_generated(stub, tiny_model):
    reference = generate(tiny_model, [[5, 6, 7]], 20).tokens[0].tolist()
    stop_at = next(t for k, t in enumerate(reference) if k >= 3 and t not in reference[:k])  # first seen late
    ids, _, finish = collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), max_new_tokens=20, stop_token_ids=[stop_at], ignore_eos=True))
    assert ids == reference[: reference.index(stop_at) + 1] and len(ids) >= 4
    assert finish.reason == pb.FINISH_REASON_END_OF_SEQUENCE


def test_the_models_eos_ends_a_normal_request_at_that_token(stub, tiny_model):
    prompt = list(b"kvserve")
    reference = generate(tiny_model, [prompt], 40).tokens[0].tolist()
    eos = tiny_model.config.eos_token_id
    assert eos in reference[1:]  # the fixture's greedy continuation of this prompt reaches EOS
    ids, text, finish = collect(stub, pb.GenerateRequest(text="kvserve", max_new_tokens=40))
    assert ids == reference[: reference.index(eos) + 1] and ids[-1] == eos
    assert finish.reason == pb.FINISH_REASON_END_OF_SEQUENCE and finish.generated_tokens == len(ids)
    ids, _, finish = collect(stub, pb.GenerateRequest(text="kvserve", max_new_tokens=40, ignore_eos=True))
    assert len(ids) == 40 and finish.reason == pb.FINISH_REASON_LENGTH


def test_stop_sequences_end_the_stream_without_sending_the_stop_text(stub):
    ids, text, _ = collect(stub, greedy([33, 34, 35], 40))
    full = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    stop = full[10:13]
    ids2, text2, finish = collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[33, 34, 35]), max_new_tokens=40, stop_sequences=[stop], ignore_eos=True))
    assert finish.reason == pb.FINISH_REASON_STOP_SEQUENCE and finish.stop_sequence == stop
    assert text2 == full[: full.index(stop)]
    assert stop not in text2
    # A second stop that begins with the character before the first holds it back, so the text that precedes
    # the match arrives in the same push as the match itself: it must still be sent.
    held = full[full.index(stop) - 1] + "\x00"
    _, text3, finish = collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[33, 34, 35]), max_new_tokens=40, stop_sequences=[stop, held], ignore_eos=True))
    assert finish.stop_sequence == stop and text3 == full[: full.index(stop)] and len(text3) >= 1


def test_logprobs_are_the_reference_log_softmax(stub, tiny_model):
    responses = list(stub.Generate(greedy([1, 2, 3], 4, return_logprobs=True), timeout=30))
    step_logits = generate(tiny_model, [[1, 2, 3]], 4).step_logits[:, 0]  # (N, V)
    expected = torch.log_softmax(step_logits.double(), dim=-1)
    for step, response in enumerate(responses):
        assert response.token.HasField("logprob")
        assert response.token.logprob == pytest.approx(expected[step, response.token.id].item(), abs=1e-4)
    plain = next(iter(stub.Generate(greedy([1, 2, 3], 1), timeout=30)))
    assert not plain.token.HasField("logprob")


@pytest.mark.parametrize(
    "request_kwargs, field",
    [
        (dict(text=""), "prompt.text"),
        (dict(), "prompt.text"),
        (dict(token_ids=pb.TokenIds(ids=[1, 5000])), "prompt.token_ids: token id 5000 is outside the vocabulary"),
        (dict(token_ids=pb.TokenIds(ids=[1] * 256)), "prompt.token_ids: the prompt has 256 tokens"),
        (dict(token_ids=pb.TokenIds(ids=[1] * 200), max_new_tokens=57), "max_new_tokens: 57 new tokens do not fit"),
        (dict(text="a", sampling=pb.SamplingParams(temperature=-0.5)), "sampling.temperature"),
        (dict(text="a", sampling=pb.SamplingParams(top_p=1.5)), "sampling.top_p"),
        (dict(text="a", sampling=pb.SamplingParams(top_p=-0.1)), "sampling.top_p"),
        (dict(text="a", sampling=pb.SamplingParams(top_k=-1)), "sampling.top_k"),
        (dict(text="a", sampling=pb.SamplingParams(repetition_penalty=-2)), "sampling.repetition_penalty"),
        (dict(text="a", sampling=pb.SamplingParams(repetition_penalty=1e-45, temperature=1)), "sampling.repetition_penalty: must be in [1e-06, 1e+06], got"),
        (dict(text="a", sampling=pb.SamplingParams(temperature=1e-45)), "sampling.temperature: must be 0 (greedy) or in [1e-06, 1e+06]"),
        (dict(text="a", stop_token_ids=[999]), "stop_token_ids"),
        (dict(text="a", stop_sequences=["ab"] * 300_000), "stop_sequences: 300000 stop sequences; at most 16"),
        (dict(text="a", stop_sequences=["x" * 257]), "stop_sequences: a stop sequence of 257 characters; at most 256"),
        (dict(text="é" * 131_073), "prompt.text: 262146 bytes of text; at most 262144"),
    ],
    ids=["empty text", "no prompt", "id out of vocab", "prompt too long", "too many new tokens", "temperature < 0",
         "top_p > 1", "top_p < 0", "top_k < 0", "penalty < 0", "penalty 1e-45", "temperature 1e-45", "stop id out of vocab",
         "300,000 stops", "a stop too long", "text too long"],
)
def test_bad_requests_are_invalid_argument_naming_the_field(stub, request_kwargs, field):
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(pb.GenerateRequest(**request_kwargs), timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details()


def test_max_new_tokens_zero_fills_the_context(stub):
    ids, _, finish = collect(stub, greedy([1] * 250, 0))
    assert len(ids) == 6 and finish.reason == pb.FINISH_REASON_LENGTH


def test_tokenize_refuses_text_over_the_limit_and_runs_off_the_event_loop_as_a_long_generation_does(stub, server, monkeypatch):
    with pytest.raises(grpc.RpcError) as error:
        stub.Tokenize(pb.TokenizeRequest(text="x" * 262_145), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text: 262145 bytes of text; at most 262144" in error.value.details()
    import threading

    threads = set()
    tokenizer = server.app.engine.tokenizer
    real = tokenizer.encode

    def encode(text, **options):
        threads.add(threading.current_thread())
        return real(text, **options)

    monkeypatch.setattr(tokenizer, "encode", encode)
    stub.Tokenize(pb.TokenizeRequest(text="abc"), timeout=10)
    with pytest.raises(grpc.RpcError):  # more than the loop tokenizes itself (validates_inline), and than this context holds
        collect(stub, pb.GenerateRequest(text="a" * (INLINE_CHARACTERS + 1), max_new_tokens=2))
    assert threads and server.thread not in threads  # never the thread the event loop runs on
    collect(stub, pb.GenerateRequest(text="abc", max_new_tokens=2))
    assert server.thread in threads  # a generation's short text costs less there than a thread's round trip (validates_inline)


def test_tokenize_and_model_info(stub, server, tiny_model):
    tokens = stub.Tokenize(pb.TokenizeRequest(text="hé"))
    assert list(tokens.ids) == list("hé".encode()) and tokens.pieces[0] == "h"
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    config = tiny_model.config
    assert (info.config.vocab_size, info.config.context_length, info.config.num_layers, info.config.num_heads) == (
        config.vocab_size, config.n_ctx, config.n_layer, config.n_head)
    assert info.execution_provider == PROVIDER_NAMES[PROVIDER]
    assert info.parity_gate.passed and "identical" in info.parity_gate.summary
    assert info.limits.max_batch_size == 8 and info.tokenizer == "bytes"
    assert info.limits.step_token_budget == 32 and info.kv_cache == "slots"
    limits = info.limits
    assert (limits.max_stop_sequences, limits.max_stop_length, limits.max_text_bytes, limits.max_message_bytes) == (16, 256, 262144, 4194304)
    assert len(info.manifest_sha256) == 64 and info.dtype == "float32"


def test_a_large_repetition_penalty_at_the_server_forbids_repeats(stub, tiny_model):
    prompt, steps, penalty = [40, 41, 42], 16, 1e6
    plain = generate(tiny_model, [prompt], steps).tokens[0].tolist()
    assert len(set(prompt + plain)) < len(prompt) + steps  # without the penalty this continuation repeats
    expected = list(prompt)  # the penalty's definition, applied to the eager model's logits step by step
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.tensor([expected])
            logits = tiny_model(ids, torch.ones_like(ids), torch.arange(len(expected))[None], tiny_model.empty_cache(1))[0][0, -1]
            seen = torch.tensor(sorted(set(expected)))
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
            expected.append(int(logits.argmax()))
    request = greedy(prompt, steps, sampling=pb.SamplingParams(repetition_penalty=penalty))
    ids = collect(stub, request)[0]
    assert ids == expected[len(prompt):]
    assert len(set(prompt + ids)) == len(prompt) + steps


def test_kv_bytes_of_several_live_streams_are_the_sum_per_sequence(stub, server, tiny_model):
    config = tiny_model.config
    streams = [stub.Generate(greedy(p, 200), timeout=60) for p in PROMPTS[:3]]
    for stream in streams:
        next(stream)
    live = stub.GetModelInfo(pb.GetModelInfoRequest()).live
    token = 2 * config.n_layer * config.n_head * config.d_head * 4  # K and V of one token, every layer, float32
    assert live.active_sequences == len(live.sequences) == 3
    capacity = server.app.engine.batch.pool.capacity
    for s in live.sequences:  # the CPU pool commits memory as written: a sequence holds its written tokens' K/V;
        held = s.kv_cache_bytes // token  # under CUDA the pool is allocated whole: its row, every column
        assert s.kv_cache_bytes % token == 0 and (s.tokens - 1 <= held <= s.tokens if PROVIDER == "cpu" else held == capacity), (s.tokens, held)
    assert live.kv_cache_bytes == sum(s.kv_cache_bytes for s in live.sequences) > 0
    for stream in streams:
        stream.cancel()


def test_kv_bytes_are_reported_per_active_sequence(stub, server, tiny_model):
    config = tiny_model.config
    stream = stub.Generate(greedy([1, 2, 3, 4], 200), timeout=60)
    next(stream)
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.live.active_sequences == 1 and info.live.kv_slots_in_use == 1
    bytes_per_token = 2 * config.n_layer * config.n_head * config.d_head * 4
    (seq,) = info.live.sequences
    assert info.live.kv_cache_bytes == seq.kv_cache_bytes
    assert seq.kv_cache_bytes % bytes_per_token == 0 and seq.kv_cache_bytes >= 4 * bytes_per_token
    stream.cancel()


def test_one_failing_request_is_internal_while_the_others_finish(stub, server, monkeypatch):
    from kvserve.service.core import sequence as sequence_module

    real_choose = sequence_module.choose

    def choose_or_fail(logits, params, rng, *history):
        if params.seed == 666:
            raise RuntimeError("injected failure in this request's sampling")
        return real_choose(logits, params, rng, *history)

    monkeypatch.setattr(sequence_module, "choose", choose_or_fail)
    with ThreadPoolExecutor(5) as pool:
        healthy = [pool.submit(collect, stub, greedy(p, 30)) for p in PROMPTS[:4]]
        doomed = pool.submit(collect, stub, greedy([1, 2], 30, sampling=pb.SamplingParams(temperature=0.8, seed=666)))  # it samples: choose runs
        with pytest.raises(grpc.RpcError) as error:
            doomed.result()
        results = [h.result() for h in healthy]
    assert error.value.code() == grpc.StatusCode.INTERNAL and "injected failure" in error.value.details()
    assert all(len(ids) == 30 and finish.reason == pb.FINISH_REASON_LENGTH for ids, _, finish in results)


@pytest.fixture(scope="module")
def small_batch_stub(tiny_artifact):
    """A server of three rows and a small step budget: joins, leaves and chunks at every turn."""
    from ..conftest import serving, stub_of

    with serving(tiny_artifact, max_queue=64, max_batch_size=3, step_token_budget=6) as running, stub_of(running) as stub:
        yield stub


def test_batched_streams_equal_the_eager_reference_across_joins_leaves_cancels_and_chunks(small_batch_stub, tiny_model):
    # Seven streams through three rows: rows leave at different steps and waiting ones join; the 150-token
    # prompt is prefilled in chunks while others decode, then decodes far longer than the rest; one stream
    # is cancelled mid-way. Every token and its log-probability must be the eager model's for that prompt alone.
    lengths, steps = (2, 9, 150, 31, 5, 60, 12), (20, 45, 30, 25, 33, 40, 28)
    prompts = [[(13 * i + 7 * j) % 250 + 1 for j in range(n)] for i, n in enumerate(lengths)]

    def run(k):
        request = greedy(prompts[k], steps[k], return_logprobs=True)
        if k == 4:  # cancelled after 6 tokens
            stream, got = small_batch_stub.Generate(request, timeout=120), []
            for response in stream:
                got.append((response.token.id, response.token.logprob))
                if len(got) == 6:
                    stream.cancel()
                    break
            return got
        return [(r.token.id, r.token.logprob) for r in small_batch_stub.Generate(request, timeout=120)]

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(run, range(len(prompts))))
    for k, got in enumerate(together):
        eager = generate(tiny_model, [prompts[k]], steps[k])
        expected = eager.tokens[0].tolist()[: len(got)]
        assert [t for t, _ in got] == expected, k
        logprobs = torch.log_softmax(eager.step_logits[: len(got), 0].double(), dim=-1)
        for step, (token, logprob) in enumerate(got):
            assert logprob == pytest.approx(logprobs[step, token].item(), abs=1e-4)
    assert len(together[4]) == 6 and all(len(g) == n for k, (g, n) in enumerate(zip(together, steps)) if k != 4)


def test_a_float16_artifact_is_served_end_to_end(tiny_float16_artifact, tiny_model):
    from ..conftest import start_server

    running = start_server(tiny_float16_artifact)
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.dtype == "float16" and info.parity_gate.passed
            got = [(r.token.id, r.token.logprob) for r in stub.Generate(greedy(PROMPTS[3], 20, return_logprobs=True), timeout=60)]
    finally:
        running.stop()
    tokens = PROMPTS[3] + [t for t, _ in got]  # the float32 eager model, teacher-forced on what was served
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = tiny_model(ids, torch.ones_like(ids), torch.arange(len(tokens))[None], tiny_model.empty_cache(1))[0][0]
    expected = torch.log_softmax(logits.double(), dim=-1)[len(PROMPTS[3]) - 1 : -1]  # the distributions each token came from
    assert len(got) == 20
    assert max(abs(lp - expected[k, t].item()) for k, (t, lp) in enumerate(got)) <= 5e-2  # float16 noise on this model's small logits
    assert sum(t == int(expected[k].argmax()) for k, (t, _) in enumerate(got)) >= 19  # greedy, up to a near tie


def test_max_context_cuts_every_sequence_and_its_kv_row(tiny_artifact, tiny_model, monkeypatch):
    """serve --max-context 40: requests that would outgrow 40 tokens are refused by name, rows hold 40 columns (and
    the scratch one), and what fits is generated exactly as without the cut. Steps take 10 ms longer, so the stream
    whose row is counted is still running (at full speed it could finish its 30 tokens before the count)."""
    from ..conftest import slowed_server

    with slowed_server(tiny_artifact, monkeypatch, max_batch_size=2, max_context=40) as (running, stub, _channel):
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.limits.max_total_tokens == 40 and info.config.context_length == tiny_model.config.n_ctx
        with pytest.raises(grpc.RpcError) as error:
            collect(stub, greedy(list(range(1, 31)), 11))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in error.value.details()
        prompt = list(range(1, 31))
        ids, _, finish = collect(stub, greedy(prompt, 0))  # 0: as many as fit, now 10
        assert ids == generate(tiny_model, [prompt], 10).tokens[0].tolist()
        stream = stub.Generate(greedy([1, 2], 30), timeout=60)
        next(stream)
        (seq,) = stub.GetModelInfo(pb.GetModelInfoRequest()).live.sequences
        config = tiny_model.config
        assert running.app.engine.batch.pool.capacity == 41  # 40 columns a row and the scratch one
        token = 2 * config.n_layer * config.n_kv_head * config.head_dim * 4
        assert 0 < seq.kv_cache_bytes <= 40 * token if PROVIDER == "cpu" else seq.kv_cache_bytes == 41 * token  # CUDA: the whole row
        stream.cancel()


def test_a_request_arriving_while_a_stream_decodes_joins_at_once(tiny_artifact, tiny_model, monkeypatch):
    """While rows run, the step thread plans each next step itself (scheduler.py): a request submitted meanwhile must
    be taken at the next step, not when the running stream ends, and both streams stay exact. Steps take 10 ms
    longer, so the running stream is far from its end when the second request arrives."""
    from ..conftest import slowed_server

    with slowed_server(tiny_artifact, monkeypatch, max_batch_size=2) as (_, stub, _channel):
        running = stub.Generate(greedy([1, 2, 3], 120), timeout=60)
        first = [next(running).token.id for _ in range(5)]
        arrived = []  # the running stream's tokens received by the time each of the joiner's comes

        def join():
            got = []
            for response in stub.Generate(greedy([9, 8, 7, 6], 6), timeout=60):
                got.append(response.token.id)
                arrived.append(len(first))
            return got

        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(join)
            for response in running:
                first.append(response.token.id)
            joiner = joined.result()
    assert first == generate(tiny_model, [[1, 2, 3]], 120).tokens[0].tolist()
    assert joiner == generate(tiny_model, [[9, 8, 7, 6]], 6).tokens[0].tolist()
    assert arrived[-1] < 40, f"the joiner finished only after {arrived[-1]} of the running stream's 120 tokens"
