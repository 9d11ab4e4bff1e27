"""Trace the eager decoder into one ONNX graph whose KV cache is explicit graph I/O (see io_contract)."""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
from torch import nn
from torch.export import Dim

from kvserve.contract import io_contract as io
from kvserve.contract.config import LLAMA_ARCH
from kvserve.contract.artifact import MODEL_DATA_FILE, MODEL_FILE
from kvserve.model.decoders import Decoder
from kvserve.model.fused_attention import supports_fused_attention
from kvserve.model.kv_storage import STORED_TYPES, store_kv_as, stored_dtype
from kvserve.model.weights import WeightSource, parameter, skeleton

from .fused_graph import declare_operators, expand_rows_and_chunk_attention, fused_write_problems, rows_and_chunk_placeholder
from .weight_plan import PENDING, WeightPlan, materialize, weight_bytes, write_external

OPSET = 18
# onnxruntime 1.31 refuses the IR version onnx 1.23 writes by default (14); 10 covers opset 18.
IR_VERSION = 10
# Above this many bytes of weights the graph keeps them in model.onnx.data (protobuf caps files at 2 GiB).
EXTERNAL_DATA_THRESHOLD = 64 * 2**20

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class _FlatSignature(nn.Module):
    """(input_ids, attention_mask, position_ids, past) -> (logits, present): the concat graph's signature."""

    def __init__(self, model: Decoder):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, past_key_values):
        logits, presents = self.model(input_ids, attention_mask, position_ids, list(past_key_values))
        return logits, tuple(presents)


class _SlotsSignature(_FlatSignature):
    """The `slots` step: (decode tokens, chunk, logits_index, row pool) -> (logits, greedy tokens, pool written in place)."""

    def _step(self, logits: torch.Tensor) -> tuple:
        """(K, V) logits -> the step's outputs before the K/V: the logits and each row's argmax (K,).
        Spelled as a top-1 (ONNX TopK, the lower index first on a tie, as ArgMax and numpy): ONNX Runtime's CPU ArgMax
        took 0.41 ms over 16 x 50,257 logits where TopK took 0.16-0.17 (bench/results/cpu-2core.md, 2-core Xeon VM)."""
        return logits, logits.topk(1, dim=-1).indices.squeeze(-1)

    def forward(self, input_ids, position_ids, attention_mask, chunk_ids, chunk_position_ids, chunk_attention_mask, chunk_slot,
                logits_index, past_key_values, *long_rope):
        logits, presents = self.model.forward_slots(
            input_ids, position_ids, attention_mask, chunk_ids, chunk_position_ids, chunk_attention_mask, chunk_slot, logits_index,
            list(past_key_values), *long_rope,
        )
        return *self._step(logits), tuple(presents)


class _FusedSlotsSignature(_SlotsSignature):
    """The fused `slots` step: (rows' new tokens, chunk, logits_index, rows, chunk row) -> (logits, both written)."""

    def forward(self, input_ids, position_ids, chunk_ids, chunk_position_ids, logits_index, past_key_values, chunk_key_values, *long_rope):
        logits, presents, chunk_presents = self.model.forward_slots_fused(
            input_ids, position_ids, chunk_ids, chunk_position_ids, logits_index, list(past_key_values), list(chunk_key_values), *long_rope
        )
        return *self._step(logits), tuple(presents), tuple(chunk_presents)


def _fused_example_inputs(model: Decoder, dtype: torch.dtype):
    config = model.config
    batch, tokens, chunk, capacity, n_logits = 2, 3, 4, 9, 5
    step = (
        torch.zeros(batch, tokens, dtype=torch.int64),
        torch.tensor([[3, 4, 5], [4, 5, 6]], dtype=torch.int64),
        torch.zeros(1, chunk, dtype=torch.int64),
        torch.arange(chunk, dtype=torch.int64)[None],
        torch.arange(n_logits, dtype=torch.int64),
    )
    rows = (batch, config.n_kv_head, capacity, config.d_head)  # (B, H_kv, C, d_k)
    row = (1, config.n_kv_head, capacity, config.d_head)  # (1, H_kv, C, d_k)
    kv = tuple((torch.zeros(rows, dtype=dtype), torch.zeros(rows, dtype=dtype)) for _ in range(config.n_layer))
    chunk_kv = tuple((torch.zeros(row, dtype=dtype), torch.zeros(row, dtype=dtype)) for _ in range(config.n_layer))
    return step + (kv, chunk_kv)


def fused_attention_refusal(model: Decoder, kv_cache: str) -> str | None:
    """Why model cannot be exported with fused attention, or None when it can."""
    config = model.config
    if kv_cache != io.SLOTS:
        return f"fused attention is a slots KV cache graph (got --kv-cache {kv_cache})"
    if not hasattr(model, "forward_slots_fused"):
        return f"fused attention is not written for {config.model_type}"
    if not supports_fused_attention(config.head_dim):
        return f"fused attention needs head_dim a multiple of 16 (ONNX Runtime's GroupQueryAttention); this model's is {config.head_dim}"
    if config.architecture == LLAMA_ARCH and not supports_fused_attention(config.head_dim, config.rotary_dim):
        return (f"fused attention needs the rotated channels a multiple of 16 (ONNX Runtime's GroupQueryAttention); this model turns "
                f"{config.rotary_dim} of its {config.head_dim}")
    return None


def _slots_example_inputs(model: Decoder, dtype: torch.dtype):
    # Distinct sizes of 2 and more for every axis, so the tracer neither specialises nor merges them.
    config = model.config
    batch, width, chunk, chunk_width, capacity, n_logits = 2, 5, 3, 6, 9, 4
    kv_shape = (batch, config.n_kv_head, capacity, config.d_head)  # (B, H_kv, C, d_k)
    step = (
        torch.zeros(batch, 1, dtype=torch.int64),
        torch.tensor([[3], [4]], dtype=torch.int64),
        torch.ones(batch, width, dtype=torch.int64),
        torch.zeros(1, chunk, dtype=torch.int64),
        torch.arange(chunk, dtype=torch.int64)[None],
        torch.ones(1, chunk_width, dtype=torch.int64),
        torch.tensor([1], dtype=torch.int64),
        torch.arange(n_logits, dtype=torch.int64),
    )
    rings = config.ring_columns()
    shapes = [kv_shape[:2] + (rings[layer],) + kv_shape[3:] if layer in rings else kv_shape for layer in range(config.n_layer)]  # ring rows: fixed
    kv = tuple((torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for shape in shapes)
    return step + (kv,)


def _concat_example_inputs(model: Decoder, dtype: torch.dtype):
    # Sizes of 2 and more keep every axis symbolic while tracing (0 and 1 would be specialised);
    # the graph still runs with a zero-length past, which the parity checks exercise.
    config = model.config
    batch, seq, past = 2, 3, 4
    kv_shape = (batch, config.n_kv_head, past, config.d_head)  # (B, H_kv, P, d_k)
    step = (
        torch.zeros(batch, seq, dtype=torch.int64),
        torch.ones(batch, past + seq, dtype=torch.int64),  # (B, P + T)
        torch.zeros(batch, seq, dtype=torch.int64),
    )
    kv = tuple((torch.zeros(kv_shape, dtype=dtype), torch.zeros(kv_shape, dtype=dtype)) for _ in range(config.n_layer))
    return step + (kv,)


def _name_axes(model_proto: onnx.ModelProto, spec: dict) -> None:
    """Replace the exporter's invented axis names (s17, 's59 + s70') with the contract's, checking fixed sizes."""
    for values, expected in ((model_proto.graph.input, spec["inputs"]), (model_proto.graph.output, spec["outputs"])):
        for value in values:
            dims = value.type.tensor_type.shape.dim
            want = expected[value.name]["shape"]
            if len(dims) != len(want):
                raise RuntimeError(f"exported {value.name} has rank {len(dims)}, contract says {len(want)}")
            for dim, axis in zip(dims, want):
                if isinstance(axis, str):
                    dim.dim_param = axis
                elif dim.HasField("dim_value") and dim.dim_value != axis:
                    raise RuntimeError(f"exported {value.name} has a dimension {dim.dim_value}, contract says {axis}")


def inplace_write_problems(graph: onnx.GraphProto, n_layer: int, attention: str = io.STANDARD) -> list[str]:
    """Why the graph is unsafe to run with each present bound to its past's memory; [] when it is safe.

    Safe means: present.{i} is produced by the operator that writes in place, reading past.{i} itself (so ONNX
    Runtime skips the copy when the buffers coincide): a ScatterND whose data input it is; and nothing else reads
    past.{i}'s values unless the write depends on what it read (a reader scheduled after the write would see this
    step's K/V; a ring layer's chunk reads its row before the write, model/attention.py ring_attention). Reading only
    its shape is harmless. A fused graph's writers sit inside each layer's If: fused_graph.fused_write_problems.
    """
    if attention == io.FUSED:
        return fused_write_problems(graph, n_layer)
    producers = {out: node for node in graph.node for out in node.output}
    problems = []
    for layer in range(n_layer):
        for past, present in zip(io.past_names(layer), io.present_names(layer)):
            writer = producers.get(present)
            if writer is None or writer.op_type != "ScatterND" or writer.input[0] != past or writer.output[0] != present:
                problems.append(f"{present} is not a ScatterND into {past}")
                continue
            before = _ancestors(writer, producers)
            views = {past}  # past and what ONNX Runtime may hand on as the same memory (a reshape of it)
            for node in graph.node:
                if node.op_type in VIEW_OPS and node.input and node.input[0] in views:
                    views.add(node.output[0])
            readers = [n.op_type for n in graph.node if views & set(n.input) and n is not writer and n.op_type != "Shape"
                       and n.op_type not in VIEW_OPS and id(n) not in before]
            if readers:
                problems.append(f"{past} is also read by {', '.join(readers)}, not before the write")
    return problems


# Operators whose output ONNX Runtime may place in their input's memory: a reader of one reads the input.
VIEW_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")


def _ancestors(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto]) -> set[int]:
    """ids of the nodes node's inputs are computed from, however far back."""
    seen: set[int] = set()
    waiting = [node]
    while waiting:
        for name in waiting.pop().input:
            producer = producers.get(name)
            if producer is not None and id(producer) not in seen:
                seen.add(id(producer))
                waiting.append(producer)
    return seen


def trace_graph(model: Decoder, dtype: str, kv_cache: str = io.SLOTS, attention: str = io.STANDARD,
                kv_dtype: str | None = None) -> tuple[onnx.ModelProto, dict]:
    """Trace model in dtype with the kv_cache layout and attention, K/V stored as kv_dtype (the model's dtype when None;
    else model's cache must store them so: kv_storage.store_kv_as): the graph with its weights in it, checked against the
    contract, and the manifest's facts about it (save_graph writes it). The graph holds a copy of every weight beside the
    model's (the tests' whole-model reference and the benchmarks' way); trace_streamed holds none."""
    return _trace(copy.deepcopy(model).to(TORCH_DTYPES[dtype]).eval(), dtype, kv_cache, attention, kv_dtype)  # the caller keeps its float32 reference


def trace_streamed(weights: WeightSource, dtype: str, kv_cache: str = io.SLOTS, attention: str = io.STANDARD,
                   kv_dtype: str | None = None, kv_scales: tuple | None = None) -> tuple[onnx.ModelProto, dict, WeightPlan]:
    """trace_graph without the weights: a skeleton of weights.config (kv_scales: int8 K/V's) is traced with fake
    parameters, and every weight becomes a pending initializer (weight_plan.py) that save_graph writes from weights a
    block of rows at a time. The exporter's optimizer still sees the values it folds or compares (small tensors only:
    it skips what is larger than a few thousand elements), read from weights as it asks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    kv_dtype = kv_dtype or dtype
    model = skeleton(weights.config, TORCH_DTYPES[dtype])
    store_kv_as(model, None if kv_dtype == dtype else kv_dtype, *(kv_scales or ()))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                fake = fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, param.data, torch.device("cpu"))
                module._parameters[name] = nn.Parameter(fake, requires_grad=False)
    plan = WeightPlan(weights)
    np_dtype, keys = np.dtype(dtype), set(weights.keys())

    def lazy_weights(program) -> None:
        """The fake parameters' initializers read from weights when the optimizer asks for their values."""
        for value in program.model.graph.initializers.values():
            key = value.name.removeprefix(SIGNATURE_PREFIX)
            if key in keys:
                value.const_value = ir.LazyTensor(lambda key=key: ir.tensor(parameter(weights, key).numpy().astype(np_dtype)),
                                                  dtype=value.const_value.dtype, shape=value.const_value.shape, name=value.name)
                value.const_value.kvserve_key = key

    proto, facts = _trace(model, dtype, kv_cache, attention, kv_dtype, lazy_weights, plan)
    return proto, facts, plan


SIGNATURE_PREFIX = "model."  # the exported initializers' names are the signature module's, whose decoder is .model


def _pending_weights(program, plan: WeightPlan) -> None:
    """Every matrix still read lazily after the optimizer: pending, its bytes the plan's. Vectors (biases, norms) are
    read now and kept in the graph: ONNX Runtime's fusions look at a bias's values, and they are small."""
    for value in program.model.graph.initializers.values():
        key = getattr(value.const_value, "kvserve_key", None)
        if key is not None and len(value.const_value.shape) <= 1:
            value.const_value = ir.tensor(value.const_value.numpy(), name=value.name)
        elif key is not None:
            tensor = value.const_value
            value.const_value = ir.ExternalTensor(PENDING, offset=None, length=None, dtype=tensor.dtype, shape=tensor.shape, name=value.name)
            plan.parameter(value.name, key, np.dtype(tensor.dtype.numpy()))


def _trace(model: Decoder, dtype: str, kv_cache: str, attention: str, kv_dtype: str | None, lazy_weights=None,
           plan: WeightPlan | None = None) -> tuple[onnx.ModelProto, dict]:
    if attention == io.FUSED and (refusal := fused_attention_refusal(model, kv_cache)):
        raise ValueError(refusal)
    kv_dtype = kv_dtype or dtype
    if (refusal := io.kv_dtype_refusal(kv_dtype, dtype, kv_cache)) is not None:
        raise ValueError(refusal)
    if stored_dtype(model) != (None if kv_dtype == dtype else STORED_TYPES[kv_dtype]):
        raise ValueError(f"the model's cache stores K/V as {stored_dtype(model)}, not {kv_dtype}: kv_storage.store_kv_as first")
    config = model.config
    torch_dtype = TORCH_DTYPES[dtype]
    kv_torch_dtype = STORED_TYPES[kv_dtype]
    n_layer = config.n_layer
    dynamic = Dim.DYNAMIC
    step_axes = {name: {0: dynamic, 1: dynamic} for name in ("input_ids", "attention_mask", "position_ids")}
    kv_axes = tuple(({0: dynamic, 2: dynamic}, {0: dynamic, 2: dynamic}) for _ in range(n_layer))
    translations = {}
    # A longrope model's slots step takes which factors each row and the chunk turn by (io_contract), after the K/V.
    long_rope = config.long_rope_after is not None
    rope_example = (torch.tensor([0, 1], dtype=torch.int64), torch.tensor([1], dtype=torch.int64)) if long_rope and kv_cache == io.SLOTS else ()
    rope_axes = {"long_rope": ({0: dynamic}, None)} if rope_example else {}
    if attention == io.FUSED:
        declare_operators()
        translations = {torch.ops.kvserve.rows_and_chunk_attention.default: rows_and_chunk_placeholder}
        signature, example = _FusedSlotsSignature(model), _fused_example_inputs(model, kv_torch_dtype)
        dynamic_shapes = {
            "input_ids": step_axes["input_ids"], "position_ids": step_axes["position_ids"], "chunk_ids": {1: dynamic},
            "chunk_position_ids": {1: dynamic}, "logits_index": {0: dynamic}, "past_key_values": kv_axes,
            "chunk_key_values": tuple(({2: dynamic}, {2: dynamic}) for _ in range(n_layer)),
        }
    elif kv_cache == io.CONCAT:
        signature, example = _FlatSignature(model), _concat_example_inputs(model, torch_dtype)
        dynamic_shapes = {**step_axes, "past_key_values": kv_axes}
    else:
        signature, example = _SlotsSignature(model), _slots_example_inputs(model, kv_torch_dtype)
        rings = set(config.ring_layers())  # a ring row's width is fixed: the ring and its scratch column
        kv_axes = tuple(({0: dynamic}, {0: dynamic}) if layer in rings else axes for layer, axes in enumerate(kv_axes))
        dynamic_shapes = {
            "input_ids": {0: dynamic}, "position_ids": {0: dynamic}, "attention_mask": {0: dynamic, 1: dynamic},
            "chunk_ids": {1: dynamic}, "chunk_position_ids": {1: dynamic}, "chunk_attention_mask": {1: dynamic}, "chunk_slot": None,
            "logits_index": {0: dynamic}, "past_key_values": kv_axes,
        }
    example, dynamic_shapes = example + rope_example, dynamic_shapes | rope_axes
    input_names, output_names = io.input_names(n_layer, kv_cache, attention, long_rope), io.output_names(n_layer, kv_cache, attention)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's deprecation chatter is not the user's concern
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        program = torch.onnx.export(
            signature,
            example,
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            input_names=None if lazy_weights else input_names,
            output_names=None if lazy_weights else output_names,
            opset_version=OPSET,
            custom_translation_table=translations,
            verbose=False,
            optimize=lazy_weights is None,
        )
        if lazy_weights is not None:  # the exporter's own optimisation and naming, in its order, once the weights it may read are readable
            from torch.onnx._internal.exporter import _ir_passes

            lazy_weights(program)
            for chatty in ("onnx_ir", "onnxscript"):  # a line per deduplicated or skipped constant at INFO
                logging.getLogger(chatty).setLevel(logging.WARNING)
            program.optimize()
            _ir_passes.rename_inputs(program.model, input_names)
            _ir_passes.rename_outputs(program.model, output_names)
            _pending_weights(program, plan)
    model_proto = program.model_proto
    if attention == io.FUSED:
        expand_rows_and_chunk_attention(model_proto, dtype, kv_dtype)
    ring = config.kv_ring if kv_cache == io.SLOTS and attention == io.STANDARD else None
    rings = {} if ring is None else config.ring_columns()
    spec = io.io_spec(n_layer, config.n_kv_head, config.d_head, config.vocab_size, dtype, kv_cache, attention, kv_dtype, long_rope, rings)
    _name_axes(model_proto, spec)
    if ring is not None:
        entry = model_proto.metadata_props.add()
        entry.key, entry.value = io.SCRATCH_POSITION, str(config.n_ctx)
    if kv_cache == io.SLOTS:
        problems = inplace_write_problems(model_proto.graph, n_layer, attention)
        if problems:  # the exporter changed how it spells the write; serving this graph would corrupt the cache
            raise RuntimeError("the slots KV cache graph cannot be written in place: " + "; ".join(problems[:3]))
    return model_proto, {"opset": OPSET, "ir_version": IR_VERSION, "kv_cache": kv_cache, "attention": attention, "kv_ring": ring, **spec}


def save_graph(model_proto: onnx.ModelProto, directory: Path, plan: WeightPlan | None = None) -> bool:
    """Write directory/model.onnx (weights in model.onnx.data when large, the plan's pending ones produced as they are
    written) and check it; True when external."""
    model_proto.ir_version = IR_VERSION
    model_proto.producer_name = "kvserve"
    external = weight_bytes(model_proto, plan) > EXTERNAL_DATA_THRESHOLD
    path = directory / MODEL_FILE
    if external:
        write_external(model_proto, plan, directory / MODEL_DATA_FILE)
        onnx.save_model(model_proto, str(path))
    else:
        if plan is not None:
            materialize(model_proto, plan)
        onnx.save_model(model_proto, str(path), save_as_external_data=False)
    # Contrib ops (a quantized graph's com.microsoft.MatMulNBits) have no schema in onnx: skip its strict pass.
    contrib = any(op.domain == "com.microsoft" for op in model_proto.opset_import)
    onnx.checker.check_model(str(path), full_check=not contrib)
    return external
