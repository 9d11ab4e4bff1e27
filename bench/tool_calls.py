"""Tool calls: does every call a named-function tool_choice makes parse and validate against its function's schema?

50 parameter schemas drawn at random (--seed; none written by hand, so none tuned to pass): objects of strings
(bounded, enums, patterns), integers and numbers with ranges, booleans, bounded arrays, nested objects, optional
fields. Each is offered as the one tool of a conversation and named by tool_choice, with parallel calls off, greedy
and 2 sampled seeds, on each --artifacts model served by `kvserve serve` over gRPC (artifacts whose chat template renders no
tools get the default model's, whose calls are hermes blocks), at most --max-new-tokens new tokens. Every call is read back
from FinishDetails.tool_calls, parsed and validated with jsonschema; its text streamed in Token.tool_call_delta must
hold those arguments (a model whose context is at most twice that budget gets what its context leaves). A prompt the context cannot hold is refused (counted), and a generation the token budget cuts
before its call closes has no call (counted: random weights write a number's fraction digits until cut).

    python bench/tool_calls.py [--artifacts artifacts/kjv-gpt2 artifacts/gpt2 artifacts/gpt2-int8] [--schemas 50]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import grpc
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from serving_latency import Server  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.contract.chat import load_chat_template  # noqa: E402
from kvserve.v1 import generation_pb2 as pb  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLINGS = [pb.SamplingParams(), pb.SamplingParams(temperature=1.0, seed=1), pb.SamplingParams(temperature=1.0, seed=2)]


def value_schema(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "enum", "pattern", "integer", "number", "boolean", "array"] + (["object"] if depth < 2 else []))
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "north", "south", 1, 2, True, None], rng.randint(2, 4))}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice([r"^[a-z]{2,5}$", r"^[0-9]{3}-[0-9]{2}$", r"^(yes|no)$"])}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": value_schema(rng, depth + 1), "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return object_schema(rng, depth + 1)


def object_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["city", "count", "unit", "when", "tags", "mode", "limit", "flag", "items", "note"], rng.randint(1, 3 if depth else 4))
    properties = {name: value_schema(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def schemas(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [object_schema(rng) for _ in range(count)]


def with_template(artifact: str, scratch: Path) -> str:
    """The artifact itself when its chat template renders tools, else a copy with the default model's (an artifact
    exported before templates rendered tools, or one with none)."""
    template = load_chat_template(artifact)
    if template is not None and template.knows_tools:
        return artifact
    copy = scratch / Path(artifact).name
    shutil.copytree(artifact, copy)
    shutil.copy2(REPO / "checkpoints" / "kjv-gpt2" / "chat_template.jinja", copy / "chat_template.jinja")
    return str(copy)


def run(artifact: str, parameter_schemas: list[dict], provider: str, max_new_tokens: int) -> dict:
    counts = {"generations": 0, "calls": 0, "parsed": 0, "valid": 0, "streamed": 0, "refused": 0, "cut": 0}
    reasons: dict[str, int] = {}
    room = open_artifact(artifact).config.n_ctx
    budget = 0 if room <= 2 * max_new_tokens else max_new_tokens  # 0: what the context leaves after the prompt
    with Server("tools", artifact, provider, sys.executable, []) as server, grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        for number, schema in enumerate(parameter_schemas):
            name = f"tool_{number}"
            tools = [{"type": "function", "function": {"name": name, "description": "Call it.", "parameters": schema}}]
            conversation = pb.Conversation(messages=[pb.ChatMessage(role="user", content="Go.")], tools=json.dumps(tools),
                                           tool_choice=pb.ToolChoice(function=name), parallel_tool_calls=False)
            for sampling in SAMPLINGS:
                try:
                    responses = list(stub.Generate(pb.GenerateRequest(messages=conversation, sampling=sampling,
                                                                      max_new_tokens=budget), timeout=600))
                except grpc.RpcError as error:  # the prompt does not fit the context: said, and counted apart
                    counts["refused"] += 1
                    counts["generations"] += 1
                    print(f"<!-- {Path(artifact).name} {name}: refused: {error.details()[:120]} -->")
                    continue
                finish = responses[-1].finish
                reason = pb.FinishReason.Name(finish.reason).removeprefix("FINISH_REASON_").lower()
                reasons[reason] = reasons.get(reason, 0) + 1
                counts["generations"] += 1
                counts["calls"] += len(finish.tool_calls[:1])
                counts["cut"] += not finish.tool_calls and reason == "length"
                streamed = "".join(r.token.tool_call_delta for r in responses)
                for call in finish.tool_calls[:1]:
                    try:
                        arguments = json.loads(call.arguments)
                        counts["parsed"] += 1
                        jsonschema.validate(arguments, schema)
                        counts["valid"] += call.name == name
                    except (ValueError, jsonschema.ValidationError) as exc:
                        print(f"<!-- {Path(artifact).name} {name}: {str(exc)[:160]!r} -->")
                    counts["streamed"] += call.arguments in streamed
                if not finish.tool_calls and reason != "length":
                    print(f"<!-- {Path(artifact).name} {name}: no call ({reason}, {finish.generated_tokens} tokens of {room}): {streamed[-80:]!r} -->")
    return {**counts, "reasons": reasons}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifacts", nargs="+", default=["artifacts/kjv-gpt2", "artifacts/gpt2", "artifacts/gpt2-int8"])
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--provider", default="cpu", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    print(f"# Tool calls: a named function's calls against its schema\n\n{describe()}\n")
    parameter_schemas = schemas(args.schemas, args.seed)
    print(f"{len(parameter_schemas)} schemas (seed {args.seed}), {len(SAMPLINGS)} generations each (greedy, 2 sampled), one call a reply\n")
    print("| model | generations | prompt too long | cut before the call closed | calls | arguments parse | validate | "
          "streamed text holds them | finish reasons |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for artifact in args.artifacts:
            result = run(with_template(artifact, Path(scratch)), parameter_schemas, args.provider, args.max_new_tokens)
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(result["reasons"].items()))
            print(f"| {Path(artifact).name} | {result['generations']} | {result['refused']} | {result['cut']} | {result['calls']} | "
                  f"{result['parsed']} | {result['valid']} | {result['streamed']} | {reasons} |", flush=True)


if __name__ == "__main__":
    main()
