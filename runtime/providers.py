"""Which execution provider runs a graph, and why: CUDA when asked for or available, else the CPU, with the reason
in one sentence (a CPU host gets that, not ONNX Runtime's error log about a library it failed to load). A session
for CUDA graphs is opened with capture enabled where ONNX Runtime allows it; where it does not, why is noted and
decode steps run uncaptured (cuda_graphs.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import io as io_text
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from kvserve.contract.artifact import MODEL_DATA_FILE
from kvserve.errors import UserError

from .weights_memory import release_file_pages

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
PROVIDER_CHOICES = ("auto", "cuda", "cpu")
# What the CUDA provider of onnxruntime-gpu 1.31 loads; missing ones make it fall back to CPU.
CUDA_LIBRARIES = ("libcudart.so.13", "libcublas.so.13", "libcudnn.so.9")


class ProviderUnavailable(UserError):
    """The execution provider asked for cannot run here; the message says why."""


class ModelUnloadable(UserError):
    """ONNX Runtime refused the graph file (corrupt, truncated, or not ONNX), or the server's load found its steps
    failing on the provider (service/process/loading.py); the message names the file."""


class StepRunFailed(RuntimeError):
    """ONNX Runtime failed a step of the graph on its provider (a kernel refused its inputs); the message names the
    node and the provider."""


def run_bound(session: ort.InferenceSession, binding: ort.IOBinding, run_options: ort.RunOptions) -> None:
    """One run of session with its inputs and outputs bound; a failure of the run itself ("Error in execution",
    a RuntimeError) is raised as StepRunFailed."""
    try:
        session.run_with_iobinding(binding, run_options)
    except RuntimeError as exc:
        reason = first_line(exc).removeprefix("Error in execution: ")
        raise StepRunFailed(f"ONNX Runtime failed a step on {session.get_providers()[0]}: {reason}") from exc


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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# Add + Softmax fused into BiasSoftmax fails on the CUDA provider when the input is empty (a decode step's empty prompt
# chunk: "CUDA error cudaErrorInvalidValue"); CUDA's plain Softmax returns at once on an empty input.
CUDA_DISABLED_FUSIONS = ["BiasSoftmaxFusion"]


def cuda_available() -> bool:
    """Whether the CUDA provider can start here (what provider "auto" then picks)."""
    return _cuda_missing_reason() is None


@dataclass
class OpenedSession:
    session: ort.InferenceSession
    provider: str  # the provider that runs the graph
    fallback_reason: str | None  # why CUDA was not used on a machine that has it (None on one without CUDA)
    captures_decode: bool  # the session captures CUDA graphs (enable_cuda_graph on the CUDA provider)
    cuda_graph_note: str | None  # why CUDA graphs were asked for and are off

    @property
    def device(self) -> str:
        return "cuda" if self.provider == CUDA else "cpu"


def open_session(model_path: str | Path, dtype: str, provider: str = "auto", threads: int = 0, cuda_graph: bool = False) -> OpenedSession:
    """A session over the graph at model_path on the best provider provider allows; cuda_graph: with capture enabled.
    Its operators run on the process's one thread pool (session_options).
    Weights are repacked for the CPU kernels one at a time, ONNX Runtime's default: on every thread
    (session.prepack.enable_parallel) a Qwen3-4B-shaped int4 server reached SERVING 0.8 s sooner but peaked at 5.44 GB
    during its start instead of 3.16 (2-core AMD EPYC Zen 5, bench/kv_memory.py; docs/models.md)."""
    if provider not in PROVIDER_CHOICES:
        raise ProviderUnavailable(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDER_CHOICES)}")
    fallback_reason = None
    providers = [CPU]
    if provider in ("auto", "cuda"):
        reason = _cuda_missing_reason()
        if reason is None:
            # cuBLAS would run float32 matmuls as TF32 (10-bit mantissa): ~1e-3 off the reference.
            # A float32 artifact promises float32, so TF32 stays off for it.
            providers = [(CUDA, {"use_tf32": "0" if dtype == "float32" else "1"}), CPU]
        elif provider == "cuda":
            raise ProviderUnavailable(f"CUDA requested but unavailable: {reason}")
        # else: no CUDA on this machine and none asked for: the CPU, said nowhere (a CPU host is not a fault)
    options = session_options(threads)
    options.log_severity_level = 3  # errors only; provider fallbacks are reported by us, in one line
    session, captures_decode, cuda_graph_note = None, False, None
    if cuda_graph and providers[0] == CPU:
        cuda_graph_note = "CUDA graphs need the CUDA provider; decode steps run uncaptured"
    elif cuda_graph:
        graph_providers = [(CUDA, {**providers[0][1], "enable_cuda_graph": "1"}), CPU]
        try:
            session = ort.InferenceSession(str(model_path), options, providers=graph_providers, disabled_optimizers=CUDA_DISABLED_FUSIONS)
            captures_decode = session.get_providers()[0] == CUDA
        except Exception as exc:  # control flow, compute nodes left on the CPU; a file it cannot load fails again below
            cuda_graph_note = f"CUDA graphs off: ONNX Runtime will not capture this graph ({first_line(exc)})"
    if not captures_decode:
        session = _open(model_path, options, providers)
    release_file_pages(Path(model_path).parent / MODEL_DATA_FILE)  # what repacking read and no step reads again
    running = session.get_providers()[0]
    if len(providers) > 1 and running != CUDA:
        if provider == "cuda":
            raise ProviderUnavailable("CUDA requested but the session could not start on it")
        fallback_reason = "the CUDA provider failed to start"
    return OpenedSession(session, running, fallback_reason, captures_decode, cuda_graph_note)


_POOL_THREADS: list[int] = []  # the process's intra-op thread count, once its pool is made


def session_options(threads: int = 0) -> ort.SessionOptions:
    """Options for a session of this process: every session runs its operators on one intra-op thread pool, made by the
    first with `threads` threads (0: ONNX Runtime's default, one a physical core). Sessions that take turns on the same
    cores (a small artifact's step and decode graphs, runtime/step.py) then never find the other's idle threads spinning
    on a core their run needs: each with a pool of its own, 16 rows with a prompt chunk every fourth step ran 1.56x
    slower, and stopping the spin after every run lost the cores to any other busy process (2-core AMD EPYC Zen 3,
    bench/chunkless_steps.py). ONNX Runtime then refuses a session with a pool of its own in this process: a session
    made outside open_session takes these options too."""
    if not _POOL_THREADS:
        ort.capi._pybind_state.set_global_thread_pool_sizes(threads, 1)
        _POOL_THREADS.append(threads)
    elif _POOL_THREADS[0] != threads:
        raise ValueError(f"this process runs ONNX Runtime on {_POOL_THREADS[0] or 'the default'} threads; a session cannot have {threads}")
    options = ort.SessionOptions()
    options.use_per_session_threads = False
    return options


def planned_device(provider: str) -> str:
    """The device open_session runs a graph on for provider, known before it opens anything."""
    return "cuda" if provider in ("auto", "cuda") and _cuda_missing_reason() is None else "cpu"


def _open(model_path, options, providers):
    disabled = CUDA_DISABLED_FUSIONS if providers[0] != CPU else []
    try:
        return ort.InferenceSession(str(model_path), options, providers=providers, disabled_optimizers=disabled)
    except (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidProtobuf,
            ort.capi.onnxruntime_pybind11_state.InvalidGraph, ort.capi.onnxruntime_pybind11_state.NoSuchFile) as exc:
        raise ModelUnloadable(f"{model_path}: ONNX Runtime cannot load it ({first_line(exc)})") from None
