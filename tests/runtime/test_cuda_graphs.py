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


def test_inputs_copied_to_the_device_land_before_a_fixed_shape_step_or_its_replay_reads_them(tiny_standard_artifact, tiny_model,
                                                                                             late_uploads, monkeypatch):
    """The fixed-shape steps write their inputs into device buffers bound once (a captured graph replays their
    addresses), by the same copies that may land after the call returns. Emulated on the CPU provider: each shape's
    input buffers bound as device values whose writes land only at the CUDA runtime's wait; rows joining, decoding at
    several shapes beside prompt chunks, then give the eager model's tokens."""
    from kvserve.contract import io_contract as io
    from kvserve.model.generate import generate
    from kvserve.runtime import step as step_module
    from kvserve.service.core.batch import SlotBatch
    from kvserve.service.core.scheduler import Scheduler
    from kvserve.service.process.gate import _greedy_sequence

    inputs = {"input_ids": io.INPUT_IDS, "position_ids": io.POSITION_IDS, "attention_mask": io.ATTENTION_MASK, "long_rope": io.LONG_ROPE}

    class DeviceInputs(step_module.FixedDecodeSteps):
        def _bind_fixed(self, pool, rows, width):
            self.device = "cpu"  # the pool, the logits and the tokens stay the CPU provider's
            step = super()._bind_fixed(pool, rows, width)
            self.device = "cuda"  # the inputs are the device's
            for field, name in inputs.items():
                if (host := getattr(step, field)) is not None:
                    setattr(step, field, late_uploads.value(host.numpy()))
                    step.binding.bind_ortvalue_input(name, getattr(step, field))
            return step

    monkeypatch.setattr(step_module, "FixedDecodeSteps", DeviceInputs)
    artifact = open_artifact(tiny_standard_artifact)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, "cpu")
    batch = SlotBatch(runtime, artifact.config, 3, fixed_decode=True)
    seqs = [_greedy_sequence(i, list(range(5 + i, 5 + i + 3 + 7 * i)), 5 + 30 * (i == 0)) for i in range(4)]
    Scheduler(batch, step_token_budget=8).drive(seqs)
    for seq in seqs:
        assert seq.generated == generate(tiny_model, [seq.prompt_ids], seq.max_new_tokens).tokens[0].tolist(), seq.id
    assert len(runtime.fixed_shapes(batch.pool)) >= 3  # rows joined and left: several shapes, each bound once
    assert late_uploads.waits and not late_uploads.on_the_way
