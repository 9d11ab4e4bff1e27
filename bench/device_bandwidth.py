"""How fast the GPU reads memory, and the decode-step floor that sets for artifacts: at batch 1 a step reads every
weight once, so no step is shorter than the weights' bytes over the read bandwidth. Read bandwidth is timed with
torch (on the GPU host's image) as a reduction over a buffer far larger than the L2 cache, best of 20 after warm-up.
Prints a markdown table and the machine.

    python bench/device_bandwidth.py ARTIFACT [ARTIFACT ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

from kvserve.contract.artifact import MODEL_DATA_FILE  # noqa: E402

BUFFER_BYTES = 4 << 30


def read_bandwidth() -> float:
    """Bytes a second a reduction reads from device memory (best of 20)."""
    import torch

    buffer = torch.ones(BUFFER_BYTES // 2, dtype=torch.float16, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for i in range(25):
        start.record()
        buffer.sum(dtype=torch.float32)
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            best = min(best, start.elapsed_time(end) / 1e3)
    return BUFFER_BYTES / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    args = parser.parse_args()
    bandwidth = read_bandwidth()
    print(f"device read bandwidth: {bandwidth / 1e12:.2f} TB/s (a float16 reduction over {BUFFER_BYTES >> 30} GiB)\n")
    print("| artifact | weights MB | floor ms/step at batch 1 |")
    print("|---|---:|---:|")
    for artifact in args.artifacts:
        weights = (artifact / MODEL_DATA_FILE).stat().st_size + (artifact / "model.onnx").stat().st_size
        print(f"| {artifact.name} | {weights / 1e6:.0f} | {weights / bandwidth * 1e3:.3f} |")
    print(f"\nmachine: {describe('CUDAExecutionProvider')}")


if __name__ == "__main__":
    main()
