"""The ONNX Runtime wrapper: the only module in kvserve that imports onnxruntime.

It opens the artifact's graph on the best provider it can (CUDA, then CPU), says which one runs and why,
and runs one step with IO binding: the K/V cache goes in and comes out as OrtValues that stay on the
device (GPU memory under CUDA), so the decode loop never copies the cache through the host. Only the
logits come back to host memory, because sampling happens there.

Callers see one cache whatever the artifact's layout (export/io_contract.py): a DeviceCache whose first
`length` columns hold the sequence, fed an attention mask over those columns. Under the inplace layout the
cache is a buffer with spare columns: each step's present is bound to the past's own memory, so ONNX
Runtime writes this step's columns and copies nothing; when a step needs more columns than the buffer
has, the buffer is replaced by one of the next power-of-two capacity (a copy once per doubling).
"""

from __future__ import annotations

import contextlib
import ctypes
import io as io_text
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


class ProviderUnavailable(UserError):
    """The execution provider asked for cannot run here; the message says why."""


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


# The inplace layout's smallest buffer, in columns: below it, a buffer's size makes no measurable difference.
MIN_CAPACITY = 64


def inplace_capacity(columns: int, minimum: int = MIN_CAPACITY) -> int:
    """The buffer capacity that holds columns: a power of two, at least minimum."""
    return max(minimum, 1 << max(columns - 1, 0).bit_length())


@dataclass(frozen=True)
class DeviceCache:
    """The batch's K/V between steps: per layer K and V interleaved, OrtValues (B, H, capacity, d_k) on the
    session's device, whose first `length` columns hold the sequence. concat: capacity == length.

    A step consumes its past: under the inplace layout it writes into the past's memory, so only the
    present it returns may be used afterwards."""

    values: list
    length: int

    @property
    def capacity(self) -> int:
        return self.values[0].shape()[io.KV_SEQUENCE_AXIS] if self.values else 0


@dataclass(frozen=True)
class StepOutput:
    logits: np.ndarray  # (B, T, V) float32, in host memory
    present: DeviceCache  # length P + T


class DecoderRuntime:
    """One ONNX Runtime session over an exported decoder graph."""

    def __init__(
        self,
        model_path: str | Path,
        n_layer: int,
        dtype: str,
        provider: str = "auto",
        threads: int = 0,
        kv_cache: str = io.CONCAT,
        min_capacity: int = MIN_CAPACITY,  # inplace: the smallest buffer, in columns
    ):
        if provider not in PROVIDER_CHOICES:
            raise ProviderUnavailable(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDER_CHOICES)}")
        if kv_cache not in io.KV_CACHES:
            raise ValueError(f"unknown KV cache layout {kv_cache!r}; choose one of {', '.join(io.KV_CACHES)}")
        self.n_layer = n_layer
        self.kv_cache = kv_cache
        self.min_capacity = min_capacity
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
        self.session = ort.InferenceSession(str(model_path), options, providers=providers)
        self.provider = self.session.get_providers()[0]
        if len(providers) > 1 and self.provider != CUDA:
            if provider == "cuda":
                raise ProviderUnavailable("CUDA requested but the session could not start on it")
            self.fallback_reason = "the CUDA provider failed to start"
        self.device = "cuda" if self.provider == CUDA else "cpu"
        self._past_names = [n for i in range(n_layer) for n in io.past_names(i)]
        self._present_names = [n for i in range(n_layer) for n in io.present_names(i)]

    # --- the graph's own description, for the load-time contract check ---------------------------

    def signature(self) -> dict[str, dict]:
        """{"inputs"|"outputs": {name: {"shape": [...], "dtype": ...}}} as the live session reports it."""

        def describe(args):
            return {a.name: {"shape": list(a.shape), "dtype": ORT_TYPES.get(a.type, a.type)} for a in args}

        return {"inputs": describe(self.session.get_inputs()), "outputs": describe(self.session.get_outputs())}

    # --- the K/V cache as device values --------------------------------------------------------

    def buffer_columns(self, length: int, room_for: int) -> int:
        """The columns a cache of length columns, with room_for more ahead, is stored in."""
        return inplace_capacity(length + room_for, self.min_capacity) if self.kv_cache == io.INPLACE else length

    def to_device(self, arrays: list[np.ndarray], room_for: int = 1, length: int | None = None) -> DeviceCache:
        """A cache of arrays, each (B, H, S, d_k) whose first length (default S) columns hold the sequence; inplace:
        in a buffer with room for room_for more columns (arrays already buffer_columns wide are not copied)."""
        length = arrays[0].shape[io.KV_SEQUENCE_AXIS] if length is None else length
        columns = self.buffer_columns(length, room_for)
        if arrays[0].shape[io.KV_SEQUENCE_AXIS] != columns:
            arrays = [self._in_buffer(a[:, :, :length], columns) for a in arrays]
        values = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a, dtype=self.kv_dtype), self.device, 0) for a in arrays]
        return DeviceCache(values, length)

    @staticmethod
    def to_host(cache: DeviceCache) -> list[np.ndarray]:
        """The cache's columns in use, each (B, H, length, d_k), in host memory. On the CPU provider these are
        views of the cache itself: read them before the next step."""
        return [v.numpy()[:, :, : cache.length] for v in cache.values]

    def empty_past(self, batch_size: int, n_head: int, d_head: int, room_for: int = 0) -> DeviceCache:
        """An empty cache for a prefill; inplace: a buffer with room_for columns, so the steps ahead never grow it."""
        shape = (batch_size, n_head, 0, d_head)  # (B, H, 0, d_k): a prefill
        return self.to_device([np.zeros(shape, self.kv_dtype) for _ in self._past_names], room_for=room_for)

    def _in_buffer(self, array: np.ndarray, capacity: int) -> np.ndarray:
        """(B, H, S, d_k) -> (B, H, capacity, d_k), zero beyond S."""
        buffer = np.zeros(array.shape[:2] + (capacity,) + array.shape[3:], dtype=self.kv_dtype)  # (B, H, C, d_k)
        buffer[:, :, : array.shape[io.KV_SEQUENCE_AXIS]] = array
        return buffer

    # --- one step ---------------------------------------------------------------------------------

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: DeviceCache) -> StepOutput:
        """input_ids, position_ids (B, T); attention_mask (B, P + T) over the past's P columns and this step's T."""
        step_len, total = input_ids.shape[1], attention_mask.shape[1]
        if total != past.length + step_len:
            raise ValueError(f"attention_mask has {total} columns; the cache holds {past.length} and the step adds {step_len}")
        binding = self.session.io_binding()
        binding.bind_cpu_input(io.INPUT_IDS, np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input(io.POSITION_IDS, np.ascontiguousarray(position_ids, dtype=np.int64))
        binding.bind_output(io.LOGITS, "cpu")
        if self.kv_cache == io.INPLACE:
            if total > past.capacity:
                past = self.to_device(self.to_host(past), room_for=step_len + 1)  # this step and the next token
            mask = np.zeros((attention_mask.shape[0], past.capacity), dtype=np.int64)  # (B, C): unused columns 0
            mask[:, :total] = attention_mask
            binding.bind_cpu_input(io.ATTENTION_MASK, mask)
            binding.bind_cpu_input(io.CACHE_POSITION, np.arange(past.length, total, dtype=np.int64))  # (T,)
            for past_name, present_name, value in zip(self._past_names, self._present_names, past.values):
                binding.bind_ortvalue_input(past_name, value)
                binding.bind_ortvalue_output(present_name, value)  # the same memory: written in place
        else:
            binding.bind_cpu_input(io.ATTENTION_MASK, np.ascontiguousarray(attention_mask, dtype=np.int64))
            for name, value in zip(self._past_names, past.values):
                binding.bind_ortvalue_input(name, value)
            for name in self._present_names:
                binding.bind_output(name, self.device, 0)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        present = past.values if self.kv_cache == io.INPLACE else list(outputs[1:])
        return StepOutput(logits=outputs[0].numpy(), present=DeviceCache(present, total))
