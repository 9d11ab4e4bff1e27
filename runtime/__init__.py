"""ONNX Runtime under kvserve, torch-free, and the only package that imports onnxruntime to run a graph: which
provider runs and why (providers.py), the KV pool and what moves through the host (pool.py), one slots step for
standard and fused graphs (step.py), decode steps at fixed shapes captured as CUDA graphs (cuda_graphs.py), what a
step hands back (sampled.py), and the memory this process may use (machine_memory.py). Imports run providers <- pool
<- cuda_graphs <- step, with no circle.

What the server may use is named here, and service/ imports nothing else from this package (tests/test_layers.py);
export's parity driver and the benchmarks may reach the modules themselves.
"""

from .cuda_graphs import MIN_DECODE_WIDTH, decode_shape, decode_shapes
from .machine_memory import memory_limit
from .pool import KvTraffic, SlotPool, pool_capacity
from .providers import PROVIDER_CHOICES, ModelUnloadable, ProviderUnavailable, StepRunFailed, cuda_available
from .sampled import Sampled
from .step import DecoderRuntime

__all__ = [
    "DecoderRuntime", "KvTraffic", "MIN_DECODE_WIDTH", "ModelUnloadable", "PROVIDER_CHOICES", "ProviderUnavailable", "Sampled",
    "SlotPool", "StepRunFailed", "cuda_available", "decode_shape", "decode_shapes", "memory_limit", "pool_capacity",
]
