"""Can ONNX Runtime update a KV buffer in place? Groundwork for an in-place cache artifact (issue 2).

Today's graph returns present = Concat(past, new), so every decode step rewrites the whole cache. This probe
times one layer's K update written by ScatterND into a fixed-capacity buffer (1, H, capacity, d_k), with the
output either freshly allocated or bound (IO binding) to the very OrtValue that is the input.

    python bench/kv_update_probe.py [--heads 12] [--capacity 1024] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402


def scatter_session(heads: int, capacity: int, head_dim: int) -> ort.InferenceSession:
    graph = helper.make_graph(
        [helper.make_node("ScatterND", ["past", "indices", "update"], ["present"])],
        "kv_update",
        [
            helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, heads, capacity, head_dim]),
            helper.make_tensor_value_info("indices", TensorProto.INT64, [1, heads, 1, 3]),
            helper.make_tensor_value_info("update", TensorProto.FLOAT, [1, heads, 1, head_dim]),
        ],
        [helper.make_tensor_value_info("present", TensorProto.FLOAT, [1, heads, capacity, head_dim])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    session = scatter_session(args.heads, args.capacity, args.head_dim)
    buffer = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, args.heads, args.capacity, args.head_dim), np.float32))
    position = args.capacity // 2
    indices = np.array([[[[0, h, position]] for h in range(args.heads)]], np.int64)  # (1, H, 1, 3)
    update = np.ones((1, args.heads, 1, args.head_dim), np.float32)

    def step(shared: bool):
        binding = session.io_binding()
        binding.bind_ortvalue_input("past", buffer)
        binding.bind_cpu_input("indices", indices)
        binding.bind_cpu_input("update", update)
        if shared:
            binding.bind_ortvalue_output("present", buffer)
        else:
            binding.bind_output("present", "cpu")
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0]

    times = {False: [], True: []}
    in_place = None
    for _ in range(3):
        step(False), step(True)
    for _ in range(100):  # alternate, so machine drift affects both alike
        for shared in (False, True):
            start = time.perf_counter()
            out = step(shared)
            times[shared].append(time.perf_counter() - start)
            if shared:
                in_place = out.data_ptr() == buffer.data_ptr()
    written = float(buffer.numpy()[0, 0, position].sum()) == args.head_dim
    mib = args.heads * args.capacity * args.head_dim * 4 / 2**20
    print(f"## One layer's K update, buffer (1, {args.heads}, {args.capacity}, {args.head_dim}) float32 = {mib:.1f} MiB\n")
    print("| present bound to | median ms | output is the input buffer |")
    print("|---|---:|:-:|")
    print(f"| a fresh allocation | {statistics.median(times[False]) * 1e3:.3f} | no |")
    print(f"| the past OrtValue (IO binding) | {statistics.median(times[True]) * 1e3:.3f} | {'yes' if in_place else 'NO'} |")
    print(f"\nupdate written in place: {'yes' if written and in_place else 'NO'}")
    print(f"machine: {describe('CPUExecutionProvider')}")


if __name__ == "__main__":
    main()
