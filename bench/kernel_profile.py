"""What a decode step launches on the GPU: the kernels of one artifact's fixed-shape decode step (the step
`serve --cuda-graph` captures), recorded by torch's profiler (CUPTI sees every kernel in the process, ONNX Runtime's
included), from a session that does not capture, so each kernel is its own record.

Per step: kernels launched, the sum of their GPU time, and the kernels grouped by name (the top --top), batch 1
at a 128-token context. Against the captured step's wall time (bench/cuda_graph_decode.py) the sum says how much of
a replayed step is kernel work and how much the gaps between kernels. Prints markdown tables and the machine.
--attention-kernels opens the runtime under another choice of GroupQueryAttention's decode kernel
(bench/attention_kernels.py), whose kernels the table then names.

    python bench/kernel_profile.py --artifact DIR [--steps 20] [--top 15] [--attention-kernels default|flash|cudnn]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_kernels  # noqa: E402
from machine import describe  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--attention-kernels", choices=tuple(attention_kernels.CHOICES), default="default")
    args = parser.parse_args()
    artifact = open_artifact(args.artifact)
    config = artifact.config
    with attention_kernels.opened_under(args.attention_kernels):
        runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, "cuda", decode_graph=True)
    pool = runtime.new_pool(1, config.n_kv_head, config.d_head, min(config.n_ctx, 1024) + 1)
    fused = runtime.attention == "fused"

    def step(position: int):
        mask = None if fused else np.ones((1, 256), np.int64)  # (1, W): a standard graph's bucketed width
        runtime.run_decode(pool, np.array([7]), np.array([position]), mask, with_logits=False)

    for position in range(128, 140):  # binding, kernel selection, the arena's first allocations
        step(position)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as recorded:
        for position in range(140, 140 + args.steps):
            step(position)
        torch.cuda.synchronize()
    kernels = [e for e in recorded.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.time_range.elapsed_us() for e in kernels)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for event in kernels:
        by_name[event.name][0] += 1
        by_name[event.name][1] += event.time_range.elapsed_us()
    print(f"{args.artifact} ({artifact.attention} attention, {artifact.dtype}; attention kernels: {args.attention_kernels} "
          f"{attention_kernels.CHOICES[args.attention_kernels] or ''}), batch 1, {args.steps} decode steps, uncaptured\n")
    print("| kernels a step | GPU time a step, µs |")
    print("|---:|---:|")
    print(f"| {len(kernels) / args.steps:.1f} | {total_us / args.steps:.1f} |\n")
    print("| kernel | a step | µs a step |")
    print("|---|---:|---:|")
    for name, (count, us) in sorted(by_name.items(), key=lambda item: -item[1][1])[: args.top]:
        print(f"| {name[:90].replace('|', '/')} | {count / args.steps:.1f} | {us / args.steps:.1f} |")
    print(f"\nmachine: {describe(runtime.provider)}")


if __name__ == "__main__":
    main()
