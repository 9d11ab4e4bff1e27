"""Operator fusions (export/graph_fusions.py): the trained model's graph, fused and not, gives the same numbers from
real ONNX Runtime sessions, with the GELUs and residual LayerNorms fused and the projections' biases folded in."""

from __future__ import annotations

import collections
import copy

import numpy as np
import onnx
import pytest

from kvserve.contract import io_contract as io
from kvserve.export.graph_fusions import fuse_operators, sort_nodes
from kvserve.export.onnx_export import save_graph, trace_graph
from kvserve.runtime.pool import pool_capacity
from kvserve.runtime.step import DecoderRuntime

from ..conftest import PROVIDER


def chunk_logits(directory, config, dtype: str = "float32") -> np.ndarray:
    """Logits at every position of a 40-token prompt chunk, then of one decode step beside nothing."""
    runtime = DecoderRuntime(directory / "model.onnx", config.n_layer, dtype, PROVIDER)
    pool = runtime.new_pool(1, config.n_kv_head, config.head_dim, pool_capacity(config))
    prompt = np.arange(7, 47, dtype=np.int64) % config.vocab_size
    scratch = np.array([pool.capacity - 1])
    prefill = runtime.run_slots(pool, np.zeros(1, np.int64), scratch, np.ones((1, 1), np.int64), prompt, 0, 0, 1 + np.arange(len(prompt))).logits
    decode = runtime.run_slots(pool, np.array([5]), np.array([len(prompt)]), np.ones((1, len(prompt) + 1), np.int64), np.zeros(0, np.int64), 0,
                               0, np.array([0])).logits
    return np.concatenate([prefill, decode])  # (41, V)


@pytest.mark.parametrize("attention", [io.FUSED, io.STANDARD])
def test_fused_operators_change_no_number_of_the_trained_model(trained_model, tmp_path, attention):
    plain, _ = trace_graph(trained_model, "float32", io.SLOTS, attention)
    fused = copy.deepcopy(plain)
    counts = fuse_operators(fused)
    layers = trained_model.config.n_layer
    # every GELU; every residual LayerNorm but the first layer's (its Add is the embedding sum, not a residual)
    assert counts == {"FastGelu": layers, "SkipLayerNormalization": 2 * layers - 1}
    ops = collections.Counter(n.op_type for n in fused.graph.node)
    assert ops["Tanh"] == ops["Pow"] == 0 and ops["Add"] <= collections.Counter(n.op_type for n in plain.graph.node)["Add"] // 2
    # the projections' biases are added inside the fused kernels that read them, the fused attention's slots step's
    # Gemms' included (CUDA's Gemm spends a GEMM of its own on a bias): all but Q/K/V's and the last layer's MLP output's
    biased = [[n for n in graph.graph.node if n.op_type == "Gemm" and len(n.input) > 2 and n.input[2]] for graph in (plain, fused)]
    assert (len(biased[0]), len(biased[1])) == ((4 * layers, layers + 1) if attention == io.FUSED else (0, 0))
    assert all(len(n.input) == 2 for n in fused.graph.node if n.op_type == "FastGelu")
    assert sum(len(n.input) == 5 and bool(n.input[4]) for n in fused.graph.node if n.op_type == "SkipLayerNormalization") == 2 * layers - 1
    for name, graph in (("plain", plain), ("fused", fused)):
        (tmp_path / name).mkdir()
        save_graph(graph, tmp_path / name)  # onnx's checker passes: the nodes are in order, branches' outer reads included
    want, got = chunk_logits(tmp_path / "plain", trained_model.config), chunk_logits(tmp_path / "fused", trained_model.config)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_sort_nodes_puts_an_if_after_what_its_branches_read():
    h = onnx.helper
    branch = h.make_graph([h.make_node("Identity", ["late"], ["out"])], "branch", [], [h.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)])
    nodes = [
        h.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch),  # reads "late" from the outer graph
        h.make_node("Relu", ["x"], ["late"]),
    ]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info(n, t, None) for n, t in (("cond", onnx.TensorProto.BOOL), ("x", onnx.TensorProto.FLOAT))],
                         [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    sort_nodes(graph)
    assert [n.op_type for n in graph.node] == ["Relu", "If"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_float16_norms_become_single_operators_and_keep_the_numbers(trained_model, tiny_llama_model, tmp_path, family):
    model = trained_model if family == "gpt2" else tiny_llama_model
    plain, _ = trace_graph(model, "float16", io.SLOTS, io.FUSED)
    fused = copy.deepcopy(plain)
    counts = fuse_operators(fused, float16=True)
    layers = model.config.n_layer
    # Every residual norm fused with its Add but the first layer's (its Add reads the embedding Gather); the first and
    # the final norm (after the sampled rows' Gather) stand alone. Llama's RMSNorm keeps its float16 weight multiply inside.
    if family == "gpt2":
        assert counts == {"FastGelu": layers, "SkipLayerNormalization": 2 * layers - 1, "LayerNormalization": 2,
                          "SimplifiedLayerNormalization": 0, "SkipSimplifiedLayerNormalization": 0}
    else:
        assert counts == {"FastGelu": 0, "SkipLayerNormalization": 0, "LayerNormalization": 0,
                          "SimplifiedLayerNormalization": 3, "SkipSimplifiedLayerNormalization": 2 * layers - 2}
    ops = collections.Counter(n.op_type for n in fused.graph.node)
    assert ops["Pow"] == ops["Sqrt"] == ops["ReduceMean"] == 0
    # no float32 round trip is left around a norm: nothing a norm reads or writes passes through a Cast, its weights are float16
    norms = [n for n in fused.graph.node if n.op_type.endswith("LayerNormalization")]
    cast_ends = {name for n in fused.graph.node if n.op_type == "Cast" for name in (*n.input, *n.output)}
    assert norms and not cast_ends & {name for n in norms for name in (*n.input, *n.output)}
    weights = {t.name: t.data_type for t in fused.graph.initializer}
    assert {weights[name] for n in norms for name in n.input if name in weights} == {onnx.TensorProto.FLOAT16}
    for name, graph in (("plain", plain), ("fused", fused)):
        (tmp_path / name).mkdir()
        save_graph(graph, tmp_path / name)  # the checker knows SimplifiedLayerNormalization (declared)
    want = chunk_logits(tmp_path / "plain", model.config, "float16")
    got = chunk_logits(tmp_path / "fused", model.config, "float16")
    assert np.abs(got - want).max() <= 0.01 * np.abs(want).max()  # the float16 bound (contract/tolerances.py)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95
