"""What keeps a step from being captured as a CUDA graph (export/cuda_placement.py), read from the graph without a GPU:
every family's standard slots graph computes nothing from shapes that a CUDA kernel reads as data, and the check names
the patterns ONNX Runtime's CUDA provider would copy to the device (an arange of a shape used as indices, shape
arithmetic mixed with a graph input) or cannot hold (a Range kernel, control flow). And what would fail a step on the
CUDA provider alone, read from runs on the CPU: no step of any graph the server runs hands a reduction an empty input,
and none writes a K/V cell twice in one scatter (which write wins is the CPU's last, CUDA's any)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import open_artifact
from kvserve.export.cuda_placement import capture_blockers, empty_reductions, repeated_writes, scatter_probe
from kvserve.export.onnx_export import IR_VERSION, trace_graph
from kvserve.model.decoders import build
from kvserve.runtime import DecoderRuntime, providers, step
from kvserve.service.core.batch import SlotBatch
from kvserve.service.core.scheduler import Scheduler
from kvserve.service.process.gate import _greedy_sequence

from ..conftest import PROVIDER
from ..service.conftest import random_prompt

from .test_streamed_export import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_familys_standard_slots_step_runs_whole_on_the_device(family, dtype):
    graph, _ = trace_graph(build(FAMILIES[family], seed=0), dtype, io.SLOTS, io.STANDARD)
    assert capture_blockers(graph) == []


def test_the_fused_graph_is_named_for_its_control_flow(tiny_llama_fused_artifact):
    blockers = capture_blockers(onnx.load(tiny_llama_fused_artifact / "model.onnx", load_external_data=False))
    assert blockers and all(line.startswith("If ") and line.endswith("control flow, which CUDA graphs cannot hold") for line in blockers), blockers


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
IDS = helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])
Y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)


def test_shape_arithmetic_that_ends_in_a_reshape_is_allowed():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Concat", ["s", "minus_one"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    model = _model(nodes, [X], [Y], [helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1])])
    assert capture_blockers(model) == []


def test_an_arange_of_a_shape_used_as_indices_is_named():
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=0, end=1), helper.make_node("Squeeze", ["s"], ["n"]),
             helper.make_node("Range", ["zero", "n", "one"], ["rows"]), helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Gather", ["r", "rows"], ["y"])]
    model = _model(nodes, [X], [Y], [helper.make_tensor("zero", TensorProto.INT64, [], [0]), helper.make_tensor("one", TensorProto.INT64, [], [1])])
    assert capture_blockers(model) == ["Range : its CUDA kernel copies its inputs to the host",
                                       "Gather : reads host tensor rows as data (a Memcpy to the device)"]


def test_shape_arithmetic_mixed_with_a_graph_input_is_named():
    ids_out = helper.make_tensor_value_info("z", TensorProto.INT64, None)
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1, end=2, name="width"), helper.make_node("Mul", ["ids", "s"], ["z"], name="cells")]
    assert capture_blockers(_model(nodes, [X, IDS], [ids_out])) == ["Mul cells: moved to the CPU with graph input ids (a copy to the host)"]


def test_a_device_only_type_keeps_the_node_on_the_device_and_its_host_input_is_copied():
    half = helper.make_tensor_value_info("h", TensorProto.FLOAT16, ["n", 4])
    nodes = [helper.make_node("Shape", ["h"], ["s"], start=0, end=1), helper.make_node("Cast", ["s"], ["c"], to=TensorProto.FLOAT16),
             helper.make_node("Mul", ["h", "c"], ["y"], name="scale")]
    assert capture_blockers(_model(nodes, [half], [Y])) == ["Mul scale: reads host tensor c as data (a Memcpy to the device)"]


def test_a_device_value_a_kernel_reads_from_host_memory_is_named():
    """GroupQueryAttention's total length, computed on the device as the fused step graph does (the longest row's),
    would be copied to the host mid-step; a graph input or host arithmetic from a shape is not."""
    lengths = helper.make_tensor_value_info("lengths", TensorProto.INT32, ["b"])
    nodes = [helper.make_node("ReduceMax", ["lengths"], ["longest"], keepdims=0), helper.make_node("Add", ["longest", "one"], ["total"]),
             helper.make_node("Reshape", ["x", "total"], ["y"], name="host_input")]
    model = _model(nodes, [X, lengths], [Y], [helper.make_tensor("one", TensorProto.INT32, [], [1])])
    assert capture_blockers(model) == ["Reshape host_input: reads device tensor total from host memory (a Memcpy to the host)"]


@pytest.fixture
def profiled(monkeypatch, tmp_path):
    """Every session opened while the test runs is profiled by ONNX Runtime; returns what ends them: their events."""
    opened = []

    def options(threads: int = 0) -> ort.SessionOptions:
        made = session_options(threads)
        made.enable_profiling, made.profile_file_prefix = True, str(tmp_path / "session")
        return made

    def recording(*args, **kwargs):
        result = open_session(*args, **kwargs)
        opened.append(result.session)
        return result

    session_options, open_session = providers.session_options, step.open_session
    monkeypatch.setattr(providers, "session_options", options)
    monkeypatch.setattr(step, "open_session", recording)
    return lambda: [event for session in opened for event in json.loads(Path(session.end_profiling()).read_text())]


def test_a_reduction_of_an_empty_input_is_named(tmp_path):
    """A sum of nothing: 0 on the CPU provider (ONNX's identity), a failed step on the CUDA provider; an arg-max over the
    rows of no rows is nothing on either."""
    nodes = [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0, name="count"), helper.make_node("ArgMax", ["x"], ["z"], axis=1, name="best")]
    model = _model(nodes, [X], [Y, helper.make_tensor_value_info("z", TensorProto.INT64, None)])
    model.ir_version = IR_VERSION
    onnx.save(model, tmp_path / "m.onnx")

    def profile(rows: int) -> list[dict]:
        options = providers.session_options()
        options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / f"rows-{rows}")
        session = ort.InferenceSession(str(tmp_path / "m.onnx"), options, providers=["CPUExecutionProvider"])
        total, _ = session.run(None, {"x": np.ones((rows, 4), np.float32)})
        session.run(None, {"x": np.ones((rows, 4), np.float32)})
        assert total == 4 * rows
        return json.loads(Path(session.end_profiling()).read_text())

    assert empty_reductions(profile(2)) == []
    assert empty_reductions(profile(0)) == ["ReduceSum count: reduces an empty input [0, 4] to a scalar, which the CUDA provider refuses"]


RINGS = ["mistral sliding window 7 head_dim 16", "gemma3 multi-query head_dim 32 qk-norm two bases linear-rope sliding 6"]
PHI3_LONGROPE = "phi3 gqa 2:1 head_dim 64 longrope partial 0.75 untied"


def run_every_step_kind(runtime: DecoderRuntime, config, crossing: bool = False) -> int:
    """Prompts alone, rows decoding alone and beside a chunk, through a batch of 3 rows, chunks of up to 30 tokens (longer
    than a ring of 7 + 16); crossing: a stream crosses the original context of a longrope model too (its row prefilled
    again, long, beside the others). Returns how many steps prefilled prompts together."""
    scheduler = Scheduler(SlotBatch(runtime, config, 3), step_token_budget=32)
    scheduler.waiting.extend(_greedy_sequence(i, random_prompt(700 + i, 2 + 7 * i), 12) for i in range(5))
    if crossing:
        scheduler.waiting.append(_greedy_sequence(5, random_prompt(705, config.long_rope_after - 4), 10))
    kinds, groups = set(), 0
    while scheduler.waiting or scheduler.kv.rows:
        plan = scheduler.plan()
        kinds.add((bool(plan.decode), bool(plan.chunk or plan.prompts)))
        groups += len(plan.prompts) > 1
        scheduler.run_step(plan)
    assert kinds == {(False, True), (True, False), (True, True)}  # prompts alone, rows decoding alone and beside one
    return groups


@pytest.mark.parametrize("graph", ["standard", "fused", "split", *RINGS])
def test_no_step_the_server_runs_hands_a_reduction_an_empty_input(graph, profiled, request, llama_artifact):
    """Prompts alone, rows decoding alone and beside a chunk (split: through the chunk and decode graphs, prompts
    prefilled together), on the CPU provider, each node's inputs as ONNX Runtime's profile records them: nothing the
    CUDA provider would refuse. (A ring graph counted its chunk with a sum that was empty in every step without one.)"""
    if graph == "standard":
        artifact_dir = request.getfixturevalue("tiny_standard_artifact")
    elif graph == "fused":
        artifact_dir = request.getfixturevalue("tiny_fused_artifact")
    elif graph == "split":
        artifact_dir = request.getfixturevalue("tiny_llama_fused_artifacts")("float16")
    else:
        artifact_dir = llama_artifact(graph, attention="standard")[2]
    artifact = open_artifact(artifact_dir)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER, chunk_graph=graph == "split" or None)
    groups = run_every_step_kind(runtime, artifact.config)
    assert groups or graph != "split"  # (under CUDA the fused graph's steps split too)
    events = profiled()
    assert sum(e.get("cat") == "Node" and e["args"].get("op_name", "").startswith("Reduce") for e in events)  # seen, and none empty:
    assert empty_reductions(events) == []


@pytest.fixture
def recorded_steps(monkeypatch):
    """Each standard step run while the test runs, as the graph sees it: (its session, its bound inputs and the shape of
    each past K/V it binds, copied when it runs)."""
    steps, pasts = [], {}
    bind_rows, run_sampled = DecoderRuntime._bind_rows, DecoderRuntime._run_sampled

    def binding_rows(self, bound, pool, past_names, present_names, row, count):
        pasts.setdefault(id(bound), {}).update({name: pool.value_shape(i, count) for i, name in enumerate(past_names)})
        return bind_rows(self, bound, pool, past_names, present_names, row, count)

    def running(self, bound, *args, **kwargs):
        steps.append((bound.session, {name: buffer.copy() for name, (buffer, _) in bound.inputs.items()}, dict(pasts[id(bound)])))
        return run_sampled(self, bound, *args, **kwargs)

    monkeypatch.setattr(DecoderRuntime, "_bind_rows", binding_rows)
    monkeypatch.setattr(DecoderRuntime, "_run_sampled", running)
    return steps


def test_a_cell_written_twice_by_one_scatter_is_named_unless_it_is_the_scratch_column():
    indices = np.array([[[0, 1, 3]], [[1, 1, 3]], [[0, 1, 3]], [[0, 0, 7]], [[0, 0, 7]]])  # (N, H_kv, 3)
    named = repeated_writes("write", indices, (2, 2, 8, 4))
    assert named == ("ScatterND write: writes 1 cell(s) of data [2, 2, 8, 4] more than once, e.g. [0, 1, 3], whose value the "
                     "CUDA provider leaves to chance")
    assert repeated_writes("write", indices[1:4], (2, 2, 8, 4)) is None and repeated_writes("write", indices[3:], (2, 2, 8, 4)) is None


@pytest.mark.parametrize("graph", ["standard", *RINGS, PHI3_LONGROPE])
def test_no_step_the_server_runs_writes_a_kv_cell_twice(graph, recorded_steps, request, llama_artifact, tmp_path):
    """Every step of every kind (and a longrope row prefilled again where it crosses its original context), its inputs
    replayed through the graph with each K/V scatter's indices as outputs: no cell but a row's scratch column written
    twice in one step. (The CPU provider keeps a scatter's last write to a cell, the CUDA provider any: a ring's chunk
    longer than the ring sends its overwritten tokens to the scratch column for that reason.)"""
    artifact_dir = request.getfixturevalue("tiny_standard_artifact") if graph == "standard" else llama_artifact(graph, attention="standard")[2]
    artifact = open_artifact(artifact_dir)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, "cpu")
    run_every_step_kind(runtime, artifact.config, crossing=graph == PHI3_LONGROPE)
    probe, scatters = scatter_probe(onnx.load(artifact.model_path))
    assert len(scatters) >= 2 * artifact.config.n_layer  # every layer's K and V
    onnx.save(probe, tmp_path / "probe.onnx", save_as_external_data=True)
    session = ort.InferenceSession(str(tmp_path / "probe.onnx"), providers.session_options(), providers=["CPUExecutionProvider"])
    wanted = [name for _, indices, shape in scatters for name in (indices, shape)]
    steps = [(inputs, pasts) for ran, inputs, pasts in recorded_steps if ran is runtime.session]
    assert len(steps) >= 20
    refilled = [inputs for inputs, _ in steps if inputs.get(io.CHUNK_LONG_ROPE, [0])[0] and inputs[io.CHUNK_POSITION_IDS].flat[0] == 0]
    assert bool(refilled) == (graph == PHI3_LONGROPE)  # the crossing row's prefill again, long, from its first column
    if graph in RINGS:  # a chunk longer than its ring: its first tokens are overwritten by its later ones
        assert max(inputs[io.CHUNK_IDS].size for inputs, _ in steps) > artifact.config.kv_ring
    problems = set()
    for inputs, pasts in steps:
        feeds = {**inputs, **{name: np.zeros(shape, runtime.kv_dtype) for name, shape in pasts.items()}}
        values = dict(zip(wanted, session.run(wanted, feeds)))
        problems |= {repeated_writes(node, values[indices], values[shape]) for node, indices, shape in scatters} - {None}
    assert not problems, sorted(problems)
