"""Decode steps at fixed shapes (runtime/cuda_graphs.py): the bucketed shapes, a binding per (pool, rows, width) made
once, graph ids never shared, and a failed capture that ends capturing for the session. On the CPU provider the same
fixed shapes run uncaptured; graph ids are given as a capturing session gives them."""

import numpy as np
import pytest

from kvserve.contract.artifact import open_artifact
from kvserve.runtime import MIN_DECODE_WIDTH, DecoderRuntime, decode_shape, decode_shapes, pool_capacity

from ..conftest import PROVIDER


@pytest.mark.parametrize("rows, width, expected", [(1, 1, (1, MIN_DECODE_WIDTH)), (3, 65, (4, 128)), (5, 300, (8, 256)),
                                                   (12, 2, (12, MIN_DECODE_WIDTH))])
def test_a_decode_step_runs_at_the_next_powers_of_two_within_the_pool_and_the_context(rows, width, expected):
    assert decode_shape(rows, width, max_rows=12, n_ctx=256) == expected
    shapes = decode_shapes(12, 256)
    assert expected in shapes and shapes == sorted(shapes) and len(shapes) == 5 * 3  # rows 1, 2, 4, 8, 12 x widths 64, 128, 256


def standard_pool(artifact_dir, rows: int = 2):
    artifact = open_artifact(artifact_dir)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER)
    config = artifact.config
    return runtime, runtime.new_pool(rows, config.n_kv_head, config.d_head, pool_capacity(config))


def decode(runtime, pool, rows: int, width: int):
    scratch = pool.capacity - 1
    return runtime.run_decode(pool, np.arange(rows, dtype=np.int64), np.full(rows, scratch, np.int64), np.ones((rows, width), np.int64))


def test_each_shape_is_bound_once_and_a_capture_that_fails_ends_capturing(tiny_standard_artifact, monkeypatch):
    runtime, pool = standard_pool(tiny_standard_artifact)
    runtime.fixed_steps.captures = True  # as if the session had opened with enable_cuda_graph
    real_run = runtime.session.run_with_iobinding
    graph_runs = []

    def run(binding, run_options=None):
        graph = run_options.get_run_config_entry("gpu_graph_id") if run_options is not None else "-1"
        if graph != "-1":
            graph_runs.append(graph)
            raise RuntimeError("operation not permitted when stream is capturing")
        return real_run(binding, run_options)

    monkeypatch.setattr(runtime.session, "run_with_iobinding", run)
    first = decode(runtime, pool, 2, 64)
    assert graph_runs == ["1"] and not runtime.captures_decode  # one attempt, then uncaptured from then on
    assert "CUDA graph capture failed (operation not permitted" in runtime.cuda_graph_note
    second = decode(runtime, pool, 2, 64)
    assert graph_runs == ["1"] and first.greedy_tokens.tolist() == second.greedy_tokens.tolist()
    decode(runtime, pool, 1, 64)
    assert runtime.fixed_shapes(pool) == [(2, 64), (1, 64)]


def test_graph_ids_are_never_shared_and_a_released_pool_releases_its_graphs(tiny_standard_artifact, monkeypatch):
    runtime, pool = standard_pool(tiny_standard_artifact)
    other = runtime.new_pool(2, *pool.shape[1:2], pool.shape[3], pool.capacity)
    runtime.fixed_steps.captures = True
    monkeypatch.setattr(runtime.session, "run_with_iobinding", lambda binding, run_options=None: None)  # a replay stand-in
    released = []
    monkeypatch.setattr(runtime.session, "release_captured_graph", released.append)
    for target in (pool, other):
        for rows, width in ((1, 64), (2, 64)):
            decode(runtime, target, rows, width)
    ids = {p: [runtime.fixed_steps._steps[(p, *shape)].graph_id for shape in runtime.fixed_shapes(p)] for p in (pool, other)}
    assert len(set(ids[pool] + ids[other])) == 4
    runtime.release_pool(pool)
    assert sorted(released) == sorted(ids[pool]) and runtime.fixed_shapes(other) and not runtime.fixed_shapes(pool)
