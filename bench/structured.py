"""Structured output: which mask library, whether every output validates, and what constrained streams cost the
unconstrained ones beside them.

  libraries  llguidance and outlines-core on the artifact's tokenizer, for each schema of structured_schemas.json:
             compile time, and the time to compute one token's mask along a walk of allowed tokens (median, p99);
             plus kvserve's own work per constrained token (unpacking the bits, masking the logits)
  validity   each schema through a real server, greedy and 3 sampled seeds, for each --validity artifact: every
             output parsed and validated with jsonschema, finish reasons counted
  load       16 streams on one server: 8 unconstrained streams (greedy, 64 new tokens, 2 requests each) beside
             8 background streams that either follow a JSON schema (sampled, back to back) or run unconstrained
             requests of the same median length; runs alternate, --rounds of each; the unconstrained streams'
             tokens/s (target: with constrained neighbours within 5% of without) and each kind's inter-token p50

    python bench/structured.py [--artifact artifacts/gpt2] [--validity artifacts/kjv-gpt2 artifacts/gpt2]
                               [--rounds 3] [--parts libraries validity load] [--provider cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import grpc
import jsonschema
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from serving_latency import Server  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.v1 import generation_pb2 as pb  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

SCHEMAS = json.loads((Path(__file__).resolve().parent / "structured_schemas.json").read_text())
WALK_TOKENS = 64
STREAMS, NEW_TOKENS, REQUESTS_PER_STREAM = 8, 64, 2  # the unconstrained streams measured (and as many neighbours)
LOAD_SCHEMA = "array_of_objects"


# --- libraries ----------------------------------------------------------------------------------------------------


def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins back to bytes (GPT-2's bytes_to_unicode, inverted)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


def libraries(artifact: str) -> None:
    import llguidance
    import outlines_core
    from llguidance.numpy import fill_next_token_bitmask
    from outlines_core.json_schema import build_regex_from_schema

    from kvserve.service.core.structured import JSON_OPTIONS

    servable = open_artifact(artifact)
    config, path = servable.config, servable.tokenizer_path
    if path is None:
        sys.exit(f"{artifact} has no tokenizer.json: the library comparison needs a byte-level BPE tokenizer")
    text = path.read_text()
    eos = config.eos_token_ids[0]
    start = time.perf_counter()
    llg_tokenizer = llguidance.LLTokenizer(text, n_vocab=config.vocab_size, eos_token=eos)
    llg_tokenizer_ms = (time.perf_counter() - start) * 1e3
    decoder, vocabulary = _gpt2_byte_decoder(), {}
    for token, index in json.loads(text)["model"]["vocab"].items():
        if index != eos:
            vocabulary.setdefault(bytes(decoder[c] for c in token), []).append(index)
    start = time.perf_counter()
    oc_vocabulary = outlines_core.Vocabulary(eos, vocabulary)
    oc_tokenizer_ms = (time.perf_counter() - start) * 1e3
    words = (config.vocab_size + 31) // 32
    print(f"## Mask libraries on {artifact}'s tokenizer ({config.vocab_size} tokens): compile, then one mask a token along a "
          f"walk of {WALK_TOKENS} allowed tokens (uniform, seed 0)\n")
    print(f"tokenizer set-up: llguidance {llg_tokenizer_ms:.0f} ms, outlines-core {oc_tokenizer_ms:.0f} ms\n")
    print("| schema | llguidance compile ms | llguidance mask µs p50 / p99 | outlines-core compile ms | outlines-core mask µs p50 / p99 |")
    print("|---|---:|---:|---:|---:|")
    totals = {"llg": [], "oc": []}
    for name, schema in SCHEMAS.items():
        cells = []
        for library in ("llg", "oc"):
            mask = np.zeros((1, words), dtype=np.int32)
            start = time.perf_counter()
            if library == "llg":
                matcher = llguidance.LLMatcher(llg_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS),
                                               log_level=0)
                compiled = time.perf_counter()

                def fill():
                    fill_next_token_bitmask(matcher, mask)

                def take(token):
                    matcher.consume_token(token)

                def done():
                    return matcher.is_stopped()
            else:
                guide = outlines_core.Guide(outlines_core.Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern=""), oc_vocabulary))
                compiled = time.perf_counter()

                def fill():
                    guide.write_mask_into(mask.ctypes.data, mask.size, 4)

                def take(token):
                    guide.advance(token, return_tokens=False)

                def done():
                    return guide.is_finished()
            rng, times = np.random.default_rng(0), []
            for _ in range(WALK_TOKENS):
                begin = time.perf_counter()
                fill()
                times.append(time.perf_counter() - begin)
                allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: config.vocab_size])
                allowed = allowed[allowed != eos]
                if not len(allowed) or done():
                    break
                take(int(rng.choice(allowed)))
            totals[library] += times
            cells += [f"{(compiled - start) * 1e3:.1f}", f"{np.median(times) * 1e6:.0f} / {np.percentile(times, 99) * 1e6:.0f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"| all masks | | {np.median(totals['llg']) * 1e6:.0f} / {np.percentile(totals['llg'], 99) * 1e6:.0f} | "
          f"| {np.median(totals['oc']) * 1e6:.0f} / {np.percentile(totals['oc'], 99) * 1e6:.0f} |")
    # kvserve's own work for one constrained token: the mask's bits to the ids allowed (on the mask thread), then the
    # choice among those ids (sampling.choose), against the choice over the whole vocabulary an unconstrained row makes.
    from kvserve.service.core.sampling import SamplingParams, choose

    bits = np.zeros((1, words), dtype=np.int32)
    bits[0, :: max(1, words // 64)] = -1  # about 2,000 tokens allowed
    logits = np.random.default_rng(0).normal(size=config.vocab_size).astype(np.float32)
    params, rng = SamplingParams(temperature=1.0), np.random.default_rng(0)
    unpack, among, whole = [], [], []
    for _ in range(200):
        begin = time.perf_counter()
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[0, : config.vocab_size])
        middle = time.perf_counter()
        choose(logits, params, rng, None, [], allowed)
        end = time.perf_counter()
        choose(logits, params, rng, None, [])
        unpack.append(middle - begin)
        among.append(end - middle)
        whole.append(time.perf_counter() - end)
    print(f"\nkvserve's own work a constrained token ({allowed.size} tokens allowed, temperature 1): bits to ids "
          f"{np.median(unpack) * 1e6:.0f} µs (mask thread), sampling among them {np.median(among) * 1e6:.0f} µs; an unconstrained "
          f"row's sampling over the vocabulary {np.median(whole) * 1e6:.0f} µs (medians)\n")


# --- validity -----------------------------------------------------------------------------------------------------

SAMPLINGS = [("greedy", pb.SamplingParams())] + [(f"seed {s}", pb.SamplingParams(temperature=1.0, seed=s)) for s in (1, 2, 3)]


def validity(artifacts: list[str], provider: str) -> None:
    print("## Every output against its schema (jsonschema), greedy and 3 sampled seeds (temperature 1)\n")
    print("| model | schema | outputs | valid | finish reasons | tokens mean |\n|---|---|---:|---:|---|---:|")
    for artifact in artifacts:
        room = open_artifact(artifact).config.n_ctx - 16
        with Server("validity", artifact, provider, None, []) as server, grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            for name, schema in SCHEMAS.items():
                valid, reasons, tokens = 0, {}, []
                for _, sampling in SAMPLINGS:
                    request = pb.GenerateRequest(text="Reply in JSON: ", max_new_tokens=min(room, 400), sampling=sampling,
                                                 response_format=pb.ResponseFormat(json_schema=json.dumps(schema)))
                    responses = list(stub.Generate(request, timeout=600))
                    text = "".join(r.token.text_delta for r in responses)
                    reason = pb.FinishReason.Name(responses[-1].finish.reason).removeprefix("FINISH_REASON_").lower()
                    reasons[reason] = reasons.get(reason, 0) + 1
                    tokens.append(len(responses))
                    try:
                        jsonschema.validate(json.loads(text), schema)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError) as exc:
                        print(f"<!-- {Path(artifact).name} {name}: invalid: {str(exc)[:120]!r} in {text[:120]!r} -->")
                summary = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
                print(f"| {Path(artifact).name} | {name} | {len(SAMPLINGS)} | {valid} | {summary} | {statistics.mean(tokens):.1f} |")
    print()


# --- load ---------------------------------------------------------------------------------------------------------


async def _stream(stub, request) -> tuple[int, list[float]]:
    """(tokens, gaps between them in s) of one stream."""
    stamps = []
    async for _ in stub.Generate(request, timeout=600):
        stamps.append(time.perf_counter())
    return len(stamps), list(np.diff(stamps))


async def _run(target: str, vocab: int, constrained: bool, neighbour_tokens: int, seed: int) -> dict:
    """One run: the measured unconstrained streams with 8 neighbours, constrained or not."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await _stream(stub, pb.GenerateRequest(text="warm", max_new_tokens=2))
        measuring, neighbour_gaps, neighbour_lengths = True, [], []

        async def neighbour(i: int):
            k = 0
            while measuring:
                sampling = pb.SamplingParams(temperature=1.0, seed=seed + 1000 * i + k)
                if constrained:
                    request = pb.GenerateRequest(text="Reply in JSON: ", max_new_tokens=400, sampling=sampling,
                                                 response_format=pb.ResponseFormat(json_schema=json.dumps(SCHEMAS[LOAD_SCHEMA])))
                else:
                    request = pb.GenerateRequest(text="Reply in JSON: ", max_new_tokens=neighbour_tokens, ignore_eos=True, sampling=sampling)
                tokens, gaps = await _stream(stub, request)
                neighbour_lengths.append(tokens)
                neighbour_gaps.extend(gaps)
                k += 1

        async def measured(i: int) -> tuple[int, float, list[float]]:
            rng, tokens, gaps = np.random.default_rng(seed + i), 0, []
            start = time.perf_counter()
            for _ in range(REQUESTS_PER_STREAM):
                ids = rng.integers(0, vocab, 32).tolist()
                n, g = await _stream(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=NEW_TOKENS, ignore_eos=True))
                tokens += n
                gaps += g
            return tokens, time.perf_counter() - start, gaps

        neighbours = [asyncio.ensure_future(neighbour(i)) for i in range(STREAMS)]
        await asyncio.sleep(0.5)  # the neighbours are running before the measured streams start
        results = await asyncio.gather(*(measured(i) for i in range(STREAMS)))
        measuring = False
        await asyncio.gather(*neighbours)
    return {
        "tokens/s": statistics.mean(tokens / seconds for tokens, seconds, _ in results),  # per measured stream
        "itl": statistics.median(g for _, _, gaps in results for g in gaps),
        "neighbour itl": statistics.median(neighbour_gaps) if neighbour_gaps else float("nan"),
        "neighbour lengths": neighbour_lengths,
    }


def load(artifact: str, rounds: int, provider: str) -> None:
    vocab = open_artifact(artifact).config.vocab_size
    runs: dict[bool, list[dict]] = {True: [], False: []}
    with Server("load", artifact, provider, None, []) as server:
        pilot = asyncio.run(_run(server.target, vocab, True, 0, 99))
        length = int(statistics.median(pilot["neighbour lengths"]))
        for round_ in range(rounds):
            for constrained in ((True, False) if round_ % 2 == 0 else (False, True)):
                runs[constrained].append(asyncio.run(_run(server.target, vocab, constrained, length, 1000 * (round_ + 1))))
    print(f"## {2 * STREAMS} streams on {artifact}: {STREAMS} unconstrained (greedy, prompt 32, {NEW_TOKENS} new, {REQUESTS_PER_STREAM} "
          f"requests each) beside {STREAMS} neighbours following `{LOAD_SCHEMA}` (sampled) or unconstrained requests of its median "
          f"length ({length} tokens, from a pilot run); {rounds} runs of each, alternating, medians\n")
    print("| neighbours | unconstrained streams tokens/s (each) | their ITL p50 ms | neighbours' ITL p50 ms |\n|---|---:|---:|---:|")
    medians = {}
    for constrained in (False, True):
        rate = statistics.median(r["tokens/s"] for r in runs[constrained])
        medians[constrained] = rate
        print(f"| {'constrained' if constrained else 'unconstrained'} | {rate:.2f} | "
              f"{statistics.median(r['itl'] for r in runs[constrained]) * 1e3:.1f} | "
              f"{statistics.median(r['neighbour itl'] for r in runs[constrained]) * 1e3:.1f} |")
    print(f"\nunconstrained streams' tokens/s with constrained neighbours / without: {medians[True] / medians[False]:.1%} (target >= 95%)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2", help="the artifact for the libraries and load parts")
    parser.add_argument("--validity", nargs="+", default=["artifacts/kjv-gpt2", "artifacts/gpt2"], help="artifacts whose outputs are validated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--provider", default="cpu", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--parts", nargs="+", default=["libraries", "validity", "load"], choices=("libraries", "validity", "load"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if "libraries" in args.parts:
        libraries(args.artifact)
    if "validity" in args.parts:
        validity(args.validity, args.provider)
    if "load" in args.parts:
        load(args.artifact, args.rounds, args.provider)
    print(f"machine: {describe(args.provider)}")


if __name__ == "__main__":
    main()
