"""One slots step (runtime/step.py) on standard and fused graphs: the pool bound by address and written in place, only
what sampling reads brought to the host, bindings kept per row layout and reused; and a concat graph run as
tools run it (run_feeds)."""

import numpy as np
import pytest

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import CHUNK_GRAPH_FILE, DECODE_GRAPH_FILE, graph_bytes, open_artifact
from kvserve.runtime import DecoderRuntime, SlotPool, pool_capacity
from kvserve.runtime.providers import ModelUnloadable, StepRunFailed

from ..conftest import PROVIDER


def opened(artifact_dir) -> tuple[DecoderRuntime, object]:
    artifact = open_artifact(artifact_dir)
    return DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER), artifact.config


def prefill(runtime, pool, rows: int, row: int, prompt: list[int], with_logits: bool = True, sample_row_0: bool = False):
    """Row `row`'s whole prompt as one chunk, every other row a scratch token; sampled at the prompt's last token (and
    at row 0's scratch token: a fused graph then runs row 0 beside the chunk)."""
    scratch = pool.capacity - 1
    sampled = [0] * sample_row_0 + [rows + len(prompt) - 1]
    return runtime.run_slots(pool, np.zeros(rows, np.int64), np.full(rows, scratch, np.int64), np.ones((rows, 1), np.int64),
                             np.array(prompt, np.int64), 0, row, np.array(sampled), with_logits)


@pytest.mark.parametrize("graph", ["tiny_standard_artifact", "tiny_fused_artifact"], ids=["standard", "fused"])
def test_a_step_writes_its_rows_k_v_in_place_and_returns_the_graphs_greedy_tokens(graph, request):
    runtime, config = opened(request.getfixturevalue(graph))
    pool = runtime.new_pool(2, config.n_kv_head, config.d_head, pool_capacity(config))
    assert runtime.attention == (io.STANDARD if graph == "tiny_standard_artifact" else io.FUSED)
    sampled = prefill(runtime, pool, 2, 1, [5, 6, 7])
    assert sampled.logits.shape == (1, config.vocab_size) and sampled.greedy_tokens.tolist() == [int(sampled.logits.argmax())]
    assert runtime.traffic.logits_bytes == sampled.logits.nbytes and runtime.traffic.host_bytes == 0
    kv = pool.row_to_host(1, 3)  # written where the row lives: nothing was copied back by the step
    assert all(np.abs(array).max() > 0 for array in kv) and not np.abs(pool.row_to_host(0, 3)[0]).max()
    again = runtime.new_pool(2, config.n_kv_head, config.d_head, pool_capacity(config))
    tokens_only = prefill(runtime, again, 2, 1, [5, 6, 7], with_logits=False)
    assert tokens_only.logits is None and tokens_only.greedy_tokens.tolist() == sampled.greedy_tokens.tolist()
    assert runtime.traffic.logits_bytes == sampled.logits.nbytes  # greedy tokens alone: no logits read back


def test_a_step_the_graph_fails_is_a_step_run_failure_naming_the_node_and_the_provider(tiny_standard_artifact):
    """ONNX Runtime's own failure of a run (a kernel refusing its inputs: here a chunk for a row past the rows bound)
    comes out as StepRunFailed, which the server's load turns into one line (tests/service/process/test_lifecycle.py).
    On the CPU provider whatever the suite's: CUDA's ScatterND clamps an index past the rows instead of refusing it."""
    artifact = open_artifact(tiny_standard_artifact)
    config = artifact.config
    runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, "cpu")
    pool = runtime.new_pool(2, config.n_kv_head, config.d_head, pool_capacity(config))
    scratch = pool.capacity - 1
    with pytest.raises(StepRunFailed, match="^ONNX Runtime failed a step on CPUExecutionProvider: .*ScatterND node"):
        runtime.run_slots(pool, np.zeros(1, np.int64), np.full(1, scratch, np.int64), np.ones((1, 1), np.int64), np.array([5, 6, 7]),
                          0, 1, np.array([3]))
    assert prefill(runtime, pool, 2, 1, [5, 6, 7]).greedy_tokens.shape == (1,)  # the runtime steps on


def test_inputs_copied_to_the_device_land_before_the_step_reads_them(tiny_standard_artifact, tiny_model, late_uploads, monkeypatch):
    """Under CUDA a step's inputs reach the device by copies CUDA may still be making when the call returns (cudaMemcpy
    from pageable memory, on the legacy stream, which ONNX Runtime's stream does not wait for). Emulated on the CPU
    provider: the steps' inputs bound as device values whose writes land only at the CUDA runtime's wait. Prompts in
    chunks and rows decoding beside them then give the eager model's tokens, as they do where writes land at once."""
    from kvserve.model.generate import generate
    from kvserve.runtime import step as step_module
    from kvserve.service.core.batch import SlotBatch
    from kvserve.service.core.scheduler import Scheduler
    from kvserve.service.process.gate import _greedy_sequence

    class DeviceInputs(step_module.BoundStep):
        def __init__(self, session, device):
            super().__init__(session, device)
            self.device = "cuda"  # the inputs go to the device; the pool and the logits stay the CPU provider's

    monkeypatch.setattr(step_module, "BoundStep", DeviceInputs)
    artifact = open_artifact(tiny_standard_artifact)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, "cpu")
    seqs = [_greedy_sequence(i, list(range(3 + i, 3 + i + 4 + 9 * i)), 6) for i in range(3)]
    Scheduler(SlotBatch(runtime, artifact.config, 2), step_token_budget=8).drive(seqs)
    for seq in seqs:
        assert seq.generated == generate(tiny_model, [seq.prompt_ids], 6).tokens[0].tolist(), seq.id
    assert late_uploads.waits and not late_uploads.on_the_way  # every step waited, nothing left on its way


def unpadded_pool(runtime: DecoderRuntime, rows: int, config) -> SlotPool:
    """runtime.new_pool's pool as it was before rows were padded to whole pages: every move a copy."""
    return SlotPool(rows, config.n_kv_head, config.d_head, pool_capacity(config), runtime.n_layer, runtime.kv_dtype, runtime.device,
                    runtime.traffic, runtime.rings, runtime.scratch_position, remap_rows=False)


@pytest.mark.parametrize("graph", ["tiny_standard_artifact", "tiny_fused_artifact", "tiny_llama_fused_artifact"],
                         ids=["standard", "fused", "llama fused"])
def test_a_pool_padded_to_whole_pages_steps_and_moves_rows_as_an_unpadded_one_does(graph, request):
    """Rows padded to whole pages (runtime/pool.py) change no step: prompts, rows decoding (through a small fused
    artifact's decode graph alone, and beside others), rows traded and moved between steps (remapped, against copied):
    every step's tokens and logits and every row's K/V equal an unpadded pool's."""
    artifact = open_artifact(request.getfixturevalue(graph))
    config = artifact.config
    runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, PROVIDER)
    padded, plain = runtime.new_pool(3, config.n_kv_head, config.d_head, pool_capacity(config)), unpadded_pool(runtime, 3, config)
    padded.remap_min_columns = 0  # these short rows remapped too
    if runtime.device == "cpu":
        assert runtime.pads_pool and padded.shape[2] > pool_capacity(config) == plain.shape[2] and padded.scratch == plain.scratch
    scratch, empty = plain.scratch, np.zeros(0, np.int64)
    steps = [  # (input_ids, position_ids, chunk, chunk_start, chunk_slot, logits_index), then a move of the rows
        ([0], [scratch], [5, 6, 7, 8], 0, 0, [4], None),
        ([0, 0], [scratch, scratch], [9, 10, 11], 0, 1, [0, 4], ("exchange", 0, 1, 4, 3)),
        ([3, 4], [3, 4], empty, 0, 0, [0, 1], None),  # row 0 now holds the 3-token prompt and row 1 the 4-token one
        ([0, 2, 0], [scratch, 5, scratch], [1, 2, 3, 4, 5, 6], 0, 2, [1, 8], ("move", 2, 0, 6, 4)),
        ([5], [6], empty, 0, 0, [0], None),  # row 0 (the 6-token prompt, moved) decodes alone
        ([6, 7], [7, 6], empty, 0, 0, [0, 1], None),
    ]
    for ids, positions, chunk, start, slot, index, move in steps:
        ran = [runtime.run_slots(pool, np.array(ids, np.int64), np.array(positions, np.int64), np.ones((len(ids), 16), np.int64),
                                 np.array(chunk, np.int64), start, slot, np.array(index)) for pool in (padded, plain)]
        assert ran[0].greedy_tokens.tolist() == ran[1].greedy_tokens.tolist() and np.array_equal(ran[0].logits, ran[1].logits)
        if move and move[0] == "exchange":
            for pool in (padded, plain):
                pool.exchange_rows(*move[1:])
        elif move:
            for pool in (padded, plain):
                pool.move_row(*move[1:])
    if runtime.device == "cpu":
        assert runtime.traffic.remapped_bytes > 0
    for row, columns in ((0, 8), (1, 7)):
        for a, b in zip(padded.row_to_host(row, columns), plain.row_to_host(row, columns)):
            assert np.array_equal(a, b)


def test_a_decode_graph_exported_before_its_total_was_bounded_keeps_the_pool_unpadded(tiny_llama_fused_artifact, tmp_path):
    """An older export's decode graph gives its operators the pool's width as their total length, which a pool wider
    than the rotary tables would break: without the metadata that says otherwise, the runtime pads nothing, and its
    decode graph's steps still run."""
    import shutil

    import onnx

    old = tmp_path / "old"
    shutil.copytree(tiny_llama_fused_artifact, old)
    decode = onnx.load(str(old / DECODE_GRAPH_FILE), load_external_data=False)
    kept = [prop for prop in decode.metadata_props if prop.key != io.DECODE_TOTAL_WITHIN_TABLES]
    assert len(kept) == len(decode.metadata_props) - 1  # this export wrote it
    del decode.metadata_props[:]
    decode.metadata_props.extend(kept)
    onnx.save(decode, str(old / DECODE_GRAPH_FILE))  # (its checksum no longer matches: the runtime is opened directly)
    artifact = open_artifact(tiny_llama_fused_artifact)
    config = artifact.config
    runtime = DecoderRuntime(old / artifact.model_path.name, config.n_layer, artifact.dtype, PROVIDER, chunkless_steps=True)
    assert runtime.chunkless_session is not None and not runtime.pads_pool
    pool = runtime.new_pool(1, config.n_kv_head, config.d_head, pool_capacity(config))
    assert pool.shape[2] == pool_capacity(config)
    ran = runtime.run_slots(pool, np.zeros(1, np.int64), np.array([pool.scratch]), None, np.array([5, 6, 7]), 0, 0, np.array([3]))
    assert ran.greedy_tokens.shape == (1,)


@pytest.mark.parametrize("graph", ["tiny_standard_artifact", "tiny_fused_artifact"], ids=["standard", "fused"])
def test_kept_bindings_and_buffers_compute_what_binding_every_step_anew_does(graph, request):
    """Steps that alternate between row layouts (3 rows, then 2, then 3 again), chunk rows and shapes (chunks of 3, 2
    and 3 tokens), greedy tokens alone and logits: each layout's binding is kept and reused, each shape's buffers too,
    a kept fused binding rebinds its chunk row alone, and every step's tokens, logits and K/V rows are those of a
    runtime that binds every step anew."""
    artifact = request.getfixturevalue(graph)
    (runtime, config), (anew, _) = opened(artifact), opened(artifact)
    pools = [r.new_pool(3, config.n_kv_head, config.d_head, pool_capacity(config)) for r in (runtime, anew)]
    steps = [(3, 0, [5, 6, 7], False, False), (3, 1, [8, 9], True, True), (2, 0, [1, 2, 3], False, False),
             (3, 2, [4, 5, 6], False, True), (3, 1, [7, 7], False, True), (3, 0, [2, 3], True, False),
             (3, 2, [9, 8, 7], True, True), (3, 1, [6, 5, 4], False, True)]
    for step, (rows, row, prompt, with_logits, sample_row_0) in enumerate(steps):
        anew._bindings.clear()
        kept, fresh = (prefill(r, pool, rows, row, prompt, with_logits, sample_row_0) for r, pool in zip((runtime, anew), pools))
        assert kept.greedy_tokens.tolist() == fresh.greedy_tokens.tolist()
        assert (kept.logits is None) == (not with_logits) and (kept.logits is None or np.array_equal(kept.logits, fresh.logits))
        if step == 0:
            first_key, first = next(reversed(runtime._bindings.items()))
    for row in range(3):
        for a, b in zip(pools[0].row_to_host(row, 3), pools[1].row_to_host(row, 3)):
            assert np.array_equal(a, b)
    # standard: 3 rows and 2; fused: row 0 twice (a chunk alone runs as its one row, through the decode graph, and rows 1
    # and 2 ran theirs beside row 0 through the step graph, its one binding's chunk row rebound)
    assert runtime._bindings[first_key] is first and len(runtime._bindings) == 2
    runtime.release_pool(pools[0])
    assert not runtime._bindings


@pytest.mark.parametrize("graph", ["tiny_fused_artifact", "tiny_llama_fused_artifact"], ids=["gpt2", "llama"])
def test_a_small_fused_artifacts_steps_without_a_chunk_run_its_decode_graph_and_compute_what_its_step_graph_does(graph, request):
    """Steps of a small artifact (its decode graph written beside it) of one row and no chunk beside it (a prompt alone,
    a row decoding alone, a row checking 5 tokens alone) run the decode graph; a prompt chunk beside decoding rows, and
    several rows decoding, run the step graph. Every step's tokens, logits and K/V rows are those of a runtime that runs
    the step graph alone."""
    artifact = open_artifact(request.getfixturevalue(graph))
    assert (artifact.directory / DECODE_GRAPH_FILE).exists()
    runtimes = [DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER, chunkless_steps=chunkless)
                for chunkless in (None, False)]
    assert runtimes[0].chunkless_session is not None and runtimes[1].chunkless_session is None
    # every session on the process's one thread pool: neither's idle threads spin on a core the other's run needs
    assert not any(s.get_session_options().use_per_session_threads for s in (runtimes[0].session, runtimes[0].chunkless_session))
    config = artifact.config
    pools = [r.new_pool(3, config.n_kv_head, config.d_head, pool_capacity(config)) for r in runtimes]
    scratch = pools[0].capacity - 1
    empty = np.zeros(0, np.int64)
    steps = [  # (input_ids, position_ids, chunk, chunk_start, chunk_slot, logits_index, with_logits, runs the decode graph)
        ([0], [scratch], [5, 6, 7, 8], 0, 0, [4], True, True),  # row 0's prompt alone: its chunk is the step's one row
        ([0, 0], [scratch, scratch], [9, 10, 11], 0, 1, [0, 4], False, False),  # row 1's prompt beside row 0's sampled scratch token
        ([3, 4], [4, 3], empty, 0, 0, [0, 1], True, False),  # rows 0 and 1 decode
        ([5], [5], empty, 0, 0, [0], False, True),  # row 0 decodes alone
        ([0, 2, 0], [scratch, 4, scratch], [1, 2, 3, 4, 5, 6], 0, 2, [1, 8], True, False),  # row 2's prompt beside row 1
        ([0], [scratch], [7, 1, 2, 3, 4], 6, 0, [1, 2, 3, 4, 5], True, True),  # row 0 checks 5 tokens alone
        ([6, 7, 8], [11, 5, 6], empty, 0, 0, [0, 1, 2], False, False),  # every row decodes
    ]
    for ids, positions, chunk, start, slot, index, with_logits, chunkless in steps:
        chunkless_bound = []
        for runtime, pool in zip(runtimes, pools):
            ran = runtime.run_slots(pool, np.array(ids, np.int64), np.array(positions, np.int64), None, np.array(chunk, np.int64), start,
                                    slot, np.array(index), with_logits)
            chunkless_bound.append(next(reversed(runtime._bindings.values())).session is runtime.chunkless_session)
            if runtime is runtimes[0]:
                first = ran
        assert chunkless_bound == [chunkless, False]
        assert first.greedy_tokens.tolist() == ran.greedy_tokens.tolist()
        assert (first.logits is None) == (not with_logits) and (first.logits is None or np.array_equal(first.logits, ran.logits))
    for row in range(3):
        for a, b in zip(pools[0].row_to_host(row, 11), pools[1].row_to_host(row, 11)):
            assert np.array_equal(a, b)


def test_split_steps_run_a_chunk_beside_decoding_rows_through_the_chunk_graph_every_other_step_through_the_decode_graph(
        tiny_llama_fused_artifacts):
    """A runtime that splits its steps (chunk_graph, what CUDA runs) opens no step graph: a prompt chunk beside decoding
    rows runs the chunk graph, a prompt alone, rows decoding (one or several) and a row checking drafts the decode graph;
    every step's tokens, logits and K/V rows are those of a runtime that runs the step graph alone."""
    artifact = open_artifact(tiny_llama_fused_artifacts("float16"))
    split = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER, chunk_graph=True)
    whole = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER, chunkless_steps=False, chunk_graph=False)
    assert split.splits_steps and not whole.splits_steps and split.chunkless_session is not None
    assert split.session._model_path.endswith(CHUNK_GRAPH_FILE) and whole.session._model_path.endswith("model.onnx")
    with pytest.raises(ValueError, match="no step graph open"):
        with split.step_graph_only():
            pass
    config = artifact.config
    pools = [r.new_pool(3, config.n_kv_head, config.d_head, pool_capacity(config)) for r in (split, whole)]
    scratch = pools[0].capacity - 1
    empty = np.zeros(0, np.int64)
    steps = [  # (input_ids, position_ids, chunk, chunk_start, chunk_slot, logits_index, runs the chunk graph)
        ([0], [scratch], [5, 6, 7, 8], 0, 0, [4], False),  # row 0's prompt alone: the decode graph's one row
        ([0, 0], [scratch, scratch], [9, 10, 11], 0, 1, [0, 4], True),  # row 1's prompt beside row 0's sampled scratch token
        ([3, 4], [4, 3], empty, 0, 0, [0, 1], False),  # rows 0 and 1 decode
        ([0, 2, 0], [scratch, 4, scratch], [1, 2, 3, 4, 5, 6], 0, 2, [1, 8], True),  # row 2's prompt beside row 1
        ([0, 0, 9], [scratch, scratch, 6], [7, 1, 2], 5, 0, [2, 3, 4, 5], True),  # row 0 checks 3 drafts beside row 2
        ([0], [scratch], [7, 1, 2, 3, 4], 8, 0, [1, 2, 3, 4, 5], False),  # row 0 checks 5 tokens alone
        ([6, 7, 8], [13, 5, 7], empty, 0, 0, [0, 1, 2], False),  # every row decodes
    ]
    for ids, positions, chunk, start, slot, index, chunk_graph in steps:
        ran = []
        for runtime, pool in zip((split, whole), pools):
            ran.append(runtime.run_slots(pool, np.array(ids, np.int64), np.array(positions, np.int64), None, np.array(chunk, np.int64),
                                         start, slot, np.array(index), True))
        session = next(reversed(split._bindings.values())).session
        assert session is (split.session if chunk_graph else split.chunkless_session)
        assert ran[0].greedy_tokens.tolist() == ran[1].greedy_tokens.tolist()
        assert_same(ran[0].logits, ran[1].logits)
    for row in range(3):
        for a, b in zip(pools[0].row_to_host(row, 14), pools[1].row_to_host(row, 14)):
            assert_same(a, b)


def assert_same(split: np.ndarray, whole: np.ndarray) -> None:
    """The same numbers on the CPU provider; on CUDA the decode graph's operator is told the pool's width for its total
    where the step graph's is told the longest row's, and may take another kernel path: float16 rounding apart."""
    if PROVIDER == "cpu":
        assert np.array_equal(split, whole)
    else:
        assert np.abs(split.astype(np.float32) - whole.astype(np.float32)).max() <= 1e-2 * max(np.abs(whole).max(), 1.0)


@pytest.mark.parametrize("graphs", ["step", "split"])
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
def test_fresh_prompts_prefilled_as_rows_of_one_step_give_each_ones_tokens_logits_and_k_v_alone(graphs, padded, tiny_llama_fused_artifacts):
    """run_prompts: prompts of different lengths, each whole from column 0 as consecutive rows of one call (through the
    step graph with no chunk, or, splitting steps, the chunk graph with the last prompt as its chunk), shorter ones
    padded to the longest or, padded (CUDA's rule), to a power of two; each prompt's greedy token, logits and K/V
    columns are those of that prompt run alone, and no other row is written."""
    artifact = open_artifact(tiny_llama_fused_artifacts("float16"))
    config = artifact.config
    runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, PROVIDER, chunk_graph=graphs == "split",
                             chunkless_steps=False)
    runtime.pads_prompts = padded
    prompts = [[(7 * i + 3 * j) % config.vocab_size for j in range(n)] for i, n in enumerate((5, 3, 9, 1))]
    length = runtime.prompt_length(9, config.n_ctx)
    assert length == (16 if padded else 9) and runtime.prompt_length(17, config.n_ctx) == (32 if padded else 17)
    assert runtime.prompt_length(100, 120) == (120 if padded else 100)  # never past the positions the graph holds
    alone = runtime.new_pool(7, config.n_kv_head, config.d_head, pool_capacity(config))
    empty = np.zeros(0, np.int64)
    expected = [runtime.run_slots(alone, empty, empty, None, np.array(p, np.int64), 0, 2 + i, np.array([len(p) - 1]))
                for i, p in enumerate(prompts)]
    grouped = runtime.new_pool(7, config.n_kv_head, config.d_head, pool_capacity(config))
    sampled = runtime.run_prompts(grouped, 2, prompts, length)
    session = next(reversed(runtime._bindings.values())).session
    assert session is runtime.session and session._model_path.endswith(CHUNK_GRAPH_FILE if graphs == "split" else "model.onnx")
    assert sampled.greedy_tokens.tolist() == [e.greedy_tokens[0] for e in expected]
    for i, prompt in enumerate(prompts):
        assert_same(sampled.logits[i], expected[i].logits[0])
        for a, b in zip(grouped.row_to_host(2 + i, len(prompt)), alone.row_to_host(2 + i, len(prompt))):
            assert_same(a, b)
    for row in (0, 1, 6):  # rows outside the group: untouched
        assert not any(np.abs(array).max() for array in grouped.row_to_host(row, length))
    tokens_only = runtime.run_prompts(grouped, 2, prompts, length, with_logits=False)
    assert tokens_only.logits is None and tokens_only.greedy_tokens.tolist() == sampled.greedy_tokens.tolist()
    if graphs == "split":
        with pytest.raises(ValueError, match="two prompts at least"):
            runtime.run_prompts(grouped, 0, prompts[:1], 5)


def test_prompts_prefill_as_rows_of_one_step_in_a_fused_graph_only(tiny_standard_artifact):
    runtime, config = opened(tiny_standard_artifact)
    pool = runtime.new_pool(2, config.n_kv_head, config.d_head, pool_capacity(config))
    with pytest.raises(ValueError, match="fused graph only"):
        runtime.run_prompts(pool, 0, [[1, 2], [3]], 2)


def test_a_split_runtime_is_refused_for_an_artifact_without_a_chunk_graph_and_unasked_on_the_cpu(tiny_artifact, tiny_llama_fused_artifacts):
    artifact = open_artifact(tiny_artifact)  # float32: a decode graph (small weights), no chunk graph
    with pytest.raises(ModelUnloadable, match="splitting steps between a chunk graph and a decode graph needs both, and it has no chunk.onnx "):
        DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER, chunk_graph=True)
    both = open_artifact(tiny_llama_fused_artifacts("float16"))  # has both: on the CPU provider, unasked, the step graph runs
    assert not DecoderRuntime(both.model_path, both.config.n_layer, both.dtype, "cpu").splits_steps


def test_a_fused_artifact_with_large_weights_runs_every_step_through_its_step_graph(tiny_fused_artifact, monkeypatch):
    monkeypatch.setattr("kvserve.runtime.step.CHUNKLESS_MAX_WEIGHT_BYTES", graph_bytes(tiny_fused_artifact) - 1)
    runtime, _ = opened(tiny_fused_artifact)
    assert runtime.chunkless_session is None
    monkeypatch.setattr("kvserve.runtime.step.CHUNKLESS_MAX_WEIGHT_BYTES", graph_bytes(tiny_fused_artifact))
    assert opened(tiny_fused_artifact)[0].chunkless_session is not None


def test_fixed_shape_decode_steps_drive_a_standard_graph_or_a_decode_graph_only(tiny_fused_artifact):
    runtime, config = opened(tiny_fused_artifact)  # a fused step graph whose decode graph serves run_slots alone (decode_graph unset)
    pool = runtime.new_pool(2, config.n_kv_head, config.d_head, pool_capacity(config))
    with pytest.raises(ValueError, match="a fused step graph's decode steps go through run_slots"):
        runtime.run_decode(pool, np.zeros(2, np.int64), np.zeros(2, np.int64), np.ones((2, 64), np.int64))


def test_a_concat_graph_runs_from_host_feeds_and_returns_logits_and_every_present(tiny_concat_artifact):
    runtime, config = opened(tiny_concat_artifact)
    ids = np.array([[5, 6, 7]], np.int64)  # (B, T)
    empty = np.zeros((1, config.n_kv_head, 0, config.d_head), np.float32)  # (B, H_kv, 0, d_k)
    feeds = {io.INPUT_IDS: ids, io.ATTENTION_MASK: np.ones_like(ids), io.POSITION_IDS: np.arange(3)[None],
             **{name: empty for layer in range(config.n_layer) for name in io.past_names(layer)}}
    logits, *present = runtime.run_feeds(feeds)
    assert logits.shape == (1, 3, config.vocab_size) and len(present) == 2 * config.n_layer
    assert present[0].shape == (1, config.n_kv_head, 3, config.d_head)
    assert set(runtime.signature()["outputs"]) == {io.LOGITS, *(n for layer in range(config.n_layer) for n in io.present_names(layer))}


def test_a_kept_binding_copies_each_steps_inputs_to_the_device_that_reads_them(monkeypatch):
    """ONNX Runtime copies a host buffer bound to a CUDA session's input when it is bound, not when the step runs: a
    binding kept across steps (BoundStep) whose host buffers alone were rewritten ran every chunk after the first of the
    same length on the first one's tokens (found on an H100: parity failed from the second chunk). Bound on a device,
    each step's values are copied there; a new shape is bound anew."""
    from kvserve.runtime.step import BoundStep, ort

    class DeviceValue:  # an input's memory on the device: what the step reads
        def __init__(self, array):
            self.array = np.array(array, copy=True)

        def update_inplace(self, array):
            self.array = np.array(array, copy=True)

    class Binding:
        def __init__(self):
            self.inputs = {}

        def bind_ortvalue_input(self, name, value):
            self.inputs[name] = value

    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(lambda array, device="cpu", device_id=0: DeviceValue(array)))
    class Session:
        def io_binding(self):
            return binding

    binding = Binding()
    bound = BoundStep(Session(), "cuda")
    bound.set_input(io.CHUNK_IDS, np.array([[1, 2, 3]]))
    bound.set_input(io.CHUNK_IDS, np.array([[4, 5, 6]]))  # the same shape: the buffer bound last step
    assert binding.inputs[io.CHUNK_IDS].array.tolist() == [[4, 5, 6]]
    bound.set_input(io.CHUNK_IDS, np.array([[7, 8]]))
    assert binding.inputs[io.CHUNK_IDS].array.tolist() == [[7, 8]]
