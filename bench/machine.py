"""One line describing the machine a benchmark ran on, printed under every table."""

from __future__ import annotations

import os
import platform


def describe(provider: str | None = None) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line.split(":", 1)[1].split() for line in f if line.startswith("flags")))
        cpu += f" (AVX-512 {'with' if 'avx512_vnni' in flags else 'without'} VNNI, {'AMX' if 'amx_int8' in flags else 'no AMX'})" \
            if "avx512f" in flags else f" ({'AMX' if 'amx_int8' in flags else 'no AVX-512'})"
    except (OSError, StopIteration):
        pass
    memory = ""
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
        memory = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    import onnxruntime

    parts = [f"{cpu}, {os.cpu_count()} cores{memory}", f"{platform.system()} {platform.release()}",
             f"Python {platform.python_version()}", f"onnxruntime {onnxruntime.__version__}"]
    if provider:
        parts.append(f"provider {provider}")
    gpu = os.popen("nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null").read().strip()
    if gpu:
        parts.append(f"GPU {gpu}")
    return "; ".join(parts)
