"""Speculation on a copy-heavy workload against llama.cpp's: kvserve's server with --speculation on and off, and
llama-server with each of its draftless --spec-type choices, on the same weights and the same prompts.

The model quotes its context: checkpoints/kjv-quote-gpt2, trained on from the default model with a share of its
windows passages recited after a cue (docs/models.md, "A model that quotes its context", says how), then exported.
The prompts: the end-of-text token, held-out passages and the cue (never trained on), as
token ids; each asks for as many tokens as its passage has (ignore_eos), greedy. llama.cpp gets the checkpoint converted by
its own convert_hf_to_gguf.py to an F32 GGUF (its pre-tokenizer check told the byte-level BPE is GPT-2's, which it is;
the prompts are ids, so its text handling is never used), and before anything is timed its greedy tokens must be
kvserve's for the first prompt.

Both servers over HTTP, one request at a time (batch 1), and 16 at once; whole answers (not streamed); 2 threads each.
Every server runs at once, fresh each round, and they take turns request by request (batch 1: each prompt goes to every
server, the order turning by one server a prompt; 16 streams: each server's 16 at once, in turns too), so a shared
machine's drift, which moved one server's pass over the prompts by a third from one minute to the next on this VM,
falls on all of them alike. Before each request the client waits SETTLE seconds: a server that has just answered still
spins its threads a while (ONNX Runtime's and ggml's thread pools), and when the next request followed at once
llama-server's copy workload ran a third slower after kvserve's requests, kvserve's a tenth slower after llama-server's
(by hand). Per server: tokens/s (median of the rounds: its tokens over its requests' time), kvserve with speculation on
over each other server round by round (the median of the rounds' ratios), and kvserve's drafts taken and refused at
batch 1, in every round (a round that drafts far less than the others shows there).

    python bench/speculation_peers.py --checkpoint checkpoints/kjv-quote-gpt2 --artifact artifacts/kjv-quote \\
        --llama-cpp PATH/llama.cpp [--build PATH/llama.cpp/build] --convert-python PYTHON [--rounds 3] [--prompts 12]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_compare import LlamaServer  # noqa: E402
from machine import describe  # noqa: E402
from serving_latency import Server, free_port  # noqa: E402

SPEC_TYPES = [("none", ()), ("ngram-simple", ()), ("ngram-simple n3 m8", ("--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8")),
              ("ngram-map-k", ()), ("ngram-mod", ()), ("ngram-cache", ())]
STREAMS = 16
SETTLE = 0.2  # seconds between two requests: what a server that has just answered spins on settles first

# Run inside llama.cpp's converter environment: its GPT-2 model class reads n_ctx, and its BPE check knows published
# tokenizers by a hash of how they split a test text; this one splits as GPT-2's does (tokenizers' ByteLevel).
CONVERT = """
import runpy, sys
root, argv = sys.argv[1], sys.argv[2:]
sys.path.insert(0, root)
import conversion.base as base
for name in dir(base):
    kind = getattr(base, name)
    if isinstance(kind, type) and hasattr(kind, "get_vocab_base_pre"):
        kind.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = [root + "/convert_hf_to_gguf.py", *argv]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def prompts(checkpoint: Path, count: int) -> list[tuple[list[int], int]]:
    """(prompt ids: the end-of-text token, a held-out passage and the cue; tokens to ask for: the passage's) of the first
    `count` held-out passages of at least 48 tokens (model/train.py recital_prompts)."""
    from tokenizers import Tokenizer

    from kvserve.model.corpus import load_corpus
    from kvserve.model.train import recital_prompts

    return recital_prompts(Tokenizer.from_file(str(checkpoint / "tokenizer.json")), load_corpus().held_out, count)


def gguf(checkpoint: Path, llama_cpp: Path, convert_python: str, out: Path) -> Path:
    """The checkpoint as an F32 GGUF by llama.cpp's converter (made once)."""
    path = out / f"{checkpoint.name}-F32.gguf"
    if path.exists():
        return path
    from kvserve.model.checkpoint import load_checkpoint, save_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(load_checkpoint(checkpoint), Path(tmp))
        config = json.loads((Path(tmp) / "config.json").read_text())
        (Path(tmp) / "config.json").write_text(json.dumps({**config, "n_ctx": config["n_positions"]}))
        shutil.copy2(checkpoint / "tokenizer.json", Path(tmp) / "tokenizer.json")
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        done = subprocess.run([convert_python, "-c", CONVERT, str(llama_cpp), tmp, "--outtype", "f32", "--outfile", str(path)],
                              capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return path


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())


class Kvserve:
    """kvserve serve on the artifact, its HTTP API."""

    def __init__(self, artifact: str, speculation: bool):
        self.http = free_port()
        self.server = Server(f"kvserve speculation {'on' if speculation else 'off'}", artifact, "cpu", sys.executable,
                             ["--http-port", str(self.http), "--speculation", "on" if speculation else "off", "--prompt-cache", "off"])

    def __enter__(self):
        self.server.__enter__()
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v1/models", timeout=60) as reply:
            self.model = json.loads(reply.read())["data"][0]["id"]
        return self

    def __exit__(self, *exc):
        self.server.__exit__(*exc)

    def complete(self, ids: list[int], n: int) -> tuple[list[int], int, int, int]:
        """(token ids, their count, drafts accepted, drafts refused) of one greedy answer: the ids over gRPC when asked for
        (ids=None in the timed runs: HTTP, as llama-server is asked)."""
        answer = post(f"http://127.0.0.1:{self.http}/v1/completions",
                      {"model": self.model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True})
        details = answer["usage"]["completion_tokens_details"]
        return [], answer["usage"]["completion_tokens"], details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]

    def token_ids(self, ids: list[int], n: int) -> list[int]:
        import grpc

        from kvserve.v1 import generation_pb2 as pb
        from kvserve.v1 import generation_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.server.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=n, ignore_eos=True)
            return [r.token.id for r in stub.Generate(request, timeout=600)]


class Llama:
    def __init__(self, build: Path, path: Path, extra: tuple[str, ...]):
        self.build, self.path, self.extra = build, path, extra

    def __enter__(self):
        self.server = LlamaServer(self.build / "bin" / "llama-server", self.path, 2, STREAMS, 256, ("--spec-type", *self.extra))
        return self

    def __exit__(self, *exc):
        self.server.close()

    def complete(self, ids: list[int], n: int):
        answer = post(f"http://127.0.0.1:{self.server.port}/completion",
                      {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True, "return_tokens": True,
                       "cache_prompt": False})
        return answer["tokens"], len(answer["tokens"]), 0, 0


def measure(server, work: list[tuple[list[int], int]], concurrent: bool) -> tuple[float, int, int, int]:
    """(seconds, tokens, drafts accepted, refused) of the work, one at a time or STREAMS at once."""
    start = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(STREAMS) as pool:
            answers = list(pool.map(lambda w: server.complete(*w), work))
    else:
        answers = [server.complete(*w) for w in work]
    seconds = time.perf_counter() - start
    return seconds, sum(a[1] for a in answers), sum(a[2] for a in answers), sum(a[3] for a in answers)


def turned(names: list[str], by: int) -> list[str]:
    """names in turn from the by-th (wrapping)."""
    by %= len(names)
    return names[by:] + names[:by]


def one_round(servers: dict, work: list[tuple[list[int], int]]) -> dict:
    """name -> {False: (seconds, tokens, accepted, refused) of batch 1, True: of 16 streams}, the servers taking turns."""
    names = list(servers)
    totals = {name: {False: [0.0, 0, 0, 0], True: None} for name in names}
    for i, item in enumerate(work):
        for name in turned(names, i):
            time.sleep(SETTLE)
            measured = measure(servers[name], [item], False)
            totals[name][False] = [a + b for a, b in zip(totals[name][False], measured)]
    for name in turned(names, len(work)):
        time.sleep(SETTLE)
        totals[name][True] = measure(servers[name], (work * STREAMS)[:STREAMS], True)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--build", type=Path)
    parser.add_argument("--convert-python", required=True)
    parser.add_argument("--gguf-dir", type=Path, default=Path("artifacts/gguf"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=12)
    args = parser.parse_args()
    build = args.build or args.llama_cpp / "build"
    work = prompts(args.checkpoint, args.prompts)
    path = gguf(args.checkpoint, args.llama_cpp, args.convert_python, args.gguf_dir)
    servers = [("kvserve, speculation off", lambda: Kvserve(args.artifact, False)), ("kvserve, speculation on", lambda: Kvserve(args.artifact, True))]
    servers += [(f"llama-server --spec-type {name.split()[0]}{' (' + ' '.join(extra) + ')' if extra else ''}",
                 (lambda extra=extra, name=name: Llama(build, path, (name.split()[0], *extra)))) for name, extra in SPEC_TYPES]
    with servers[0][1]() as kv, Llama(build, path, ("none",)) as llama:  # the same model: the same greedy tokens
        ours, theirs = kv.token_ids(*work[0]), llama.complete(*work[0])[0]
        same = sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(ours, theirs)))
    print(f"# Copy-heavy speculation: {args.artifact} against llama-server on {path.name}; {len(work)} held-out passages "
          f"({sum(n for _, n in work)} tokens asked), greedy; {args.rounds} rounds alternating\n")
    print(f"llama-server's greedy tokens on the first prompt: {same} of {len(ours)} the same as kvserve's\n")
    results = {name: {False: [], True: []} for name, _ in servers}
    drafts = {}
    for _ in range(args.rounds):
        with contextlib.ExitStack() as stack:
            running = {name: stack.enter_context(make()) for name, make in servers}
            for name, server in running.items():
                measure(server, work[:2], False)  # warm
            for name, measured in one_round(running, work).items():
                for concurrent, (seconds, tokens, accepted, refused) in measured.items():
                    results[name][concurrent].append(tokens / seconds)
                    drafts.setdefault((name, concurrent), []).append(f"{accepted:,} / {refused:,}")
    on = servers[1][0]

    def over(name: str, concurrent: bool) -> str:
        """kvserve with speculation on over this server, round by round (the median of each round's ratio)."""
        if name == on:
            return "-"
        return f"{statistics.median(a / b for a, b in zip(results[on][concurrent], results[name][concurrent])):.2f}x"

    print("| server | batch 1 tokens/s | kvserve on over it, round by round | 16 streams tokens/s | kvserve on over it | "
          "kvserve drafts taken / refused (batch 1), round by round |")
    print("|---|---:|---:|---:|---:|---|")
    for name, _ in servers:
        one, many = (statistics.median(results[name][c]) for c in (False, True))
        print(f"| {name} | {one:,.1f} | {over(name, False)} | {many:,.1f} | {over(name, True)} | "
              f"{'; '.join(drafts[name, False]) if name.startswith('kvserve') else '-'} |")
    print(f"\nMachine: {describe('cpu')}")


if __name__ == "__main__":
    main()
