"""The ONNX Runtime wrapper: the only module of the serving path that opens an ONNX Runtime session.

It opens the artifact's graph on the best provider it can (CUDA, then CPU), says which one runs and why,
and runs one slots step (export/io_contract.py) with IO binding. The K/V cache is a SlotPool: one allocation
per layer's K and V, (rows, H_kv, capacity, d_k), on the session's device (GPU memory under CUDA). A step binds
the pool's first rows by address as both past and present, so ONNX Runtime writes each new token's K/V into
its row and the cache never passes through the host. Only what sampling reads comes back to host memory: each
sampled row's greedy token, computed in the graph (io_contract.GREEDY_TOKENS), and its logits only when a row
needs them (it samples, penalises repetition or reports log-probabilities): a step of greedy rows reads K tokens
instead of K x V floats. The pool moves a row only when the batch asks (kv_slots.py: a sequence leaves on the CPU
provider).

Under CUDA graphs (cuda_graph=True: the session opened with enable_cuda_graph) a decode-only step of a standard
slots graph goes through run_decode: at a fixed (rows, width) shape, its inputs written into device buffers bound
once per shape, captured by ONNX Runtime at its first run under a graph id of its own and replayed after; every
other run says gpu_graph_id -1 (never captured). A captured graph belongs to the thread that captured it: the
server runs the gate, the warm-up (which captures) and every step on one thread. Where capture cannot run (CPU
provider, a graph ONNX Runtime refuses: a fused graph's If), cuda_graph_note says why and steps run as before.

A fused slots graph (io_contract: GroupQueryAttention, Llama family) binds the rows and the chunk's row
separately, each as its own past and present; run_slots keeps its meaning for both graphs and arranges a
fused step itself (_run_fused). On CUDA the fused kernel is float16 only: a float32 fused graph is refused
there with the fix named.

Every copy of K/V that the runtime makes is counted (KvTraffic), so tests can hold the serving path to
"no K/V through the host in steady state".
"""

from __future__ import annotations

import contextlib
import ctypes
import io as io_text
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kvserve.errors import UserError
from kvserve.export import io_contract as io

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
PROVIDER_CHOICES = ("auto", "cuda", "cpu")
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64"}
# What the CUDA provider of onnxruntime-gpu 1.31 loads; missing ones make it fall back to CPU.
CUDA_LIBRARIES = ("libcudart.so.13", "libcublas.so.13", "libcudnn.so.9")
# The run option naming the CUDA graph a run captures or replays; -1: neither. A graph id's first run captures it
# (ONNX Runtime repeats that run internally until its CUDA provider's warm-up runs are done), into the context of
# the calling thread: a run of the same id from another thread would capture it again, there.
GRAPH_ID = "gpu_graph_id"


class ProviderUnavailable(UserError):
    """The execution provider asked for cannot run here; the message says why."""


class ModelUnloadable(UserError):
    """ONNX Runtime refused the graph file (corrupt, truncated, or not ONNX); the message names the file."""


def _cuda_missing_reason() -> str | None:
    """Why the CUDA provider cannot start here, or None when it may. Checked up front so a CPU host gets
    one clear sentence instead of onnxruntime's error log about a library it failed to load."""
    if CUDA not in ort.get_available_providers():
        return f"this onnxruntime build ({ort.__version__}) has no CUDA provider"
    try:  # CUDA/cuDNN from pip wheels (nvidia-*) when present; it prints what it misses, we say it once
        with contextlib.redirect_stdout(io_text.StringIO()), contextlib.redirect_stderr(io_text.StringIO()):
            ort.preload_dlls()
    except Exception:  # older builds have no preload_dlls; the system's libraries may still do
        pass
    for library in CUDA_LIBRARIES:
        try:
            ctypes.CDLL(library)
        except OSError:
            return f"{library} not found (the CUDA provider needs CUDA 13 and cuDNN 9)"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def cuda_available() -> bool:
    """Whether the CUDA provider can start here (what provider "auto" then picks)."""
    return _cuda_missing_reason() is None


def power_of_two_at_least(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= n, and at least minimum: how fixed decode shapes are bucketed."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


@dataclass
class KvTraffic:
    """What the runtime moved. host_bytes: K/V through host memory (a row move staged through the host under CUDA, a
    row read back for a check); row_moves: rows of a SlotPool moved to another row; logits_bytes: slots steps' logits handed to the
    host for sampling (a copy from the device under CUDA)."""

    host_bytes: int = 0
    row_moves: int = 0
    logits_bytes: int = 0


@dataclass(frozen=True)
class Sampled:
    """What a slots step returns for the K tokens it samples from, in host memory."""

    logits: np.ndarray | None  # (K, V) float32; None when the step was asked for greedy tokens alone
    greedy_tokens: np.ndarray  # (K,) int64: each row's argmax


class SlotPool:
    """The slots layout's cache: per layer K and V, each (rows, H, capacity, d_k), on the session's device.
    Rows are the batch's slots; a step binds rows [0, B) by address. On the CPU provider the memory is
    numpy's (the device is the host), zeroed here so every page is touched before any step runs; under
    CUDA it is device memory, read back only to move a row (kv_slots never does under CUDA)."""

    def __init__(self, runtime: "DecoderRuntime", rows: int, n_kv_head: int, d_head: int, capacity: int):
        self.runtime, self.rows, self.capacity = runtime, rows, capacity
        self.shape = (rows, n_kv_head, capacity, d_head)  # (S, H_kv, C, d_k)
        self.row_bytes = n_kv_head * capacity * d_head * np.dtype(runtime.kv_dtype).itemsize  # one layer's K of one row
        if runtime.device == "cpu":
            self.arrays = [np.empty(self.shape, runtime.kv_dtype) for _ in range(2 * runtime.n_layer)]
            for array in self.arrays:
                array.fill(0)  # touch every page now: a first touch mid-step is a page fault the step waits for
            self.values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.arrays]  # the same memory
        else:
            self.arrays = None
            zeros = np.zeros(self.shape, runtime.kv_dtype)  # rows read padding columns: they must hold numbers
            self.values = [ort.OrtValue.ortvalue_from_numpy(zeros, "cuda", 0) for _ in range(2 * runtime.n_layer)]

    def _host_views(self) -> list[np.ndarray]:
        """The pool as numpy arrays: the memory itself on CPU; a copy from the GPU otherwise (counted)."""
        if self.arrays is not None:
            return self.arrays
        self.runtime.traffic.host_bytes += sum(v.numpy().nbytes for v in self.values)
        return [v.numpy() for v in self.values]

    def _write_back(self, arrays: list[np.ndarray]) -> None:
        if self.arrays is None:
            for value, array in zip(self.values, arrays):
                value.update_inplace(np.ascontiguousarray(array))
            self.runtime.traffic.host_bytes += sum(a.nbytes for a in arrays)

    def move_row(self, source: int, destination: int, columns: int) -> None:
        """Copy the first `columns` columns of row source into row destination (a sequence changes slot)."""
        arrays = self._host_views()
        for array in arrays:
            array[destination, :, :columns] = array[source, :, :columns]
        self._write_back(arrays)
        self.runtime.traffic.row_moves += 1

    def row_to_host(self, row: int, columns: int) -> list[np.ndarray]:
        """One row's first columns, per layer K then V, each (H, columns, d_k): for parity checks and tests."""
        if self.arrays is not None:
            return [a[row, :, :columns].copy() for a in self.arrays]
        return [v.numpy()[row, :, :columns] for v in self.values]


@dataclass
class FixedDecode:
    """A decode step's inputs and logits at one shape, in buffers on the session's device, bound once: each step
    writes its inputs into the same memory (a captured CUDA graph replays the addresses it was captured with)."""

    binding: object
    input_ids: object  # OrtValue (B, 1)
    position_ids: object  # OrtValue (B, 1)
    attention_mask: object  # OrtValue (B, W)
    logits: object  # OrtValue (B, V) float32
    greedy_tokens: object  # OrtValue (B,) int64
    run_options: object  # names the CUDA graph, when captured
    graph_id: int | None
    host_arrays: list  # on the CPU provider, the numpy memory behind the OrtValues: kept alive with them
    captured: bool = False


class DecoderRuntime:
    """One ONNX Runtime session over an exported decoder graph."""

    def __init__(
        self,
        model_path: str | Path,
        n_layer: int,
        dtype: str,
        provider: str = "auto",
        threads: int = 0,
        cuda_graph: bool = False,  # capture slots decode steps as CUDA graphs where ONNX Runtime can (run_decode)
    ):
        if provider not in PROVIDER_CHOICES:
            raise ProviderUnavailable(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDER_CHOICES)}")
        self.n_layer = n_layer
        self.kv_dtype = NUMPY_DTYPES[dtype]
        self.fallback_reason: str | None = None
        providers = [CPU]
        if provider in ("auto", "cuda"):
            reason = _cuda_missing_reason()
            if reason is None:
                # cuBLAS would run float32 matmuls as TF32 (10-bit mantissa): ~1e-3 off the reference.
                # A float32 artifact promises float32, so TF32 stays off for it.
                providers = [(CUDA, {"use_tf32": "0" if dtype == "float32" else "1"}), CPU]
            elif provider == "cuda":
                raise ProviderUnavailable(f"CUDA requested but unavailable: {reason}")
            else:
                self.fallback_reason = reason
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3  # errors only; provider fallbacks are reported by us, in one line
        self.captures_decode = False  # decode steps of fixed shapes are captured as CUDA graphs (run_decode)
        self.cuda_graph_note: str | None = None  # why CUDA graphs were asked for and are off
        if cuda_graph and providers[0] == CPU:
            self.cuda_graph_note = "CUDA graphs need the CUDA provider; decode steps run uncaptured"
        elif cuda_graph:
            graph_providers = [(CUDA, {**providers[0][1], "enable_cuda_graph": "1"}), CPU]
            try:
                self.session = ort.InferenceSession(str(model_path), options, providers=graph_providers)
                self.captures_decode = self.session.get_providers()[0] == CUDA
            except Exception as exc:  # control flow, compute nodes left on the CPU; a file it cannot load fails again below
                self.cuda_graph_note = f"CUDA graphs off: ONNX Runtime will not capture this graph ({_first_line(exc)})"
        if not self.captures_decode:
            self.session = self._open(model_path, options, providers)
        self.provider = self.session.get_providers()[0]
        if len(providers) > 1 and self.provider != CUDA:
            if provider == "cuda":
                raise ProviderUnavailable("CUDA requested but the session could not start on it")
            self.fallback_reason = "the CUDA provider failed to start"
        self.device = "cuda" if self.provider == CUDA else "cpu"
        inputs = {i.name for i in self.session.get_inputs()}
        self.attention = io.FUSED if io.chunk_past_names(0)[0] in inputs else io.STANDARD  # the graph says which it is
        if self.attention == io.FUSED and self.device == "cuda" and dtype == "float32":
            raise ProviderUnavailable("ONNX Runtime runs GroupQueryAttention on CUDA in float16 only: export this model with "
                                      "--dtype float16, or --attention standard, to serve it on the GPU")
        outputs = {o.name: o for o in self.session.get_outputs()}
        self.vocab_size = outputs[io.LOGITS].shape[-1]
        self._chunk_past_names = [n for i in range(n_layer) for n in io.chunk_past_names(i)]
        self._chunk_present_names = [n for i in range(n_layer) for n in io.chunk_present_names(i)]
        self._past_names = [n for i in range(n_layer) for n in io.past_names(i)]
        self._present_names = [n for i in range(n_layer) for n in io.present_names(i)]
        self.traffic = KvTraffic()
        self._pool_binding: tuple | None = None  # (key, binding): the K/V bound once, reused step after step
        self._fixed_steps: dict[tuple, FixedDecode] = {}  # (pool, rows, width) -> its buffers (run_decode)
        self._graph_ids = itertools.count(1)  # never reused: a captured graph holds its buffers' addresses
        self._uncaptured = ort.RunOptions()
        self._uncaptured.add_run_config_entry(GRAPH_ID, "-1")  # other steps' shapes vary: never captured

    @staticmethod
    def _open(model_path, options, providers):
        try:
            return ort.InferenceSession(str(model_path), options, providers=providers)
        except (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidProtobuf,
                ort.capi.onnxruntime_pybind11_state.InvalidGraph, ort.capi.onnxruntime_pybind11_state.NoSuchFile) as exc:
            raise ModelUnloadable(f"{model_path}: ONNX Runtime cannot load it ({_first_line(exc)})") from None

    # --- the graph's own description, for the load-time contract check ---------------------------

    def signature(self) -> dict[str, dict]:
        """{"inputs"|"outputs": {name: {"shape": [...], "dtype": ...}}} as the live session reports it."""

        def describe(args):
            return {a.name: {"shape": list(a.shape), "dtype": ORT_TYPES.get(a.type, a.type)} for a in args}

        return {"inputs": describe(self.session.get_inputs()), "outputs": describe(self.session.get_outputs())}

    # --- the slots layout: one step over a SlotPool -------------------------------------------------

    def new_pool(self, rows: int, n_kv_head: int, d_head: int, capacity: int) -> SlotPool:
        return SlotPool(self, rows, n_kv_head, d_head, capacity)

    def _bound_pool(self, pool: SlotPool, rows: int, first_row: int = 0, chunk_row: int | None = None):
        """An IO binding with the pool's rows first_row .. first_row + rows - 1 bound as past and present (and, for a fused
        graph, row chunk_row as the chunk's past and present); made once per (pool, rows, first_row, chunk_row)."""
        key = (pool, rows, first_row, chunk_row)
        if self._pool_binding is not None and self._pool_binding[0] == key:
            return self._pool_binding[1]
        binding = self.session.io_binding()
        names = [(self._past_names, self._present_names, first_row, rows)]
        if chunk_row is not None:
            names.append((self._chunk_past_names, self._chunk_present_names, chunk_row, 1))
        for past_names, present_names, row, count in names:
            shape = (count,) + pool.shape[1:]  # (B, H, C, d_k): consecutive rows from row on
            for past_name, present_name, value in zip(past_names, present_names, pool.values):
                address = value.data_ptr() + row * pool.row_bytes
                binding.bind_input(past_name, self.device, 0, self.kv_dtype, shape, address)
                binding.bind_output(present_name, self.device, 0, self.kv_dtype, shape, address)
        self._pool_binding = (key, binding)
        return binding

    def run_slots(
        self,
        pool: SlotPool,
        input_ids: np.ndarray,  # (B,) a token per row 0..B-1
        position_ids: np.ndarray,  # (B,) its position = write column
        attention_mask: np.ndarray,  # (B, W) the columns each row reads
        chunk_ids: np.ndarray,  # (T,) a prompt chunk of row chunk_slot (may be empty)
        chunk_start: int,  # the chunk's first position
        chunk_slot: int,
        logits_index: np.ndarray,  # (K,) which of the B + T tokens get logits
        with_logits: bool = True,  # False: greedy tokens alone will do
    ) -> Sampled:
        """One slots step; returns its K sampled rows' greedy tokens and logits in host memory. The pool's rows 0..B-1
        are updated in place."""
        if self.attention == io.FUSED:
            return self._run_fused(pool, input_ids, position_ids, chunk_ids, chunk_start, chunk_slot, logits_index, with_logits)
        rows = input_ids.shape[0]
        binding = self._bound_pool(pool, rows)
        chunk = np.ascontiguousarray(chunk_ids, dtype=np.int64).reshape(1, -1)  # (1, T)
        binding.bind_cpu_input(io.INPUT_IDS, np.ascontiguousarray(input_ids, dtype=np.int64).reshape(rows, 1))
        binding.bind_cpu_input(io.POSITION_IDS, np.ascontiguousarray(position_ids, dtype=np.int64).reshape(rows, 1))
        binding.bind_cpu_input(io.ATTENTION_MASK, np.ascontiguousarray(attention_mask, dtype=np.int64))
        binding.bind_cpu_input(io.CHUNK_IDS, chunk)
        chunk_end = chunk_start + chunk.shape[1]
        binding.bind_cpu_input(io.CHUNK_POSITION_IDS, np.arange(chunk_start, chunk_end, dtype=np.int64)[None])
        binding.bind_cpu_input(io.CHUNK_ATTENTION_MASK, np.ones((1, max(chunk_end, 1)), dtype=np.int64))  # its row's columns so far
        binding.bind_cpu_input(io.CHUNK_SLOT, np.array([chunk_slot], dtype=np.int64))
        binding.bind_cpu_input(io.LOGITS_INDEX, np.ascontiguousarray(logits_index, dtype=np.int64))
        return self._run_sampled(binding, len(logits_index), with_logits)

    def run_decode(self, pool: SlotPool, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
                   with_logits: bool = True) -> Sampled:
        """A decode-only step of a standard slots graph at a fixed shape: rows 0..B-1 of the pool decode input_ids (B,) at
        position_ids (B,), reading attention_mask (B, W); no chunk, logits for every row. The inputs go into device
        buffers bound once per (pool, B, W) and, when the session captures (captures_decode), the step is a CUDA graph
        of its own, captured at its first run and replayed after. Returns every row's greedy token (B,) and, with_logits,
        its logits (B, V), in host memory: on the CPU provider the bound
        buffers themselves, which the next step at this shape overwrites (read them before then)."""
        rows, width = attention_mask.shape
        step = self._fixed_steps.get((pool, rows, width))
        if step is None:
            step = self._fixed_steps[(pool, rows, width)] = self._bind_fixed(pool, rows, width)
        step.input_ids.update_inplace(np.ascontiguousarray(input_ids, dtype=np.int64).reshape(rows, 1))
        step.position_ids.update_inplace(np.ascontiguousarray(position_ids, dtype=np.int64).reshape(rows, 1))
        step.attention_mask.update_inplace(np.ascontiguousarray(attention_mask, dtype=np.int64))
        if step.graph_id is not None and not step.captured:
            self._capture(step)
        else:
            self.session.run_with_iobinding(step.binding, step.run_options)
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
        try:
            self.session.run_with_iobinding(step.binding, step.run_options)
            step.captured = True
            return
        except Exception as exc:  # ONNX Runtime's errors have no common base; any failure here ends capturing
            self.captures_decode = False
            self.cuda_graph_note = f"CUDA graph capture failed ({_first_line(exc)}); decode steps run uncaptured"
            log.warning("%s", self.cuda_graph_note)
        for fixed in self._fixed_steps.values():
            if fixed.captured:
                self.session.release_captured_graph(fixed.graph_id)
            fixed.graph_id, fixed.run_options, fixed.captured = None, self._uncaptured, False
        self.session.run_with_iobinding(step.binding, step.run_options)

    def _bind_fixed(self, pool: SlotPool, rows: int, width: int) -> FixedDecode:
        if self.attention != io.STANDARD:
            raise ValueError("run_decode drives a standard slots graph; a fused graph's steps go through run_slots")
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
        }
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
        shape = (rows,) + pool.shape[1:]  # (B, H_kv, C, d_k): rows 0..B-1
        for past_name, present_name, value in zip(self._past_names, self._present_names, pool.values):
            binding.bind_input(past_name, self.device, 0, self.kv_dtype, shape, value.data_ptr())
            binding.bind_output(present_name, self.device, 0, self.kv_dtype, shape, value.data_ptr())
        graph_id, run_options = None, self._uncaptured
        if self.captures_decode:
            graph_id, run_options = next(self._graph_ids), ort.RunOptions()
            run_options.add_run_config_entry(GRAPH_ID, str(graph_id))
        host_arrays = list(host.values()) + [logits, tokens] if self.device == "cpu" else []
        return FixedDecode(binding, values[io.INPUT_IDS], values[io.POSITION_IDS], values[io.ATTENTION_MASK], logits_value,
                           tokens_value, run_options, graph_id, host_arrays)

    def fixed_shapes(self, pool: SlotPool) -> list[tuple[int, int]]:
        """The (rows, width) shapes run_decode has bound for pool, in the order they were first run."""
        return [(rows, width) for (p, rows, width) in self._fixed_steps if p is pool]

    def release_pool(self, pool: SlotPool) -> None:
        """Forget the decode steps bound to pool (and release their CUDA graphs): the pool is no longer used."""
        for key in [k for k in self._fixed_steps if k[0] is pool]:
            step = self._fixed_steps.pop(key)
            if step.captured:
                self.session.release_captured_graph(step.graph_id)
        if self._pool_binding is not None and self._pool_binding[0][0] is pool:
            self._pool_binding = None

    def _run_fused(self, pool: SlotPool, input_ids, position_ids, chunk_ids, chunk_start: int, chunk_slot: int, logits_index,
                   with_logits: bool) -> Sampled:
        """run_slots for a fused graph, whose operator needs a row and a token at least (io_contract): the rows are rows
        0 .. the last that decodes (a token each; one below it with nothing to decode runs its scratch token) and the
        chunk, if any, goes beside them; a chunk with no row decoding is the step's one row instead, the chunk inputs
        left empty (their row bound to its own, passed through). The rows sampled come back in run_slots' order."""
        rows, n_chunk = len(input_ids), len(chunk_ids)
        logits_index = np.asarray(logits_index, np.int64)
        decoding = logits_index < rows  # the rest are the chunk's
        chunk = np.ascontiguousarray(chunk_ids, dtype=np.int64).reshape(1, n_chunk)  # (1, T)
        chunk_positions = np.arange(chunk_start, chunk_start + n_chunk, dtype=np.int64)[None]  # (1, T)
        if decoding.any():
            count = int(logits_index[decoding].max()) + 1
            binding = self._bound_pool(pool, count, 0, chunk_slot if n_chunk else 0)  # no chunk: row 0, passed through
            tokens = np.ascontiguousarray(input_ids[:count], dtype=np.int64).reshape(count, 1)  # (B, 1)
            positions = np.ascontiguousarray(position_ids[:count], dtype=np.int64).reshape(count, 1)  # (B, 1)
            graph_index = np.where(decoding, logits_index, logits_index - rows + count)  # the chunk follows the B rows
        elif n_chunk:
            binding = self._bound_pool(pool, 1, chunk_slot, chunk_slot)
            tokens, positions, graph_index = chunk, chunk_positions, logits_index - rows
            chunk = chunk_positions = np.zeros((1, 0), np.int64)
        else:
            raise ValueError("a step must decode a row or run a chunk")
        binding.bind_cpu_input(io.INPUT_IDS, tokens)
        binding.bind_cpu_input(io.POSITION_IDS, positions)
        binding.bind_cpu_input(io.CHUNK_IDS, chunk)
        binding.bind_cpu_input(io.CHUNK_POSITION_IDS, chunk_positions)
        binding.bind_cpu_input(io.LOGITS_INDEX, graph_index)
        return self._run_sampled(binding, len(logits_index), with_logits)

    def _run_sampled(self, binding, n_logits: int, with_logits: bool) -> Sampled:
        """Run a slots step whose greedy tokens (K,) and, when asked for, logits (K, V) land in new host arrays bound up
        front: asking the binding for its outputs afterwards would wrap every bound K/V buffer too (121 objects a step
        for a 30-layer model). Logits not asked for stay where the step ran (ONNX Runtime allocates them there)."""
        tokens = np.zeros(n_logits, np.int64)  # (K,); zeros: a stubbed-out run (bench host timing) leaves valid ids
        binding.bind_output(io.GREEDY_TOKENS, "cpu", 0, np.int64, tokens.shape, tokens.ctypes.data)
        logits = None
        if with_logits:
            logits = np.empty((n_logits, self.vocab_size), np.float32)  # (K, V)
            binding.bind_output(io.LOGITS, "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
            self.traffic.logits_bytes += logits.nbytes
        else:
            binding.bind_output(io.LOGITS, self.device, 0)
        self.session.run_with_iobinding(binding, self._uncaptured)
        return Sampled(logits, tokens)
