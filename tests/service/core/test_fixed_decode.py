"""Decode steps at fixed shapes (SlotBatch.fixed_decode, DecoderRuntime.run_decode): what a CUDA graph captures.

Under CUDA graphs (`serve --cuda-graph`) a decode-only step runs at a bucketed (rows, width) shape with its inputs
written into buffers bound once. The same path runs on the CPU provider, uncaptured, so CI holds it to the eager
model; with KVSERVE_TEST_PROVIDER=cuda the runtime here asks for CUDA graphs and the same tests check the captured
steps (bench/gpu_check.sh runs them)."""

import numpy as np
import pytest

from kvserve.contract.artifact import open_artifact
from kvserve.model.generate import generate
from kvserve.runtime import MIN_DECODE_WIDTH, DecoderRuntime
from kvserve.service.core.batch import SlotBatch
from kvserve.service.process.gate import _greedy_sequence, warm_up
from kvserve.service.core.scheduler import MAX_PROMPT_GROUP, Scheduler

from ...conftest import PROVIDER
from ..conftest import hole_between_rows, sequence
from ..conftest import random_prompt as prompt


def open_runtime(artifact_dir) -> DecoderRuntime:
    artifact = open_artifact(artifact_dir)
    return DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER,
                          cuda_graph=PROVIDER == "cuda")


@pytest.fixture(scope="module")
def standard_runtime(tiny_standard_artifact):
    runtime = open_runtime(tiny_standard_artifact)
    assert runtime.captures_decode == (PROVIDER == "cuda"), runtime.cuda_graph_note
    return runtime


def eager_tokens(model, seq) -> list[int]:
    return generate(model, [seq.prompt_ids], seq.max_new_tokens).tokens[0].tolist()


def test_decode_shapes_are_powers_of_two_within_the_pool_and_the_context(standard_runtime, tiny_model):
    batch = SlotBatch(standard_runtime, tiny_model.config, 12, fixed_decode=True)  # n_ctx 256
    assert batch.decode_shapes() == [(r, w) for r in (1, 2, 4, 8, 12) for w in (64, 128, 256)]
    assert batch.decode_shape(3, 1) == (4, MIN_DECODE_WIDTH)
    assert batch.decode_shape(3, 65) == (4, 128)
    assert batch.decode_shape(9, 256) == (12, 256)


def test_fixed_shape_decode_generates_what_each_sequence_would_alone_across_joins_leaves_and_chunks(standard_runtime, tiny_model):
    standard_runtime.traffic.host_bytes = standard_runtime.traffic.logits_bytes = 0
    batch = SlotBatch(standard_runtime, tiny_model.config, 5, fixed_decode=True)
    seqs = [_greedy_sequence(i, prompt(300 + i, 1 + (11 * i) % 70), 1 + (7 * i) % 90) for i in range(24)]
    scheduler = Scheduler(batch, step_token_budget=12)
    for seq in seqs:
        scheduler.waiting.append(seq)
    steps = 0
    while scheduler.waiting or scheduler.kv.rows:
        plan = scheduler.plan()
        if steps == 40 and plan.decode:
            plan.decode[0].cancelled = True  # leaves mid-stream: its row frees at the next step
        scheduler.run_step(plan)
        steps += 1
    cancelled = [s for s in seqs if s.cancelled]
    assert len(cancelled) == 1 and all(s.finished or s.cancelled for s in seqs)
    for seq in seqs:
        if not seq.cancelled:
            assert seq.generated == eager_tokens(tiny_model, seq), seq.id
    assert standard_runtime.traffic.host_bytes == 0  # the inputs are written into bound buffers; no K/V goes through the host
    assert standard_runtime.traffic.logits_bytes == 0  # greedy rows: only the graph's greedy tokens come back
    assert set(standard_runtime.fixed_shapes(batch.pool)) <= set(batch.decode_shapes())
    assert len(standard_runtime.fixed_shapes(batch.pool)) >= 4  # the run crossed row and width buckets


def test_float16_at_fixed_shapes_generates_what_the_artifact_serves_at_its_own_shapes(tiny_float16_artifact, tiny_model):
    """float16, the precision the CUDA graph targets are set in: fixed-shape steps (wider reads, scratch rows) give each
    sequence the tokens the same artifact gives it at the batch's own shapes (float16 greedy is not held to eager's)."""
    runtime = open_runtime(tiny_float16_artifact)
    assert runtime.kv_dtype == np.float16 and runtime.captures_decode == (PROVIDER == "cuda"), runtime.cuda_graph_note
    generated = {}
    for fixed in (False, True):
        batch = SlotBatch(runtime, tiny_model.config, 4, fixed_decode=fixed)
        seqs = [_greedy_sequence(i, prompt(600 + i, 1 + (13 * i) % 50), 1 + (17 * i) % 80) for i in range(10)]
        Scheduler(batch, step_token_budget=10).drive(seqs)
        generated[fixed] = [s.generated for s in seqs]
        assert bool(runtime.fixed_shapes(batch.pool)) == fixed
        batch.close()
    assert generated[True] == generated[False]
    assert len({tuple(g) for g in generated[True]}) == 10  # ten different continuations, not one repeated


def test_a_row_that_samples_reads_its_own_logits_row_at_the_fixed_shape(standard_runtime, tiny_model):
    """A fixed-shape step reads its (rows, V) logits back when a row samples; each sequence reads its own slot's row,
    through holes and scratch rows, and gets what it would get alone."""
    standard_runtime.traffic.logits_bytes = 0

    def mixed():
        return [_greedy_sequence(1, prompt(801, 4), 30), sequence(2, prompt(802, 6), 20, temperature=1.0, seed=7),
                _greedy_sequence(3, prompt(803, 8), 30), sequence(4, prompt(804, 3), 25, temperature=0.7, top_p=0.9, seed=11)]

    together = mixed()
    scheduler = hole_between_rows(SlotBatch(standard_runtime, tiny_model.config, 4, fixed_decode=True), together, leaving=0, steps=6, budget=0)
    scheduler.drive([])
    assert standard_runtime.traffic.logits_bytes > 0
    for seq, alone in zip(together[1:], mixed()[1:]):
        Scheduler(SlotBatch(standard_runtime, tiny_model.config, 1), step_token_budget=0).drive([alone])
        assert seq.generated == alone.generated, seq.id


def test_a_row_in_a_hole_decodes_at_the_fixed_shape_beside_scratch_rows(standard_runtime, tiny_model):
    """As under CUDA: a freed row stays a hole, and the step's shape has rows beyond the batch's; both run scratch tokens."""
    batch = SlotBatch(standard_runtime, tiny_model.config, 4, fixed_decode=True)
    seqs = [_greedy_sequence(i, prompt(400 + i, 9), 30) for i in range(3)]
    scheduler = hole_between_rows(batch, seqs, leaving=0, steps=8, budget=0)
    assert len(scheduler.kv.slots) == 3 and batch.decode_shape(3, 16)[0] == 4  # 3 slots (one a hole) run as 4 rows
    for seq in seqs[1:]:
        while not seq.finished:
            scheduler.run_step(scheduler.plan())
        assert seq.generated == eager_tokens(tiny_model, seq)


def test_warm_up_prepares_every_decode_shape_so_serving_binds_none(tiny_standard_artifact, tiny_model):
    runtime = open_runtime(tiny_standard_artifact)
    artifact = open_artifact(tiny_standard_artifact)
    batch = SlotBatch(runtime, tiny_model.config, 4, fixed_decode=True)
    warm_up(batch, artifact)
    prepared = runtime.fixed_shapes(batch.pool)
    assert sorted(prepared) == batch.decode_shapes()
    seqs = [_greedy_sequence(i, prompt(500 + i, 3 + 20 * i), 100) for i in range(4)]
    Scheduler(batch, step_token_budget=16).drive(seqs)
    assert runtime.fixed_shapes(batch.pool) == prepared  # no shape first met while serving (no capture mid-stream)
    for seq in seqs:
        assert seq.generated == eager_tokens(tiny_model, seq)
    runtime.release_pool(batch.pool)
    assert runtime.fixed_shapes(batch.pool) == []


def test_a_fused_step_graph_without_a_decode_graph_takes_no_fixed_shape_decode(tiny_llama_fused_artifacts, tiny_llama_model):
    artifact = tiny_llama_fused_artifacts("float16")
    fused = DecoderRuntime(artifact / "model.onnx", tiny_llama_model.config.n_layer, "float16", PROVIDER, decode_graph=True)
    without = DecoderRuntime(artifact / "model.onnx", tiny_llama_model.config.n_layer, "float16", PROVIDER, decode_graph=False)
    assert not without.decodes_fixed and not without.captures_decode
    with pytest.raises(ValueError, match="re-export it"):
        SlotBatch(without, tiny_llama_model.config, 2, fixed_decode=True)
    assert fused.decodes_fixed


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_fused_artifacts_decode_graph_generates_what_its_step_graph_does(family, float16_fused):
    """The decode graph (what `serve --cuda-graph` captures for a fused artifact): fixed-shape decode steps, a shape per
    row count, give each sequence the tokens the step graph gives it, across joins, leaves, holes and chunks; and so do
    steps split as CUDA serves them, every step with a prompt chunk beside decoding rows through the chunk graph."""
    artifact, model = float16_fused[family]
    exact = DecoderRuntime(artifact / "model.onnx", model.config.n_layer, "float16", PROVIDER, chunkless_steps=False)  # the step graph alone
    fixed = DecoderRuntime(artifact / "model.onnx", model.config.n_layer, "float16", PROVIDER, cuda_graph=PROVIDER == "cuda", decode_graph=True)
    split = DecoderRuntime(artifact / "model.onnx", model.config.n_layer, "float16", PROVIDER, cuda_graph=PROVIDER == "cuda", chunk_graph=True)
    assert fixed.captures_decode == (PROVIDER == "cuda"), fixed.cuda_graph_note
    chunk_graph_runs = []
    run = split.session.run_with_iobinding
    split.session.run_with_iobinding = lambda *args: chunk_graph_runs.append(1) or run(*args)
    generated = {}
    for name, runtime in (("exact", exact), ("fixed", fixed), ("split", split)):
        batch = SlotBatch(runtime, model.config, 5, fixed_decode=name != "exact")
        seqs = [_greedy_sequence(i, prompt(900 + i, 1 + (11 * i) % 40), 1 + (7 * i) % 50) for i in range(12)]
        Scheduler(batch, step_token_budget=8).drive(seqs)
        generated[name] = [s.generated for s in seqs]
        if name != "exact":
            shapes = runtime.fixed_shapes(batch.pool)
            assert set(shapes) <= set(batch.decode_shapes()) == {(rows, 0) for rows in (1, 2, 4, 5)} and len(shapes) >= 2
        batch.close()
    assert generated["fixed"] == generated["exact"] == generated["split"]
    assert len({tuple(g) for g in generated["fixed"]}) == 12 and len(chunk_graph_runs) >= 5


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_prompts_prefilled_together_give_each_sequence_what_a_prompt_a_step_gives_it(family, float16_fused):
    """Steps split as CUDA serves them, with its rules (decoding rows take none of the budget, a group's length padded
    to a power of two): fresh prompts joining together as rows of one call (Scheduler.prompt_group) give every sequence,
    greedy or sampled with a seed and log-probabilities, the tokens and log-probabilities a prompt a step gives it,
    across groups of several sizes beside decoding rows; a member cancelled once planned gets no event, the others
    theirs."""
    artifact, model = float16_fused[family]
    outcome = {}
    for grouped in (False, True):
        runtime = DecoderRuntime(artifact / "model.onnx", model.config.n_layer, "float16", PROVIDER, cuda_graph=PROVIDER == "cuda", chunk_graph=True)
        runtime.pads_prompts = True
        batch = SlotBatch(runtime, model.config, 8, fixed_decode=True)
        scheduler = Scheduler(batch, step_token_budget=64)
        scheduler.budget_counts_rows = False
        scheduler.prompt_group_rows = MAX_PROMPT_GROUP if grouped else 1
        seqs = [sequence(i, prompt(1200 + i, 2 + (5 * i) % 24), 3 + (7 * i) % 19, return_logprobs=i % 3 == 0,
                         **({"temperature": 0.9, "seed": 40 + i} if i % 2 else {})) for i in range(14)]
        cancelled, groups = seqs[5], []
        planned = scheduler.plan

        def plan():
            made = planned()
            groups.append(len(made.prompts))
            if cancelled in made.joining:
                cancelled.cancelled = True
            return made

        scheduler.plan = plan
        results = scheduler.drive(seqs)
        outcome[grouped] = ([s.generated for s in seqs], [[e.logprob for s, e in results if s is q] for q in seqs if q.return_logprobs])
        assert not cancelled.generated and all(s is not cancelled for s, _ in results)
        assert all(len(s.generated) == s.max_new_tokens for s in seqs if s is not cancelled)
        if grouped:
            assert len({n for n in groups if n}) >= 2, groups  # groups of several sizes formed
        else:
            assert not any(groups)
        batch.close()
    assert outcome[True][0] == outcome[False][0]
    for with_groups, alone in zip(outcome[True][1], outcome[False][1]):
        assert np.allclose(with_groups, alone, atol=1e-5)


@pytest.mark.parametrize("graphs", ["split", "step"])
def test_prompt_chunks_padded_to_a_few_lengths_give_every_sequence_the_tokens_exact_lengths_do(graphs, float16_fused):
    """pads_prompts (CUDA's rule): each prompt chunk runs at a power-of-two length, its padding written past its end;
    whole prompts, chunks beside decoding rows and after a first chunk, a prompt taking a cached prefix: every
    sequence's tokens are the unpadded runtime's, and the chunks did run padded, timed by their prompt tokens."""
    artifact, model = float16_fused["llama"]
    generated, lengths = {}, {}
    for padded in (False, True):
        runtime = DecoderRuntime(artifact / "model.onnx", model.config.n_layer, "float16", PROVIDER, cuda_graph=PROVIDER == "cuda",
                                 chunk_graph=graphs == "split", chunkless_steps=False)
        runtime.pads_prompts = padded
        ran, run = [], runtime.run_slots
        runtime.run_slots = lambda pool, ids, positions, mask, piece, *args, **kwargs: ran.append(len(piece)) or run(
            pool, ids, positions, mask, piece, *args, **kwargs)
        batch = SlotBatch(runtime, model.config, 4, fixed_decode=graphs == "split")
        scheduler = Scheduler(batch, step_token_budget=12)
        shared = prompt(1400, 20)
        seqs = [_greedy_sequence(i, p, 10) for i, p in enumerate(
            [prompt(1401, 5), shared, prompt(1402, 30), [7, 8, 9] * 6, shared + prompt(1403, 3), prompt(1404, 9)])]
        scheduler.drive(seqs)
        generated[padded], lengths[padded] = [s.generated for s in seqs], set(ran)
        batch.close()
    assert generated[True] == generated[False]
    assert lengths[True] - {0} == {16}  # every chunk (at most 12 + a tail of 3) at 16; decode steps run none (0)
    assert len(lengths[False] - {0}) > 3
    # A padded chunk is timed by the prompt tokens it took, as the scheduler cuts them: a 3-token chunk run as 16 is a
    # short chunk (drafts.ChunkCosts), else a cut to 4 tokens would never show what a short chunk adds
    batch = SlotBatch(runtime, model.config, 4, fixed_decode=graphs == "split")
    scheduler = Scheduler(batch, step_token_budget=12)
    scheduler.waiting.append(_greedy_sequence(20, prompt(1410, 3), 10))
    for _ in range(4):  # its prompt, then decode steps of one row (the first of a shape is not timed)
        scheduler.run_step(scheduler.plan())
    scheduler.waiting.append(_greedy_sequence(21, prompt(1411, 3), 2))
    plan = scheduler.plan()
    assert plan.chunk_tokens == 3 and len(plan.decode) == 1
    scheduler.run_step(plan)
    assert batch.step_costs.chunks.small[0] == 3
    batch.close()


def test_the_cuda_warm_up_runs_a_prompt_group_of_every_shape_and_changes_no_token(float16_fused):
    """warm_up (chunk_lengths, as on CUDA, where chunks and groups run padded) runs a group of every (rows, length)
    prompt_group_shapes gives, each once, in rows it gives back, and a chunk of each length chunks run at, a prompt for
    each rather than one for every length the budget gives; the sequences after it get the tokens they get without it."""
    from kvserve.service.process.gate import prompt_group_shapes

    artifact, model = float16_fused["llama"]
    generated, shapes, chunks = {}, {}, {}
    for warmed in (False, True):
        runtime = DecoderRuntime(artifact / "model.onnx", model.config.n_layer, "float16", PROVIDER, cuda_graph=PROVIDER == "cuda", chunk_graph=True)
        runtime.pads_prompts = True
        ran, run = [], runtime.run_prompts
        runtime.run_prompts = lambda pool, first, prompts, length, *args, **kwargs: ran.append((len(prompts), length)) or run(
            pool, first, prompts, length, *args, **kwargs)
        pieces, run_slots = [], runtime.run_slots
        runtime.run_slots = lambda pool, ids, positions, mask, piece, *args, **kwargs: pieces.append(len(piece)) or run_slots(
            pool, ids, positions, mask, piece, *args, **kwargs)
        batch = SlotBatch(runtime, model.config, 4, fixed_decode=True)
        warm_up(batch, open_artifact(artifact), step_token_budget=64, chunk_lengths=warmed)
        shapes[warmed], chunks[warmed] = ran[:], [n for n in pieces if n]
        seqs = [_greedy_sequence(i, prompt(1300 + i, 4 + 3 * i), 6) for i in range(6)]
        Scheduler(batch, step_token_budget=64).drive(seqs)
        generated[warmed] = [s.generated for s in seqs]
        batch.close()
    expected = prompt_group_shapes(Scheduler(SlotBatch(runtime, model.config, 4, fixed_decode=True), 64))
    assert expected == [(2, 16), (3, 16), (4, 16), (2, 32)]  # 64 tokens, at most the pool's 4 rows
    assert shapes[True] == expected and shapes[False] == []
    # the two warm-up rows' prompts (2 tokens: 16 padded); then the decoding row's own (1) and prompts of 1, 17, 33 and 65
    # tokens beside it, one chunk each (at most 63, the budget less the row, and a tail of 16): 16, 32, 64 and 128, where
    # every length to 79 ran before, and the longer prompts' second chunks (17 to 79 tokens) too
    assert chunks[False] == [16, 16] and chunks[True] == [16, 16, 16, 16, 32, 64, 128], str(chunks[True])
    assert generated[True] == generated[False]


def test_cuda_graphs_asked_for_where_they_cannot_run_say_why(tiny_standard_artifact):
    artifact = open_artifact(tiny_standard_artifact)
    on_cpu = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, "cpu", cuda_graph=True)
    assert not on_cpu.captures_decode and "need the CUDA provider" in on_cpu.cuda_graph_note
    plain = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, "cpu")
    assert plain.cuda_graph_note is None


def test_serve_with_cuda_graph_generates_the_same_tokens_and_reports_why_it_does_not_capture(tiny_standard_artifact, tiny_model):
    import grpc

    from kvserve.v1 import generation_pb2 as pb
    from kvserve.v1 import generation_pb2_grpc as pb_grpc

    from ..conftest import collect, start_server

    running = start_server(tiny_standard_artifact, max_batch_size=4, cuda_graph=True)
    try:
        runtime = running.app.runtime
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest())
            if PROVIDER == "cuda":
                assert runtime.captures_decode and info.provider_note == ""
                assert sorted(runtime.fixed_shapes(running.app.engine.batch.pool)) == running.app.engine.batch.decode_shapes()
            else:
                assert not runtime.captures_decode and "CUDA graphs need the CUDA provider" in info.provider_note
            ids, _, finish = collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), max_new_tokens=20, ignore_eos=True))
    finally:
        running.stop()
    assert finish is not None and ids == generate(tiny_model, [[5, 6, 7]], 20).tokens[0].tolist()


def test_a_capture_that_fails_leaves_every_step_uncaptured_and_the_tokens_right(tiny_standard_artifact, tiny_model, monkeypatch):
    """ONNX Runtime can refuse a capture only on a GPU; here the session's run fails for any run that names a graph."""
    runtime = open_runtime(tiny_standard_artifact)
    runtime.fixed_steps.captures = True  # as if the session had opened with enable_cuda_graph
    real_run = runtime.session.run_with_iobinding
    graph_runs = []

    def run(binding, run_options=None):
        if run_options is not None and run_options.get_run_config_entry("gpu_graph_id") != "-1":
            graph_runs.append(run_options.get_run_config_entry("gpu_graph_id"))
            raise RuntimeError("operation not permitted when stream is capturing")
        return real_run(binding, run_options)

    monkeypatch.setattr(runtime.session, "run_with_iobinding", run)
    batch = SlotBatch(runtime, tiny_model.config, 2, fixed_decode=True)
    seqs = [_greedy_sequence(i, prompt(600 + i, 5 + i), 12) for i in range(2)]
    Scheduler(batch, step_token_budget=0).drive(seqs)
    assert graph_runs == ["1"]  # one attempt, then none
    assert not runtime.captures_decode and "CUDA graph capture failed (operation not permitted" in runtime.cuda_graph_note
    for seq in seqs:
        assert seq.generated == eager_tokens(tiny_model, seq)


def test_the_gate_the_warm_up_and_every_step_run_on_one_thread(tiny_standard_artifact, monkeypatch):
    """ONNX Runtime keeps a captured CUDA graph in the context of the thread that captured it: the server's warm-up
    captures, so it and the steps that replay must share a thread (and the gate, whose pool's steps also capture)."""
    import threading

    import grpc
    import onnxruntime as ort

    from kvserve.v1 import generation_pb2 as pb
    from kvserve.v1 import generation_pb2_grpc as pb_grpc

    from ..conftest import collect, start_server

    threads = []
    real_run = ort.InferenceSession.run_with_iobinding

    def run(session, binding, run_options=None):
        threads.append(threading.current_thread().name)
        return real_run(session, binding, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run)
    running = start_server(tiny_standard_artifact, max_batch_size=4, cuda_graph=True)
    try:
        loaded = len(threads)
        with grpc.insecure_channel(running.target) as channel:
            ids, _, _ = collect(pb_grpc.GenerationServiceStub(channel), pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]), max_new_tokens=8))
    finally:
        running.stop()
    assert loaded > 10 and len(threads) >= loaded + 8 and len(ids) == 8
    assert len(set(threads)) == 1 and threads[0].startswith("kvserve-step")


def test_each_shape_is_a_graph_of_its_own_and_a_released_pool_releases_its_graphs(tiny_standard_artifact, tiny_model, monkeypatch):
    """Graph ids as a capturing session gets them (on the CPU provider, whose runs ignore the id)."""
    runtime = open_runtime(tiny_standard_artifact)
    runtime.fixed_steps.captures = True
    released = []
    monkeypatch.setattr(runtime.session, "release_captured_graph", released.append)
    first, second = (SlotBatch(runtime, tiny_model.config, 2, fixed_decode=True) for _ in range(2))
    first.prepare_decode_shapes()
    second.prepare_decode_shapes()
    ids = {pool: [runtime.fixed_steps._steps[(pool, *shape)].graph_id for shape in runtime.fixed_shapes(pool)] for pool in (first.pool, second.pool)}
    assert len(ids[first.pool]) == len(first.decode_shapes()) == 2 * 3  # rows 1, 2 x widths 64, 128, 256
    assert len(set(ids[first.pool] + ids[second.pool])) == 12  # no id shared between shapes or pools
    runtime.release_pool(first.pool)
    assert sorted(released) == sorted(ids[first.pool]) and runtime.fixed_shapes(second.pool)
    seq = _greedy_sequence(1, prompt(700, 6), 10)
    Scheduler(second, step_token_budget=0).drive([seq])  # the other pool's steps still run
    assert seq.generated == eager_tokens(tiny_model, seq) and len(runtime.fixed_shapes(second.pool)) == 6


def test_longrope_rows_decode_at_fixed_shapes_with_their_factors(llama_artifact):
    """A longrope graph's fixed-shape decode steps take each row's choice of factors too: rows crossing the original
    context mid-stream (prefilled again, long), one past it from the start, one within, equal transformers' tokens."""
    from ...conftest import LLAMA_CONFIGS
    from ...hf_reference import hf_greedy

    hf, _, artifact_dir = llama_artifact(next(name for name in LLAMA_CONFIGS if "longrope" in name), attention="standard")
    config = open_artifact(artifact_dir).config
    after = config.long_rope_after
    prompts = [prompt(900 + i, length) for i, length in enumerate((after - 6, after - 2, after + 5, 7))]
    seqs = [_greedy_sequence(i, p, 16) for i, p in enumerate(prompts)]
    Scheduler(SlotBatch(open_runtime(artifact_dir), config, 4, fixed_decode=True), step_token_budget=8).drive(seqs)
    np.testing.assert_array_equal(np.array([seq.generated for seq in seqs]), hf_greedy(hf, prompts, 16))


@pytest.mark.parametrize("name", ["mistral sliding window 7 head_dim 16", "gemma3 multi-query head_dim 32 qk-norm two bases linear-rope sliding 6"])
def test_ring_rows_decode_at_fixed_shapes_as_transformers_does(llama_artifact, name):
    """A graph whose windowed layers are rings (every layer, or beside whole-context ones) at the fixed shapes: widths
    past the ring and under it, scratch rows at the graph's scratch position, joins and chunks beside them."""
    from tests.hf_reference import hf_greedy

    hf, _, artifact_dir = llama_artifact(name, attention="standard")
    artifact = open_artifact(artifact_dir)
    assert artifact.kv_ring is not None
    batch = SlotBatch(open_runtime(artifact_dir), artifact.config, 3, fixed_decode=True)
    seqs = [_greedy_sequence(i, prompt(500 + i, 3 + 9 * i), 40) for i in range(5)]
    scheduler = Scheduler(batch, step_token_budget=8)
    scheduler.waiting.extend(seqs)
    while scheduler.waiting or scheduler.kv.rows:
        scheduler.run_step(scheduler.plan())
    for seq in seqs:
        assert seq.generated == hf_greedy(hf, [seq.prompt_ids], 40)[0].tolist(), seq.id


def test_the_chunk_length_warm_up_runs_each_chunk_through_the_chunk_graph_and_changes_no_token(tiny_llama_fused_artifacts,
                                                                                                 tiny_llama_model):
    """What the CUDA warm-up does with split steps: every chunk it runs beside its decoding row goes through the chunk
    graph (whose first run at each chunk length it pays), and the requests after it get the tokens they get without it."""
    from kvserve.service.process.gate import chunk_warm_up_prompts

    artifact_dir, model, budget = tiny_llama_fused_artifacts("float16"), tiny_llama_model, 8
    artifact = open_artifact(artifact_dir)
    generated, chunk_graph_runs = {}, {}
    for warmed in (False, True):
        split = DecoderRuntime(artifact.model_path, model.config.n_layer, "float16", PROVIDER, cuda_graph=PROVIDER == "cuda", chunk_graph=True)
        split.pads_prompts = False  # every chunk length, as on the CPU (padded: test_the_cuda_warm_up_runs_a_prompt_group_...)
        runs = []
        run = split.session.run_with_iobinding
        split.session.run_with_iobinding = lambda *args, run=run, runs=runs: runs.append(1) or run(*args)
        batch = SlotBatch(split, model.config, 4, fixed_decode=True)
        warm_up(batch, artifact, step_token_budget=budget, chunk_lengths=warmed)
        chunk_graph_runs[warmed] = len(runs)
        seqs = [_greedy_sequence(i, prompt(700 + i, 3 + 9 * i), 12) for i in range(4)]
        Scheduler(batch, step_token_budget=budget).drive(seqs)
        generated[warmed] = [s.generated for s in seqs]
        batch.close()
    cpu = PROVIDER != "cuda"  # on CUDA the decoding row takes none of the budget (Scheduler.budget_counts_rows)
    allowance, tail = budget - cpu, budget // 4
    lengths = chunk_warm_up_prompts(allowance, tail, model.config.n_ctx - 1)
    chunks = sum(1 if length <= allowance + tail else 2 for length in lengths)  # each beside the decoding row
    assert chunk_graph_runs[True] - chunk_graph_runs[False] == chunks == (9 + 2 * 7 if cpu else 10 + 2 * 8)
    assert generated[True] == generated[False]
