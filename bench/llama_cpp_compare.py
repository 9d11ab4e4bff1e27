"""kvserve against llama.cpp on the same weights: batch-1 decode tokens/s per precision, the artifact's size against
the GGUF's, and each server's resident memory and tokens/s with 16 streams.

The weights are a preset's, seeded as the artifacts were exported (each artifact's manifest names its preset and seed),
or the checkpoint they were exported from (bench/large_export.py's published shapes): saved (or linked) as a
transformers checkpoint with GPT-2's byte-level BPE as its tokenizer (the presets have none; llama.cpp's converter
needs one and pads it to the vocabulary), converted by llama.cpp's own convert_hf_to_gguf.py to an f32 GGUF (a
checkpoint's to BF16, as published),
and quantized by its llama-quantize, with its default recipe, to the type matching each artifact: float32 F32, int8
Q8_0, int4 Q4_0 (whose default keeps the output matrix, tied or not, in Q6_K; `--pure` makes it Q4_0 too). Before anything is
timed, llama-server on the converted GGUF (f32 K/V), fed the eager model's greedy tokens one at a time, must rank each among its
10 likeliest (its own greedy path may part from a random model's after near-ties).

Batch-1 decode: a 128-token prompt, then 128 greedy tokens. kvserve: its graph as the server runs a lone stream
(bench/decode_step.py), (time of 128 tokens - time of 1) / 127. llama.cpp: `llama-bench -p 0 -n 128 -d 128` (128
tokens generated after 128 in the cache), its own timing. Both on --threads threads, taking turns within every round;
the best round of each is kept.

Servers (--parts servers): each precision's pair serves 16 streams of a 32-token prompt and --new-tokens tokens
(kvserve over gRPC, 16 rows of --context tokens; llama-server with 16 slots sharing 16 x --context, its K/V in its
default f16, or with --llama-kv match in the artifact's K/V dtype: f32, f16 or q8_0 for int8), one at a time; resident
memory (VmRSS) at its peak, and tokens/s.

    python bench/llama_cpp_compare.py --llama-cpp PATH/llama.cpp --artifacts artifacts/qwen3-0.6b artifacts/qwen3-0.6b-int8 \
        artifacts/qwen3-0.6b-int4 [--build PATH/llama.cpp/build] [--convert-python PYTHON] [--rounds 3] [--threads 2] \
        [--gguf-dir artifacts/gguf] [--pure] [--parts decode servers] [--llama-kv f16|match]

(llama.cpp: its source tree, built with `cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-bench
llama-quantize llama-server`; the PyPI sdist of llama-cpp-python carries one under vendor/llama.cpp. Its converter wants
sentencepiece and transformers 4.x: a virtual environment of its own, given by --convert-python.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import NEW_TOKENS, PROMPT_LEN, decode_rates  # noqa: E402
from decode_step import one_row_pool, slots_generate  # noqa: E402
from kv_memory import PROMPT as SERVED_PROMPT, STREAMS, Peak, resident_bytes, run_once  # noqa: E402
from machine import describe  # noqa: E402
from serving_latency import free_port, prompt  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402

GGUF_TYPES = {None: "F32", "int8": "Q8_0", "int4": "Q4_0"}  # an artifact's quantization -> llama-quantize's type
CHECKED_TOKENS = 16
GPT2_VOCAB = 50257  # the converted checkpoint's tokenizer: prompts use its ids alone


def precision(artifact) -> str | None:
    return (artifact.manifest.get("quantization") or {}).get("scheme")


def write_checkpoint(source: dict, directory: Path) -> list[int]:
    """The source's weights as a transformers checkpoint with GPT-2's tokenizer (a preset's seeded weights saved; a
    checkpoint's files hard-linked as they are); the eager model's greedy tokens for the benchmark's prompt (the check
    llama.cpp must pass; a checkpoint's model streamed block by block, as verify runs it)."""
    from kvserve.export.pipeline import load_source
    from kvserve.model.checkpoint import save_checkpoint
    from kvserve.model.generate import generate
    from kvserve.model.vocabulary import gpt2_tokenizer

    if source["kind"] == "preset":
        model, _ = load_source(source["name"], None, seed=source["seed"])
        save_checkpoint(model, directory)
    else:
        model, _ = load_source(None, source["path"])
        for file in Path(source["path"]).iterdir():
            if not file.name.startswith("tokenizer"):
                try:
                    os.link(file, directory / file.name)  # the same bytes under a second name: gigabytes not copied
                except OSError:  # another file system
                    shutil.copy2(file, directory / file.name)
    gpt2_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    ids = bench_prompt(min(model.config.vocab_size, GPT2_VOCAB))
    return generate(model, [ids], checked_tokens(source)).tokens[0].tolist()


def checked_tokens(source: dict) -> int:
    """Greedy tokens the same-model check compares: fewer for a checkpoint, whose eager model streams its weights a step."""
    return CHECKED_TOKENS if source["kind"] == "preset" else 4


def base_type(source: dict) -> str:
    """The GGUF the converter writes, the others quantized from it: a preset's float32 weights as F32, a checkpoint's as
    BF16 (as published: its float32 would double it)."""
    return "F32" if source["kind"] == "preset" else "BF16"


def bench_prompt(vocab: int) -> list[int]:
    return prompt(1, PROMPT_LEN, vocab)


def ggufs(llama_cpp: Path, build: Path, convert_python: str, source: dict, types: list[str], directory: Path,
          pure: bool) -> tuple[dict[str, Path], list[int]]:
    """The source's GGUF as converted (base_type) and one per type (made once, kept in directory), and the eager model's
    greedy tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{source['name']}-seed{source['seed']}" if source["kind"] == "preset" else Path(source["path"]).name
    expected_file = directory / f"{stem}.expected.json"
    base = base_type(source)
    converted_path = directory / f"{stem}-{base}.gguf"
    if not converted_path.exists() or not expected_file.exists():
        with tempfile.TemporaryDirectory() as tmp:
            expected = write_checkpoint(source, Path(tmp))
            converted = subprocess.run([convert_python, str(llama_cpp / "convert_hf_to_gguf.py"), tmp, "--outtype", base.lower(),
                                        "--outfile", str(converted_path)], capture_output=True, text=True)
            if converted.returncode:
                sys.exit(f"convert_hf_to_gguf.py failed:\n{converted.stderr[-3000:]}")
        expected_file.write_text(json.dumps(expected))
    paths = {base: converted_path}
    for kind in types:
        if kind == base:
            continue
        path = directory / f"{stem}-{kind}{'-pure' if pure else ''}.gguf"
        if not path.exists():
            subprocess.run([str(build / "bin" / "llama-quantize"), *(["--pure"] if pure else []), str(converted_path), str(path), kind],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        paths[kind] = path
    return paths, json.loads(expected_file.read_text())


class LlamaServer:
    """llama-server on a GGUF, until closed."""

    def __init__(self, binary: Path, gguf: Path, threads: int, slots: int, context: int, extra: tuple[str, ...] = (), poll: float = 0.2):
        """binary: llama-server; poll: seconds between asks of its /health (bench/startup.py times the start by it)."""
        self.port = free_port()
        self.process = subprocess.Popen([str(binary), "-m", str(gguf), "--port", str(self.port), "-t", str(threads),
                                         "-np", str(slots), "-c", str(slots * context), "--no-webui", *extra],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(poll)
        self.close()
        sys.exit(f"llama-server did not start on {gguf}")

    def complete(self, ids: list[int], n: int) -> list[int]:
        body = json.dumps({"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True, "return_tokens": True,
                           "cache_prompt": False}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            return json.loads(reply.read())["tokens"]

    def likeliest(self, ids: list[int], n: int) -> list[int]:
        """The n likeliest next tokens after ids, most likely first."""
        body = json.dumps({"prompt": ids, "n_predict": 1, "temperature": 0, "n_probs": n, "ignore_eos": True, "cache_prompt": False}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            return [entry["id"] for entry in json.loads(reply.read())["completion_probabilities"][0]["top_logprobs"]]

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(60)


TOP_CHECKED = 10  # the same-model check: each eager greedy token among llama.cpp's this many likeliest, fed the eager prefix


def check_same_model(build: Path, f32: Path, threads: int, expected: list[int], vocab: int) -> int:
    """How many greedy tokens llama.cpp's converted GGUF (f32 K/V) shares with the eager model from the first; exits
    unless, fed the eager model's own prefix at each position, llama.cpp ranks the eager model's greedy token among its
    TOP_CHECKED likeliest. A converter that read the weights otherwise would rank it anywhere in the vocabulary, while
    random weights' near-ties (a BF16 GGUF's activations are rounded to bfloat16 in its dot products) may part the two
    greedy paths after a token or two."""
    server = LlamaServer(build / "bin" / "llama-server", f32, threads, 1, PROMPT_LEN + len(expected) + 16, ("-ctk", "f32", "-ctv", "f32"))
    ids = bench_prompt(vocab)
    try:
        theirs = server.complete(ids, len(expected))
        ranked = [server.likeliest(ids + expected[:i], TOP_CHECKED) for i in range(len(expected))]
    finally:
        server.close()
    agreed = next((i for i, (a, b) in enumerate(zip(theirs, expected)) if a != b), min(len(theirs), len(expected)))
    if any(token not in top for token, top in zip(expected, ranked)):
        sys.exit(f"llama.cpp's converted GGUF does not compute the eager model: greedy {theirs} against {expected}, and fed the "
                 f"eager tokens its {TOP_CHECKED} likeliest were {ranked}; not timing")
    return agreed


def llama_bench_rate(build: Path, gguf: Path, threads: int) -> float:
    """llama-bench's tokens/s generating NEW_TOKENS after PROMPT_LEN in the cache (one repetition, after its warm-up)."""
    out = subprocess.run([str(build / "bin" / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(NEW_TOKENS), "-d", str(PROMPT_LEN),
                          "-t", str(threads), "-r", "1", "-o", "json"], check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def kvserve_runner(path: str, vocab: int):
    artifact = open_artifact(path)
    config = artifact.config
    runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, "cpu")
    pool = one_row_pool(runtime, config)
    ids = bench_prompt(vocab)
    return lambda n: slots_generate(runtime, pool, ids, n), slots_generate(runtime, pool, ids, CHECKED_TOKENS)


def kvserve_served(path: str, vocab: int, context: int, new_tokens: int) -> tuple[int, float]:
    """kvserve serve's peak resident bytes and tokens/s under 16 streams (bench/kv_memory.py's run)."""
    run = run_once(path, None, vocab, new_tokens, seed=7, extra=("--max-context", str(context)))
    return run["peak"], run["rate"]


# A kvserve K/V dtype and llama.cpp's cache type of the same precision (its q8_0 V cache needs flash attention on).
LLAMA_KV_TYPES = {"float32": ("f32",), "float16": ("f16",), "int8": ("q8_0", "-fa", "on")}


def llama_served(build: Path, gguf: Path, threads: int, vocab: int, context: int, new_tokens: int,
                 kv: tuple[str, ...] = ("f16",)) -> tuple[int, float]:
    """llama-server's peak resident bytes and tokens/s under 16 concurrent completions, its K/V cache of type kv[0]."""
    from concurrent.futures import ThreadPoolExecutor

    server = LlamaServer(build / "bin" / "llama-server", gguf, threads, STREAMS, context, ("-ctk", kv[0], "-ctv", kv[0], *kv[1:]))
    try:
        peak = Peak(server.process.pid)
        peak.start()
        started = time.perf_counter()
        with ThreadPoolExecutor(STREAMS) as pool:
            runs = list(pool.map(lambda i: server.complete(prompt(7 + i, SERVED_PROMPT, vocab), new_tokens), range(STREAMS)))
        rate = sum(len(r) for r in runs) / (time.perf_counter() - started)
        peak.stopped.set()
        peak.join()
        return max(peak.peak, resident_bytes(server.process.pid)), rate
    finally:
        server.close()


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.suffix != ".json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp's source tree (convert_hf_to_gguf.py)")
    parser.add_argument("--build", type=Path, help="its build directory (bin/llama-bench, llama-quantize, llama-server); default LLAMA_CPP/build")
    parser.add_argument("--convert-python", default=sys.executable,
                        help="the Python that runs convert_hf_to_gguf.py, with its requirements (llama.cpp's requirements/)")
    parser.add_argument("--artifacts", nargs="+", required=True, help="kvserve exports of one preset (float32, int8, int4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="both engines' threads (kvserve: ONNX Runtime's, one per core)")
    parser.add_argument("--gguf-dir", type=Path, default=Path("artifacts/gguf"), help="where the GGUFs are written once and kept")
    parser.add_argument("--pure", action="store_true", help="llama-quantize --pure: every tensor in the type, the output table too")
    parser.add_argument("--parts", nargs="+", choices=("decode", "servers"), default=["decode", "servers"],
                        help="batch-1 decode (with the sizes) and/or the servers under 16 streams")
    parser.add_argument("--context", type=int, default=256, help="served: tokens a row (kvserve) or a slot (llama-server) holds")
    parser.add_argument("--new-tokens", type=int, default=192, help="served: tokens each of the 16 streams writes")
    parser.add_argument("--llama-kv", choices=("f16", "match"), default="f16",
                        help="served: llama-server's K/V cache type: its default f16, or the same precision as each artifact's K/V")
    args = parser.parse_args()
    build = args.build or args.llama_cpp / "build"
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads must be >= 1")
    if SERVED_PROMPT + args.new_tokens > args.context:
        parser.error(f"--context must hold the served prompt ({SERVED_PROMPT}) and --new-tokens")
    opened = [open_artifact(path) for path in args.artifacts]
    sources = {json.dumps(a.manifest["source"], sort_keys=True) for a in opened}
    if len(sources) != 1 or opened[0].manifest["source"].get("kind") not in ("preset", "checkpoint"):
        sys.exit("the artifacts must all be exports of one preset (and seed) or one checkpoint")
    unknown = [path for path, a in zip(args.artifacts, opened, strict=True) if precision(a) not in GGUF_TYPES or a.dtype != "float32"]
    if unknown:
        sys.exit(f"no GGUF type matches {', '.join(unknown)} (float32 graphs with float32, int8 or int4 weights)")
    source = opened[0].manifest["source"]
    vocab = min(opened[0].config.vocab_size, GPT2_VOCAB)  # ids the converted vocabulary names (GPT-2's, padded above)
    types = [GGUF_TYPES[precision(a)] for a in opened]
    paths, expected = ggufs(args.llama_cpp, build, args.convert_python, source, types, args.gguf_dir, args.pure)
    agreed = check_same_model(build, paths[base_type(source)], args.threads, expected, vocab)
    if "decode" in args.parts:
        batch_one(args, opened, types, paths, expected, agreed, source, vocab, build)
    if "servers" in args.parts:
        print(f"\n## Servers, {STREAMS} streams x ({SERVED_PROMPT}-token prompt + {args.new_tokens} tokens), rows of {args.context} tokens; "
              f"peak resident memory and tokens/s (llama-server's K/V: "
              f"{'its default f16' if args.llama_kv == 'f16' else 'the precision of each artifact K/V'})\n")
        print("| weights | kvserve K/V | llama-server K/V | kvserve peak MiB | llama-server peak MiB | ours / theirs | kvserve tokens/s | "
              "llama-server tokens/s | ours / theirs |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for path, artifact, kind in zip(args.artifacts, opened, types, strict=True):
            kv = ("f16",) if args.llama_kv == "f16" else LLAMA_KV_TYPES[artifact.kv_dtype]
            our_rss, our_rate = kvserve_served(path, vocab, args.context, args.new_tokens)
            their_rss, their_rate = llama_served(build, paths[kind], args.threads, vocab, args.context, args.new_tokens, kv)
            print(f"| {precision(artifact) or 'float32'} / {kind} | {artifact.kv_dtype} | {kv[0]} | {our_rss / 2**20:.0f} | {their_rss / 2**20:.0f} | "
                  f"{our_rss / their_rss:.2f}x | {our_rate:.1f} | {their_rate:.1f} | {our_rate / their_rate:.2f}x |")
    commit = subprocess.run(["git", "-C", str(args.llama_cpp), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\nllama.cpp {commit or '(no git)'}{' (--pure)' if args.pure else ''}; machine: {describe('cpu')}")


def batch_one(args, opened, types, paths, expected, agreed, source, vocab, build) -> None:
    """Batch-1 decode, both engines taking turns each round, and the sizes: a table."""
    runners, own_agreed = [], []
    for path in args.artifacts:
        run, tokens = kvserve_runner(path, vocab)
        runners.append(run)
        own_agreed.append(next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(expected)))
    ours = [[] for _ in runners]
    theirs = [[] for _ in runners]
    for _ in range(args.rounds):
        for i, (run, kind) in enumerate(zip(runners, types, strict=True)):
            ours[i].append(decode_rates(1, [run])[0][0])
            theirs[i].append(llama_bench_rate(build, paths[kind], args.threads))

    named = (f"{source['name']} preset (seed {source['seed']}, the same weights)" if source["kind"] == "preset"
             else f"checkpoint {Path(source['path']).name} (the same weights)")
    print(f"## kvserve against llama.cpp, {named}, batch 1, greedy, "
          f"{NEW_TOKENS} tokens after a {PROMPT_LEN}-token prompt, {args.threads} threads, {args.rounds} rounds alternating, best round\n")
    print(f"llama.cpp's {base_type(source)} GGUF (f32 K/V) shares its first {agreed} of {len(expected)} greedy tokens with the eager model "
          f"(fed the eager prefix, it ranks each among its {TOP_CHECKED} likeliest); "
          f"kvserve's graphs: {', '.join(str(n) for n in own_agreed)}\n")
    print("| kvserve artifact | MB | llama.cpp GGUF | MB | size ours / theirs | kvserve tokens/s | llama.cpp tokens/s | ours / theirs |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for path, artifact, kind, mine, peer in zip(args.artifacts, opened, types, ours, theirs, strict=True):
        size, gguf_size = directory_bytes(Path(path)), paths[kind].stat().st_size
        print(f"| {Path(path).name} ({precision(artifact) or 'float32'}, K/V {artifact.kv_dtype}) | {size / 1e6:.0f} | {paths[kind].name} | "
              f"{gguf_size / 1e6:.0f} | {size / gguf_size:.2f}x | {max(mine):.1f} | {max(peer):.1f} | {max(mine) / max(peer):.2f}x |")


if __name__ == "__main__":
    main()
