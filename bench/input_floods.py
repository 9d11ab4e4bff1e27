"""Does one client's input slow another's stream? A running stream's time alone and beside 4 clients flooding the
largest inputs the limits admit, per kind of flood, in one run:

  grpc-prompts   256 KiB prompts over gRPC (--max-text-bytes): tokenized, then refused for the context
  http-prompts   256 KiB chat contents over HTTP
  http-bodies    4 MiB HTTP bodies (--max-message-bytes), one long prompt each: parsed, then refused for its size
  tokenize       32 concurrent Tokenize calls of 256 KiB (the flood tests/service/edges/test_security.py holds)

The flooding clients run in another process at the lowest priority (on 2 cores they would otherwise take a core from
the server, which a client on another machine does not). Each round measures the stream alone (median of 3), then
beside each flood for --seconds: the median and the mean of the streams run while it lasts (a few streams held for
seconds hide below a median: the mean, and how many streams ran, show them).

    python bench/input_floods.py --artifact artifacts/kjv-gpt2 [--rounds 3] [--seconds 8] [--baseline-python PYTHON]

--baseline-python also runs, in turn with this checkout's, the server of another environment where another kvserve
is installed (as bench/serving_latency.py does), so old and new code meet the same floods in one run.

The same script is the flooding client (`--client KIND TARGET HTTP_PORT SIZE SECONDS`), which
tests/service/edges/test_floods.py runs against its own server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from serving_latency import Server, free_port  # noqa: E402

KINDS = ("grpc-prompts", "http-prompts", "http-bodies", "tokenize")
STREAM_TOKENS = 48


def flood(kind: str, target: str, http_port: int, size: int, seconds: float) -> None:
    """The flooding client: 4 threads (32 for tokenize) sending kind's largest input until the time is up; prints
    "flooding" when it starts and how many requests it sent when it ends."""
    import grpc

    from kvserve.v1 import generation_pb2 as pb
    from kvserve.v1 import generation_pb2_grpc as pb_grpc

    text = ("In the beginning was the Word. " * (size // 31 + 1))[:size]
    deadline = time.monotonic() + seconds
    sent = []
    stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 2**26),
                                                                                 ("grpc.max_receive_message_length", 2**26)]))

    def grpc_prompts():
        while time.monotonic() < deadline:
            try:
                list(stub.Generate(pb.GenerateRequest(text=text, max_new_tokens=1), timeout=60))
            except grpc.RpcError:
                pass
            sent.append(1)

    def tokenize():
        stub.Tokenize(pb.TokenizeRequest(text=text), timeout=120)
        sent.append(1)

    def http_bodies(body: bytes):
        import http.client

        while time.monotonic() < deadline:
            connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
            connection.request("POST", "/v1/chat/completions" if b'"messages"' in body[:40] else "/v1/completions", body=body,
                               headers={"content-type": "application/json"})
            connection.getresponse().read()
            connection.close()
            sent.append(1)

    model = "none"
    if kind.startswith("http"):  # the name the server answers to, so a body is read for what it is, not refused as 404
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=30) as reply:
            model = json.loads(reply.read())["data"][0]["id"]
    if kind == "grpc-prompts":
        work, args, clients = grpc_prompts, (), 4
    elif kind == "tokenize":
        work, args, clients = tokenize, (), 32
    elif kind == "http-prompts":
        body = json.dumps({"messages": [{"role": "user", "content": text}], "model": model, "max_tokens": 1}).encode()
        work, args, clients = http_bodies, (body,), 4
    else:  # http-bodies: one long prompt, as large as the whole body may be
        work, args, clients = http_bodies, (json.dumps({"prompt": "x" * (size - 64), "model": model, "max_tokens": 1}).encode(),), 4
    threads = [threading.Thread(target=work, args=args) for _ in range(clients)]
    print("flooding", flush=True)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(len(sent), flush=True)


def flood_process(kind: str, target: str, http_port: int, size: int, seconds: float) -> subprocess.Popen:
    """This script as the flooding client, at the lowest priority, once it says it is flooding."""
    process = subprocess.Popen(["nice", "-n", "19", sys.executable, __file__, "--client", kind, target, str(http_port), str(size),
                                str(seconds)], stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "flooding":
        process.kill()
        raise RuntimeError(f"the {kind} flood did not start")
    return process


def stream_seconds(target: str) -> float:
    """One greedy stream of STREAM_TOKENS tokens as a new client sees it: from opening its channel to closing it."""
    import grpc

    from kvserve.v1 import generation_pb2 as pb
    from kvserve.v1 import generation_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_new_tokens=STREAM_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    with grpc.insecure_channel(target) as channel:
        assert len(list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=120))) == STREAM_TOKENS
    return time.perf_counter() - start


def beside_flood(kind: str, target: str, http_port: int, size: int, seconds: float) -> tuple[list[float], int]:
    """The streams run while kind's flood lasts, and how many requests the flood sent."""
    process = flood_process(kind, target, http_port, size, seconds)
    streams = []
    while process.poll() is None:
        streams.append(stream_seconds(target))
    return streams, int(process.stdout.read().strip() or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/kjv-gpt2", help="an artifact with a chat template (the default model's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="how long each flood lasts")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--baseline-python", help="the interpreter of an environment where the baseline's kvserve is installed")
    parser.add_argument("--client", nargs=5, metavar=("KIND", "TARGET", "HTTP_PORT", "SIZE", "SECONDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        kind, target, http_port, size, seconds = args.client
        flood(kind, target, int(http_port), int(size), float(seconds))
        return
    kinds = args.kinds.split(",")
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(unknown)} (choose from {', '.join(KINDS)})")
    if not (Path(args.artifact) / "manifest.json").is_file():
        parser.error(f"--artifact {args.artifact}: not an artifact (make bench exports artifacts/kjv-gpt2)")
    pythons = ([("baseline", args.baseline_python)] if args.baseline_python else []) + [("new", sys.executable)]
    rows = {(name, kind): [] for name, _ in pythons for kind in kinds}
    for _ in range(args.rounds):
        for name, python in pythons:  # alternating: drift on a shared machine hits both alike
            http_port = free_port()
            with Server(name, args.artifact, "cpu", python, ["--http-port", str(http_port)]) as server:
                stream_seconds(server.target)  # warm
                for kind in kinds:
                    alone = statistics.median(stream_seconds(server.target) for _ in range(3))
                    size = 4 * 2**20 if kind == "http-bodies" else 256 * 1024
                    streams, sent = beside_flood(kind, server.target, http_port, size, args.seconds)
                    rows[(name, kind)].append((alone, statistics.median(streams), statistics.fmean(streams), len(streams), sent))
    print(f"## A running stream ({STREAM_TOKENS} tokens) alone and beside floods of the largest inputs, {args.artifact}, "
          f"{args.rounds} rounds of {args.seconds:g} s floods{', servers alternating' if args.baseline_python else ''}\n")
    print("| server | flood | round | alone ms | beside ms, median | beside ms, mean | median / alone | mean / alone | streams beside "
          "| flood requests |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind in kinds:
        for name, _ in pythons:
            for index, (alone, median, mean, streams, sent) in enumerate(rows[(name, kind)], 1):
                print(f"| {name} | {kind} | {index} | {alone * 1e3:.1f} | {median * 1e3:.1f} | {mean * 1e3:.1f} | {median / alone:.2f}x "
                      f"| {mean / alone:.2f}x | {streams} | {sent} |")
    print(f"\nmachine: {describe('cpu')}")


if __name__ == "__main__":
    main()
