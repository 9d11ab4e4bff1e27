"""The inplace KV cache: present is written into the past's own buffer, which grows by doubling, and a
server on an inplace artifact streams exactly what the eager reference generates."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from kvserve.export.artifact import open_artifact
from kvserve.model.generate import generate
from kvserve.service.runtime import MIN_CAPACITY, DecoderRuntime, inplace_capacity
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from ..conftest import PROVIDER
from .conftest import collect, start_server


def open_runtime(directory) -> DecoderRuntime:
    artifact = open_artifact(directory)
    return DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER, kv_cache=artifact.kv_cache)


def test_capacity_is_a_power_of_two_with_a_floor():
    assert [inplace_capacity(n) for n in (0, 1, 64, 65, 1000, 1024, 1025)] == [64, 64, 64, 128, 1024, 1024, 2048]
    assert inplace_capacity(17, minimum=16) == 32


def test_decode_writes_into_the_past_buffer_and_matches_the_concat_graph(tiny_concat_artifact, tiny_inplace_artifact):
    inplace, concat = open_runtime(tiny_inplace_artifact), open_runtime(tiny_concat_artifact)
    config = open_artifact(tiny_concat_artifact).config
    prompts = [[3, 1, 4], [(5 * i) % 250 + 1 for i in range(50)]]  # left-padded to 50 columns
    ids = np.zeros((2, 50), np.int64)
    mask = np.zeros((2, 50), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, 50 - len(prompt) :], mask[row, 50 - len(prompt) :] = prompt, 1
    pos = np.maximum(mask.cumsum(axis=1) - 1, 0)
    empty = lambda runtime: runtime.empty_past(2, config.n_head, config.d_head)  # noqa: E731
    a, b = inplace.run(ids, mask, pos, empty(inplace)), concat.run(ids, mask, pos, empty(concat))
    assert a.present.capacity == MIN_CAPACITY and b.present.capacity == 50
    grew = 0
    for _ in range(30):  # 50 + 30 columns: crosses the 64-column buffer once
        assert np.abs(a.logits[:, -1] - b.logits[:, -1]).max() <= 1e-5
        token = a.logits[:, -1].argmax(-1)[:, None]  # (B, 1)
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        pos = pos[:, -1:] + 1
        before = [v.data_ptr() for v in a.present.values]
        a = inplace.run(token, mask, pos, a.present)
        b = concat.run(token, mask, pos, b.present)
        if [v.data_ptr() for v in a.present.values] != before:
            grew += 1
            assert a.present.capacity == 128
        assert a.present.length == b.present.length == mask.shape[1]
    assert grew == 1
    real = mask.astype(bool)[:, None, :, None]  # padding columns hold K/V nobody reads
    for x, y in zip(inplace.to_host(a.present), concat.to_host(b.present)):
        assert x.shape == y.shape and np.abs(np.where(real, x - y, 0)).max() <= 1e-5


def test_a_step_whose_mask_does_not_fit_the_cache_is_refused(tiny_inplace_artifact):
    runtime = open_runtime(tiny_inplace_artifact)
    config = open_artifact(tiny_inplace_artifact).config
    past = runtime.empty_past(1, config.n_head, config.d_head)
    with pytest.raises(ValueError, match="attention_mask has 4 columns; the cache holds 0 and the step adds 3"):
        runtime.run(np.ones((1, 3), np.int64), np.ones((1, 4), np.int64), np.zeros((1, 3), np.int64), past)


def test_the_engine_sizes_buffers_for_the_tokens_ahead_so_decode_never_grows_them(tiny_inplace_artifact):
    from kvserve.service.gate import _greedy_sequence
    from kvserve.service.padded_batch import PaddedBatch

    runtime = open_runtime(tiny_inplace_artifact)
    runner = PaddedBatch(runtime, open_artifact(tiny_inplace_artifact).config, max_rows=4)
    first = _greedy_sequence(1, list(range(1, 51)), 30)  # 50 + 30 columns: a 128-column buffer from the start
    runner.step([first])
    assert runner.past.capacity == 128
    buffer = runner.past.values[0].data_ptr()
    for _ in range(10):
        runner.step([])
        assert runner.past.values[0].data_ptr() == buffer  # written in place, never regrown
    second = _greedy_sequence(2, [7, 8, 9], 120)  # joins right-aligned at 60 columns, with 119 more ahead
    runner.step([second])
    assert runner.past.capacity == 256
    while not first.finished:
        runner.step([])
    # first left: the padding columns only it used are trimmed, and the buffer shrinks to what second needs
    assert [s.id for s in runner.rows] == [2] and runner.past.length == len(second.prompt_ids) + len(second.generated) - 1
    assert runner.past.capacity == inplace_capacity(runner.past.length + 120 - len(second.generated)) == 128


@pytest.fixture(scope="module")
def inplace_stub(tiny_inplace_artifact):
    server = start_server(tiny_inplace_artifact, max_batch_size=4, max_queue=64)
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.GenerationServiceStub(channel)
    server.stop()


def test_server_on_an_inplace_artifact_streams_the_eager_reference(inplace_stub, tiny_model):
    # Six streams through four rows: rows leave at different steps and queued ones join the running batch,
    # and the longest rows pass 64 and 128 columns, so buffers of several sizes are rebuilt on joins and leaves.
    prompts = [[(11 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((2, 9, 30, 47, 5, 60))]
    steps = [20, 90, 40, 70, 33, 75]

    def stream(k):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[k]), max_new_tokens=steps[k], ignore_eos=True)
        return collect(inplace_stub, request, timeout=120)[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(stream, range(len(prompts))))
    eager = [generate(tiny_model, [p], n).tokens[0].tolist() for p, n in zip(prompts, steps)]
    assert together == eager


def test_model_info_names_the_layout_and_counts_the_whole_buffer(inplace_stub, tiny_model):
    config = tiny_model.config
    info = inplace_stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.kv_cache == "inplace" and info.parity_gate.passed
    stream = inplace_stub.Generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_new_tokens=100, ignore_eos=True), timeout=60
    )
    next(stream)
    (seq,) = inplace_stub.GetModelInfo(pb.GetModelInfoRequest()).live.sequences
    capacity = 128  # the buffer holds the 3 prompt tokens and the 100 ahead
    assert seq.kv_cache_bytes == capacity * 2 * config.n_layer * config.n_head * config.d_head * 4
    stream.cancel()


def test_the_contract_check_refuses_a_manifest_that_misnames_the_layout(tiny_concat_artifact, tmp_path):
    import json
    import shutil

    from kvserve.service.gate import contract_problems

    copy = tmp_path / "copy"
    shutil.copytree(tiny_concat_artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["kv_cache"] = "inplace"  # the graph is a concat one
    (copy / "manifest.json").write_text(json.dumps(manifest))
    artifact = open_artifact(copy)
    problems = contract_problems(open_runtime(copy), artifact)
    assert problems == [
        "graph inputs are ['input_ids', 'attention_mask', 'position_ids', 'past_key_values.0.key']..., "
        "expected ['input_ids', 'attention_mask', 'position_ids', 'cache_position']..."
    ]
