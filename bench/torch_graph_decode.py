"""The peer on the same GPU: kvserve's eager model decoding under torch's CUDA graphs (torch.compile, mode
"reduce-overhead": inductor's fused kernels, replayed as CUDA graphs), at the shapes bench/cuda_graph_decode.py
times ONNX Runtime's captured steps at.

The eager model's own slots step (GPT2/Llama.forward_slots: the same cache layout the artifacts are exported from)
runs one token a row over a pool of fixed shape: every input a static buffer, the read width fixed (the widest
column the run reaches), so one compiled graph serves every step; the K/V each step writes are copied back into the
pool inside the compiled function (the pool and inputs marked static, so torch captures it: it skips CUDA graphs for
a function that mutates inputs it does not know to be static, and says so on stderr). Batch 1 (128-token context, 128 new tokens) and a static batch of 64 rows (32 +
64): ms per step, tokens/s, best of --rounds rounds after the compile and a warm-up. Random weights (the preset's,
seed 0: the artifact's own); timing only, no tokens compared. --backend cudagraphs keeps torch's CUDA graphs without
inductor (for a host without Triton). Prints a markdown table and the machine.

--static-batches 64x2 serves bench/grpc_load.py's mixed load instead (64 streams of 2 requests, each request's new
tokens from --new-tokens-range: bench/workload.py) as a static batch server would: the streams' k-th requests make a
batch, prompts teacher-forced a token a step through the same captured step, then every row decodes until the batch's
longest is done. Its tokens/s against the server's at 64 streams on the same requests is issue 50's "continuous
batching against a static batch"; the equal-length static batch of the shapes above is the best case a static batch
has, which continuous batching can at most equal.

    python bench/torch_graph_decode.py [--preset gpt2] [--rounds 3] [--backend reduce-overhead|cudagraphs|eager]
                                       [--static-batches 64x2 --new-tokens-range 16,128] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from workload import new_token_counts, token_range  # noqa: E402

from kvserve.model.decoders import build  # noqa: E402
from kvserve.model.presets import preset  # noqa: E402

SHAPES = {"batch 1": (1, 128, 128), "static batch 64": (64, 32, 64)}  # rows, context before decoding, new tokens


class StaticStep:
    """The eager model's slots step (forward_slots) over rows x width, every input a static buffer, one token a row:
    compiled by backend (eager: as it is). run() returns each row's greedy token (B,); start(position) puts every row at
    position (its mask reads the columns up to it); feed(tokens) writes the next step's tokens (B,) one column on."""

    def __init__(self, model, rows: int, width: int, backend: str):
        device = next(model.parameters()).device
        self.width = width  # every step reads this many columns, its mask saying which are real
        pool = model.empty_cache(rows, width + 1)  # (B, H_kv, C, d_k) per layer; the last column is the scratch one
        self.ids = torch.zeros(rows, 1, dtype=torch.int64, device=device)  # (B, 1)
        self.positions = torch.zeros(rows, 1, dtype=torch.int64, device=device)  # (B, 1)
        self.mask = torch.zeros(rows, width, dtype=torch.int64, device=device)  # (B, W)
        chunk = torch.zeros(1, 0, dtype=torch.int64, device=device)  # (1, 0): no prompt chunk
        chunk_mask = torch.ones(1, 1, dtype=torch.int64, device=device)  # (1, 1)
        chunk_slot = torch.zeros(1, dtype=torch.int64, device=device)  # (1,)
        every_row = torch.arange(rows, device=device)  # (B,)
        # Static addresses: a captured graph may write the pool in place and read the inputs where they are (torch skips
        # CUDA graphs for a function that mutates inputs it does not know to be static).
        for tensor in [self.ids, self.positions, self.mask, chunk, chunk_mask, chunk_slot, every_row] + [t for layer in pool for t in layer]:
            torch._dynamo.mark_static_address(tensor)

        def step():
            logits, presents = model.forward_slots(self.ids, self.positions, self.mask, chunk, chunk, chunk_mask, chunk_slot, every_row, pool)
            for (past_k, past_v), (k, v) in zip(pool, presents):
                past_k.copy_(k)
                past_v.copy_(v)
            return logits.argmax(-1)  # (B,): greedy, as the captured ONNX steps return

        self.run = step if backend == "eager" else torch.compile(step, mode="reduce-overhead") if backend == "reduce-overhead" \
            else torch.compile(step, backend="cudagraphs")

    def start(self, position: int) -> None:
        self.positions.fill_(position)
        self.mask.zero_()
        self.mask[:, : position + 1] = 1

    def feed(self, tokens: torch.Tensor) -> None:
        self.ids.copy_(tokens[:, None])
        self.positions.add_(1)
        self.mask.scatter_(1, self.positions.clamp(max=self.width - 1), 1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_steps(model, rows: int, start: int, new_tokens: int, backend: str, rounds: int) -> float:
    """Best seconds per decode step of rows rows, each from position start for new_tokens steps."""
    device = next(model.parameters()).device
    step = StaticStep(model, rows, start + new_tokens, backend)
    best = float("inf")
    with torch.inference_mode():
        for round_ in range(rounds + 1):  # round 0 compiles and warms up
            step.start(start)
            synchronize(device)
            began = time.perf_counter()
            for _ in range(new_tokens):
                step.feed(step.run())
            synchronize(device)
            if round_:
                best = min(best, (time.perf_counter() - began) / new_tokens)
    return best


def static_batches(model, streams: int, requests_per_stream: int, prompt_tokens: int, token_range: tuple[int, int], backend: str,
                   rounds: int) -> tuple[float, int, int, int]:
    """The workload of bench/grpc_load.py --levels STREAMS --new-tokens-range (bench/workload.py's counts) served as a
    static batch server serves it: the streams' k-th requests form batch k, whose prompts go in as steps of one token
    a row (teacher-forced through the same step), then every row decodes until the batch's longest is done, finished
    rows with it. Returns (best seconds of a whole round, tokens the requests asked for, steps run, steps the rows
    needed)."""
    device = next(model.parameters()).device
    counts = new_token_counts(streams * requests_per_stream, *token_range)
    batches = [[counts[w * requests_per_stream + k] for w in range(streams)] for k in range(requests_per_stream)]
    prompts = torch.randint(0, model.config.vocab_size, (streams, prompt_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    step = StaticStep(model, streams, prompt_tokens + max(counts), backend)
    best, steps = float("inf"), 0
    with torch.inference_mode():
        for round_ in range(rounds + 1):  # round 0 compiles and warms up
            steps = 0
            synchronize(device)
            began = time.perf_counter()
            for batch in batches:
                step.start(0)
                step.ids.copy_(prompts[:, :1])
                for t in range(1, prompt_tokens):
                    step.run()
                    step.feed(prompts[:, t])
                for _ in range(max(batch)):  # the last prompt token's step gives the first new token
                    step.feed(step.run())
                steps += prompt_tokens - 1 + max(batch)
            synchronize(device)
            if round_:
                best = min(best, time.perf_counter() - began)
    needed = sum(prompt_tokens - 1 + n for n in counts)
    return best, sum(counts), steps * streams, needed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", default="reduce-overhead", choices=("reduce-overhead", "cudagraphs", "eager"))
    parser.add_argument("--static-batches", metavar="STREAMSxREQUESTS", default=None,
                        help="instead of the shapes: bench/grpc_load.py's load of STREAMS streams of REQUESTS requests each "
                        "(e.g. 64x2), served in static batches")
    parser.add_argument("--new-tokens-range", type=token_range, default=(16, 128), metavar="LOW,HIGH",
                        help="with --static-batches: each request's new tokens (bench/workload.py; default 16,128)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="with --static-batches (default 32, as bench/grpc_load.py)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: float32 and --backend eager only, to try the script where there is no GPU")
    args = parser.parse_args()
    batches = None
    if args.static_batches is not None:
        parts = args.static_batches.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            parser.error(f"--static-batches {args.static_batches!r}: STREAMSxREQUESTS, two whole numbers, e.g. 64x2")
        batches = (int(parts[0]), int(parts[1]))
    if args.device == "cpu" and args.backend != "eager":
        parser.error("--device cpu runs --backend eager only (CUDA graphs need the GPU)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device: this peer runs on a GPU (--device cpu --backend eager tries it here)")
    model = build(preset(args.preset), seed=0).eval()
    model = model.half().cuda() if args.device == "cuda" else model
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{args.preset} {'float16' if args.device == 'cuda' else 'float32'}, torch {torch.__version__}, backend {args.backend}, {where}, "
          f"best of {args.rounds} rounds\n")
    if batches is not None:
        streams, requests = batches
        seconds, tokens, steps, needed = static_batches(model, streams, requests, args.prompt_tokens, args.new_tokens_range,
                                                        args.backend, args.rounds)
        print(f"Static batches of {streams} (each stream's k-th request in batch k), prompt {args.prompt_tokens} teacher-forced, "
              "new tokens {}-{} each (bench/workload.py)\n".format(*args.new_tokens_range))
        print("| streams x requests | tokens asked for | seconds | tokens/s | row-steps run / needed |")
        print("|---|---:|---:|---:|---:|")
        print(f"| {streams} x {requests} | {tokens} | {seconds:.3f} | {tokens / seconds:.1f} | {steps} / {needed} |")
    else:
        print("| shape | rows | ms/step | tokens/s |")
        print("|---|---:|---:|---:|")
        for name, (rows, start, new_tokens) in SHAPES.items():
            torch._dynamo.reset()
            seconds = decode_steps(model, rows, start, new_tokens, args.backend, args.rounds)
            print(f"| {name} | {rows} | {seconds * 1e3:.2f} | {rows / seconds:.1f} |", flush=True)
    print(f"\nmachine: {describe('CUDAExecutionProvider' if args.device == 'cuda' else 'CPUExecutionProvider')}")


if __name__ == "__main__":
    main()
