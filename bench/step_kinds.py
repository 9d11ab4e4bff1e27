"""Where a loaded server's step time goes, by kind of step: the engine in this process (no gRPC) under N concurrent
streams (prompt 32, 64 new tokens, greedy, 2 requests a stream), every model step timed with what it ran: decode
only at a fixed shape (captured under --cuda-graph), decode only at its own shape, decode rows beside a prompt chunk,
a chunk alone, fresh prompts prefilled together (beside decoding rows or alone: Scheduler.prompt_group, where steps
split); and the rows the batch held then.

Per kind: steps, their share of the run's step time, p50 / p99 / max ms, rows (p50 / max); for the first load (every
shape new to the sessions) and the second (each seen once), so what a shape's first run costs shows apart from what a
step costs. Then the first load's slowest steps, each with its shape (rows, decode rows, chunk tokens, or for prompts
prefilled together how many and the longest) and whether that shape had run before. --no-mem-pattern opens the sessions without ONNX Runtime's memory patterns (planned per set of
input shapes), to tell whether planning them is what a new shape costs; --ort-profile DIR profiles every session
(ONNX Runtime's own profiler) and names the nodes that make its slowest runs slow: each node's time in the runs over
3x the session's median run against its median in the others. --warm-chunks runs the server's CUDA warm-up of every
chunk length first (service/process/gate.py): whether it takes the first load's stalls away. Prints markdown tables
and the machine.

    python bench/step_kinds.py --artifact DIR [--provider cuda] [--cuda-graph] [--streams 16] [--max-batch-size 256]
                               [--no-mem-pattern] [--ort-profile DIR] [--split-steps auto|on|off] [--warm-chunks]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpc_load import InProcess, prompt_ids  # noqa: E402
from machine import describe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--provider", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--cuda-graph", action="store_true")
    parser.add_argument("--split-steps", choices=("auto", "on", "off"), default="auto",
                        help="a fused float16 artifact's steps through its chunk and decode graphs (default auto: on CUDA)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--no-mem-pattern", action="store_true", help="sessions without ONNX Runtime's memory patterns")
    parser.add_argument("--slowest", type=int, default=12, help="the first load's slowest steps listed (default 12)")
    parser.add_argument("--ort-profile", help="profile the sessions into this folder and name the slow runs' nodes")
    parser.add_argument("--warm-chunks", action="store_true",
                        help="first run the server's CUDA warm-up of every chunk length beside a decoding row (gate.warm_chunk_lengths)")
    args = parser.parse_args()
    sessions = []
    if args.no_mem_pattern or args.ort_profile:
        import onnxruntime as ort

        class Options(ort.SessionOptions):
            def __init__(self):
                super().__init__()
                if args.no_mem_pattern:
                    self.enable_mem_pattern = False
                if args.ort_profile:
                    Path(args.ort_profile).mkdir(parents=True, exist_ok=True)
                    self.enable_profiling = True
                    self.profile_file_prefix = str(Path(args.ort_profile) / "session")

        class Session(ort.InferenceSession):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                sessions.append(self)

        ort.SessionOptions, ort.InferenceSession = Options, Session  # what runtime/providers.py opens its sessions with
    local = InProcess(args.artifact, args.provider, args.cuda_graph, args.max_batch_size, args.split_steps)
    batch = local.batch
    if args.warm_chunks:  # on the step thread, as the server warms up: its shapes are not among the loads' "new" ones
        from kvserve.service.core.limits import EngineLimits
        from kvserve.service.process.gate import warm_chunk_lengths

        began = time.perf_counter()
        local.steps.submit(warm_chunk_lengths, batch, EngineLimits.step_token_budget, None).result()
        print(f"chunk warm-up (every chunk length beside a decoding row): {time.perf_counter() - began:.2f} s\n")
    timings = collections.defaultdict(list)  # kind -> [(seconds, rows)]
    steps = []  # (seconds, kind, shape, shape new to the sessions), every step of every load
    seen = set()
    run = batch.run

    def timed(plan, before_model=None):
        chunk = plan.chunk is not None
        decode = bool(plan.decode)
        if plan.prompts:  # fresh prompts prefilled together (Scheduler.prompt_group): (how many, the longest) is its shape
            kind = "decode + prompts" if decode else "prompts alone"
            prompt_tokens = (len(plan.prompts), max(len(seq.prompt_ids) for seq in plan.prompts))
        else:
            kind = ("decode + chunk" if decode else "chunk alone") if chunk else ("decode, fixed shape" if batch.fixed_decode else "decode")
            prompt_tokens = plan.chunk_tokens if chunk else 0
        start = time.perf_counter()
        results = run(plan, before_model)
        seconds = time.perf_counter() - start
        rows = len(plan.slots)
        shape = (kind, rows, len(plan.decode), prompt_tokens)
        steps.append((seconds, kind, shape, shape not in seen))
        seen.add(shape)
        timings[kind].append((seconds, rows))
        return results

    batch.run = timed
    vocab = local.config.vocab_size

    async def load():
        engine = local.engine()
        try:
            async def stream(k):
                for r in range(2):
                    await local.request(engine, prompt_ids(5000 + 2 * k + r, 32, vocab), 64)
            await asyncio.gather(*(stream(k) for k in range(args.streams)))
        finally:
            await engine.close()

    print(f"{args.artifact}, {local.runtime.provider}, {args.streams} streams, max batch {args.max_batch_size}, "
          f"cuda graph {'captured' if local.runtime.captures_decode else 'off'}, memory patterns "
          f"{'off' if args.no_mem_pattern else 'on'}, steps {'split between the chunk and decode graphs' if local.runtime.splits_steps else 'through the step graph'}\n")
    first_steps = []
    for load_name in ("first load (shapes new)", "second load (shapes seen)"):
        timings.clear()
        steps.clear()
        began = time.perf_counter()
        asyncio.run(load())
        wall = time.perf_counter() - began
        first_steps = first_steps or list(steps)
        total = sum(s for values in timings.values() for s, _ in values)
        print(f"### {load_name}: {wall:.2f} s wall, {total:.2f} s in steps, {sum(new for *_, new in steps)} new shapes\n")
        print("| step | steps | share of step time | p50 ms | p99 ms | max ms | rows p50 | rows max |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for kind, values in sorted(timings.items()):
            seconds = np.array([s for s, _ in values]) * 1e3
            rows = np.array([r for _, r in values])
            print(f"| {kind} | {len(values)} | {seconds.sum() / 1e3 / total:.0%} | {np.percentile(seconds, 50):.2f} | "
                  f"{np.percentile(seconds, 99):.2f} | {seconds.max():.2f} | {int(np.median(rows))} | {rows.max()} |")
        print()
    print("### the first load's slowest steps\n")
    print("| ms | step | rows held | decode rows | chunk tokens (prompts, longest) | shape new |")
    print("|---:|---|---:|---:|---:|:-:|")
    for seconds, kind, (_, rows, decode_rows, chunk_tokens), new in sorted(first_steps, key=lambda s: s[0], reverse=True)[:args.slowest]:
        print(f"| {seconds * 1e3:.2f} | {kind} | {rows} | {decode_rows} | {chunk_tokens} | {'yes' if new else 'no'} |")
    news = [s * 1e3 for s, *_, new in first_steps if new]
    olds = [s * 1e3 for s, *_, new in first_steps if not new]
    if news and olds:
        print(f"\nfirst load: steps of a new shape p50 {np.median(news):.2f} ms ({len(news)}), of a shape seen p50 {np.median(olds):.2f} ms ({len(olds)})")
    for session in sessions if args.ort_profile else []:
        slow_run_nodes(session.end_profiling())
    print(f"\nmachine: {describe(local.runtime.provider)}")


def slow_run_nodes(profile: str, top: int = 10) -> None:
    """From one session's profile: its runs over 3x its median run, and the nodes whose time in those runs exceeds
    their median in the others the most."""
    import json

    events = json.loads(Path(profile).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    if len(runs) < 4:
        return
    durations = np.array([end - start for start, end in runs])
    threshold = 3 * np.median(durations)
    slow = {(start, end) for start, end in runs if end - start > threshold}
    starts = np.array([start for start, _ in runs])
    in_slow, elsewhere = collections.defaultdict(list), collections.defaultdict(list)
    names = {}
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        run = runs[int(np.searchsorted(starts, e["ts"], side="right")) - 1]
        node = e["name"].removesuffix("_kernel_time")
        names[node] = e.get("args", {}).get("op_name", "?")
        (in_slow if run in slow else elsewhere)[node].append(e["dur"])
    print(f"\n### {Path(profile).name}: {len(runs)} runs, median {np.median(durations) / 1e3:.2f} ms; "
          f"{len(slow)} over {threshold / 1e3:.2f} ms, {sum(e - s for s, e in slow) / 1e3:.1f} ms in all\n")
    if not slow:
        return
    excess = {node: np.mean(t) - (np.median(elsewhere[node]) if elsewhere[node] else 0.0) for node, t in in_slow.items()}
    print("| node | op | mean ms in the slow runs | median ms elsewhere | runs |")
    print("|---|---|---:|---:|---:|")
    for node, _ in sorted(excess.items(), key=lambda item: item[1], reverse=True)[:top]:
        other = f"{np.median(elsewhere[node]) / 1e3:.3f}" if elsewhere[node] else "n/a"
        print(f"| {node[:60]} | {names[node]} | {np.mean(in_slow[node]) / 1e3:.3f} | {other} | {len(in_slow[node])} |")


if __name__ == "__main__":
    main()
