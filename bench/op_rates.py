"""The two operators a batched int4 decode step spends its time in, alone: ONNX Runtime's MatMulNBits (the weight
matmuls) by bits and scale-block size, and GroupQueryAttention (attention over the K/V pool) by cache dtype, each a
graph of that one node on the CPU provider, timed at 1 and 16 rows. Prints two tables (median ms of --runs after a
warm-up) and the machine: what an export's --quantize-block, --attention-bits and --kv-dtype cost a step of the shape.

    python bench/op_rates.py [--k 2560] [--n 19456] [--heads 32 8 128] [--past 128] [--runs 15]

(Defaults: the Qwen3-4B shape's MLP gate/up matmul, its attention heads.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

MS = "com.microsoft"
CACHE_TYPES = {"float32": (TensorProto.FLOAT, np.float32), "float16": (TensorProto.FLOAT16, np.float16), "int8": (TensorProto.INT8, np.int8)}


def session(nodes, inputs, outputs, initializers) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "op", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)], ir_version=10)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_ms(run, runs: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return float(np.median(times)) * 1e3


def matmul_nbits(k: int, n: int, bits: int, block: int, rows: int, runs: int) -> float:
    blocks = -(-k // block)
    weights = np.random.randint(0, 255, size=(n, blocks, block * bits // 8), dtype=np.uint8)
    scales = np.random.rand(n * blocks).astype(np.float32) * 0.01
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain=MS, K=k, N=n, bits=bits, block_size=block, accuracy_level=4)
    run = session([node], [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
                  [numpy_helper.from_array(weights, "B"), numpy_helper.from_array(scales, "S")])
    a = np.random.rand(rows, k).astype(np.float32)
    return median_ms(lambda: run.run(None, {"A": a}), runs)


def group_query_attention(heads: int, kv_heads: int, d: int, rows: int, past: int, cache: str, runs: int) -> float:
    """One layer's attention for rows decoding rows (one token each) over past cached positions, the pool a shared
    past/present buffer as kvserve's fused graph binds it, rotary on."""
    elem, dtype = CACHE_TYPES[cache]
    width = past + 16
    inputs = ["qkv", "", "", "pk", "pv", "seqlens", "total", "cos", "sin"]
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, do_rotary=1)
    initializers = [numpy_helper.from_array(np.random.rand(4096, d // 2).astype(np.float32), name) for name in ("cos", "sin")]
    if cache == "int8":
        inputs += ["", "", "", "ks", "vs"]
        attrs |= dict(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
        initializers += [numpy_helper.from_array(np.full((1, kv_heads, 1, d), 0.02, np.float32), name) for name in ("ks", "vs")]
    pool = [helper.make_tensor_value_info(name, elem, [rows, kv_heads, width, d]) for name in ("pk", "pv")]
    run = session([helper.make_node("GroupQueryAttention", inputs, ["out", "pk_out", "pv_out"], domain=MS, **attrs)],
                  [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [rows, 1, (heads + 2 * kv_heads) * d]), *pool,
                   helper.make_tensor_value_info("seqlens", TensorProto.INT32, [rows]),
                   helper.make_tensor_value_info("total", TensorProto.INT32, [])],
                  [helper.make_tensor_value_info("out", TensorProto.FLOAT, [rows, 1, heads * d]),
                   *(helper.make_tensor_value_info(name, elem, [rows, kv_heads, width, d]) for name in ("pk_out", "pv_out"))],
                  initializers)
    keys, values = (ort.OrtValue.ortvalue_from_numpy((np.random.rand(rows, kv_heads, width, d) * 10).astype(dtype)) for _ in range(2))
    binding = run.io_binding()
    binding.bind_cpu_input("qkv", np.random.rand(rows, 1, (heads + 2 * kv_heads) * d).astype(np.float32))
    binding.bind_cpu_input("seqlens", np.full(rows, past, np.int32))
    binding.bind_cpu_input("total", np.array(past + 1, np.int32))
    binding.bind_ortvalue_input("pk", keys)
    binding.bind_ortvalue_input("pv", values)
    binding.bind_output("out")
    binding.bind_ortvalue_output("pk_out", keys)  # the present is the past's memory, as the server binds it
    binding.bind_ortvalue_output("pv_out", values)
    return median_ms(lambda: run.run_with_iobinding(binding), runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=2560)
    parser.add_argument("--n", type=int, default=19456)
    parser.add_argument("--heads", type=int, nargs=3, default=(32, 8, 128), metavar=("QUERY", "KV", "HEAD_DIM"))
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    if min(args.k, args.n, *args.heads, args.past, args.runs) < 1 or args.k % 256:
        sys.exit("op_rates: every size must be at least 1, and --k a multiple of 256")
    print(f"## MatMulNBits, K {args.k}, N {args.n}, accuracy level 4 (int8 compute): median ms of {args.runs}\n")
    print("| bits | block | 1 row | 16 rows | GOP/s at 16 rows |")
    print("|---:|---:|---:|---:|---:|")
    for bits, block in ((4, 32), (4, 64), (4, 128), (4, 256), (8, 256)):
        one, sixteen = (matmul_nbits(args.k, args.n, bits, block, rows, args.runs) for rows in (1, 16))
        print(f"| {bits} | {block} | {one:.2f} | {sixteen:.2f} | {2 * 16 * args.k * args.n / sixteen / 1e6:.0f} |")
    heads, kv_heads, d = args.heads
    print(f"\n## GroupQueryAttention, {heads} query and {kv_heads} K/V heads of {d}, one layer, past {args.past}: median ms of {args.runs}\n")
    print("| cache | 1 row | 16 rows |")
    print("|---|---:|---:|")
    for cache in CACHE_TYPES:
        one, sixteen = (group_query_attention(heads, kv_heads, d, rows, args.past, cache, args.runs) for rows in (1, 16))
        print(f"| {cache} | {one:.3f} | {sixteen:.3f} |")
    print(f"\nmachine: {describe('cpu')}")


if __name__ == "__main__":
    main()
