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
