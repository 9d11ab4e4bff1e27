"""Decode steps at fixed shapes, captured as CUDA graphs (`serve --cuda-graph`).

A decode-only step of a standard slots graph runs at a bucketed (rows, width) shape (decode_shape: each the next
power of two, width at least MIN_DECODE_WIDTH), its inputs written into device buffers bound once per shape; each
shape is its own graph id, captured by ONNX Runtime at its first run and replayed after; every other run says
gpu_graph_id -1 (never captured). A captured graph belongs to the thread that captured it: the server runs the gate,
the warm-up (which captures every shape) and every step on one thread. If a capture fails, capturing ends for the
session: the failure is noted (cuda_graph_note) and steps run uncaptured. On the CPU provider the same fixed shapes
run uncaptured (how the tests drive this path without a GPU).

A fused artifact's decode steps run its decode graph (export/decode_graph.py: the step graph without the If that
no capture holds), in a session of its own: it reads each row's own length, so a shape is its row count alone.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from kvserve.contract import io_contract as io

from .pool import KvTraffic, SlotPool, settle_uploads
from .providers import first_line, run_bound
from .sampled import Sampled

log = logging.getLogger(__name__)

# The run option naming the CUDA graph a run captures or replays; -1: neither. A graph id's first run captures it
# (ONNX Runtime repeats that run internally until its CUDA provider's warm-up runs are done), into the context of
# the calling thread: a run of the same id from another thread would capture it again, there.
GRAPH_ID = "gpu_graph_id"
# The narrowest width a fixed-shape decode step reads: every width is one more shape to bind and capture, and from
# 64 up a 1,024-token context has five.
MIN_DECODE_WIDTH = 64


def power_of_two_at_least(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= n, and at least minimum: how fixed decode shapes are bucketed."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def decode_shape(rows: int, width: int, max_rows: int, n_ctx: int) -> tuple[int, int]:
    """The fixed (rows, width) a decode-only step over rows rows, reading width columns, runs at: each the next power
    of two (width at least MIN_DECODE_WIDTH), at most the pool's rows and the context. So a 16-row pool of a
    1,024-token context runs decode steps at 5 x 5 shapes, each bound (and captured) once."""
    return min(power_of_two_at_least(rows), max_rows), min(power_of_two_at_least(width, MIN_DECODE_WIDTH), n_ctx)


def decode_shapes(max_rows: int, n_ctx: int) -> list[tuple[int, int]]:
    """Every shape decode_shape can return for a pool of max_rows rows and an n_ctx context, smallest first."""
    row_counts = sorted({decode_shape(n, 1, max_rows, n_ctx)[0] for n in range(1, max_rows + 1)})
    widths = sorted({decode_shape(1, w, max_rows, n_ctx)[1] for w in range(1, n_ctx + 1)})
    return [(rows, width) for rows in row_counts for width in widths]


@dataclass
class FixedDecode:
    """A decode step's inputs and logits at one shape, in buffers on the session's device, bound once: each step
    writes its inputs into the same memory (a captured CUDA graph replays the addresses it was captured with)."""

    binding: object
    input_ids: object  # OrtValue (B, 1)
    position_ids: object  # OrtValue (B, 1)
    attention_mask: object | None  # OrtValue (B, W); None: a fused decode graph reads each row's own length
    logits: object  # OrtValue (B, V) float32
    greedy_tokens: object  # OrtValue (B,) int64
    run_options: object  # names the CUDA graph, when captured
    graph_id: int | None
    host_arrays: list  # on the CPU provider, the numpy memory behind the OrtValues: kept alive with them
    captured: bool = False
    long_rope: object | None = None  # OrtValue (B,): a longrope graph's rows' choice of factors (io_contract)


class FixedDecodeSteps:
    """A runtime's decode steps at fixed shapes (DecoderRuntime owns one): their buffers and bindings per (pool, rows,
    width), and whether the session still captures them as CUDA graphs."""

    def __init__(self, session, attention: str, device: str, kv_dtype, vocab_size: int, kv_names: tuple[list[str], list[str]],
                 traffic: KvTraffic, captures: bool, cuda_graph_note: str | None, uncaptured: ort.RunOptions):
        """kv_names: every layer's past and present names, in the pool's order; captures: the session captures CUDA graphs
        (cuda_graph_note: why not, when they were asked for); uncaptured: the run options of a step never captured."""
        self.session, self.attention, self.device, self.kv_dtype, self.vocab_size = session, attention, device, kv_dtype, vocab_size
        self.traffic = traffic
        self._past_names, self._present_names = kv_names
        self.captures, self.cuda_graph_note, self._uncaptured = captures, cuda_graph_note, uncaptured
        self._steps: dict[tuple, FixedDecode] = {}  # (pool, rows, width) -> its buffers
        self._graph_ids = itertools.count(1)  # never reused: a captured graph holds its buffers' addresses

    def run(self, pool: SlotPool, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray | None,
            with_logits: bool = True, before_run: Callable[[], None] | None = None, long_rope: np.ndarray | None = None) -> Sampled:
        """A decode-only step at a fixed shape: rows 0..B-1 of the pool decode input_ids (B,) at position_ids (B,),
        reading attention_mask (B, W) of a standard slots graph (a fused artifact's decode graph reads none: None, one
        shape per B); no chunk, logits for every row. The inputs go into device
        buffers bound once per (pool, B, W) and, when the session captures (captures), the step is a CUDA graph
        of its own, captured at its first run and replayed after. Returns every row's greedy token (B,) and, with_logits,
        its logits (B, V), in host memory: on the CPU provider the bound
        buffers themselves, which the next step at this shape overwrites (read them before then). long_rope (B,): a
        longrope graph's rows that turn long (None: none)."""
        rows, width = (len(input_ids), 0) if attention_mask is None else attention_mask.shape
        step = self._steps.get((pool, rows, width))
        if step is None:
            step = self._steps[(pool, rows, width)] = self._bind_fixed(pool, rows, width)
        step.input_ids.update_inplace(np.ascontiguousarray(input_ids, dtype=np.int64).reshape(rows, 1))
        step.position_ids.update_inplace(np.ascontiguousarray(position_ids, dtype=np.int64).reshape(rows, 1))
        if step.attention_mask is not None:
            step.attention_mask.update_inplace(np.ascontiguousarray(attention_mask, dtype=np.int64))
        if step.long_rope is not None:
            step.long_rope.update_inplace(np.zeros(rows, np.int64) if long_rope is None else np.ascontiguousarray(long_rope, dtype=np.int64))
        if before_run is not None:
            before_run()
        settle_uploads(self.device)  # the inputs just copied to the device land before the step (or its replay) reads them
        if step.graph_id is not None and not step.captured:
            self._capture(step)
        else:
            run_bound(self.session, step.binding, step.run_options)
        tokens = step.greedy_tokens.numpy()  # CUDA: a copy to the host; CPU: the buffer
        logits = None
        if with_logits:
            logits = step.logits.numpy()
            self.traffic.logits_bytes += logits.nbytes
        return Sampled(logits, tokens)

    def _capture(self, step: FixedDecode) -> None:
        """Run a step whose graph is not captured yet (ONNX Runtime captures it in this run). If capture fails, no step
        is captured from then on: the failure is noted (cuda_graph_note) and the step reruns uncaptured, which writes
        the same K/V at the same columns."""
        try:  # ONNX Runtime's own error: the note quotes it
            self.session.run_with_iobinding(step.binding, step.run_options)
            step.captured = True
            return
        except Exception as exc:  # ONNX Runtime's errors have no common base; any failure here ends capturing
            self.captures = False
            self.cuda_graph_note = f"CUDA graph capture failed ({first_line(exc)}); decode steps run uncaptured"
            log.warning("%s", self.cuda_graph_note)
        for fixed in self._steps.values():
            if fixed.captured:
                self.session.release_captured_graph(fixed.graph_id)
            fixed.graph_id, fixed.run_options, fixed.captured = None, self._uncaptured, False
        run_bound(self.session, step.binding, step.run_options)

    def _bind_fixed(self, pool: SlotPool, rows: int, width: int) -> FixedDecode:
        """A shape's buffers and binding; the graph's kind is checked here, once a shape, not at every step."""
        inputs = {i.name for i in self.session.get_inputs()}
        if io.ATTENTION_MASK not in inputs and io.CHUNK_IDS in inputs:
            raise ValueError("a fused step graph's decode steps go through run_slots (its artifact has no decode graph)")
        if (io.ATTENTION_MASK in inputs) != (width > 0):
            raise ValueError("run_decode takes a mask for a standard slots graph and none (None) for a fused decode graph")
        if rows > pool.rows:
            raise ValueError(f"a decode step of {rows} rows on a pool of {pool.rows}")
        host = {
            io.INPUT_IDS: np.zeros((rows, 1), np.int64),  # (B, 1)
            io.POSITION_IDS: np.zeros((rows, 1), np.int64),  # (B, 1)
            io.ATTENTION_MASK: np.zeros((rows, width), np.int64),  # (B, W)
            io.CHUNK_IDS: np.zeros((1, 0), np.int64),  # (1, 0): no chunk
            io.CHUNK_POSITION_IDS: np.zeros((1, 0), np.int64),  # (1, 0)
            io.CHUNK_ATTENTION_MASK: np.ones((1, 1), np.int64),  # (1, 1)
            io.CHUNK_SLOT: np.zeros(1, np.int64),  # (1,)
            io.LOGITS_INDEX: np.arange(rows, dtype=np.int64),  # (B,): every row
            io.LONG_ROPE: np.zeros(rows, np.int64),  # (B,): a longrope graph's (io_contract)
            io.CHUNK_LONG_ROPE: np.zeros(1, np.int64),  # (1,)
        }
        host = {name: array for name, array in host.items() if name in inputs}  # a decode graph has no chunk, nor a mask
        logits = np.zeros((rows, self.vocab_size), np.float32)  # (B, V)
        tokens = np.zeros(rows, np.int64)  # (B,)
        values = {name: ort.OrtValue.ortvalue_from_numpy(array, self.device, 0) for name, array in host.items()}
        logits_value = ort.OrtValue.ortvalue_from_numpy(logits, self.device, 0)
        tokens_value = ort.OrtValue.ortvalue_from_numpy(tokens, self.device, 0)
        binding = self.session.io_binding()
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(io.LOGITS, logits_value)
        binding.bind_ortvalue_output(io.GREEDY_TOKENS, tokens_value)
        for index, (past_name, present_name, value) in enumerate(zip(self._past_names, self._present_names, pool.values)):
            shape = pool.value_shape(index, rows)  # (B, H_kv, C, d_k): rows 0..B-1
            binding.bind_input(past_name, self.device, 0, self.kv_dtype, shape, value.data_ptr())
            binding.bind_output(present_name, self.device, 0, self.kv_dtype, shape, value.data_ptr())
        graph_id, run_options = None, self._uncaptured
        if self.captures:
            graph_id, run_options = next(self._graph_ids), ort.RunOptions()
            run_options.add_run_config_entry(GRAPH_ID, str(graph_id))
        host_arrays = list(host.values()) + [logits, tokens] if self.device == "cpu" else []
        return FixedDecode(binding, values[io.INPUT_IDS], values[io.POSITION_IDS], values.get(io.ATTENTION_MASK), logits_value,
                           tokens_value, run_options, graph_id, host_arrays, long_rope=values.get(io.LONG_ROPE))

    def shapes(self, pool: SlotPool) -> list[tuple[int, int]]:
        """The (rows, width) shapes run has bound for pool, in the order they were first run."""
        return [(rows, width) for (p, rows, width) in self._steps if p is pool]

    def release(self, pool: SlotPool) -> None:
        """Forget the decode steps bound to pool (and release their CUDA graphs): the pool is no longer used."""
        for key in [k for k in self._steps if k[0] is pool]:
            step = self._steps.pop(key)
            if step.captured:
                self.session.release_captured_graph(step.graph_id)
