"""Where a Phi-3 row prefilled again at the longrope crossing leaves transformers' tokens (issue 50, item 3): the
suite's Phi-3 longrope config, exported on a provider, served with each serving feature on and off in turn, against
transformers' own greedy generate.

On an H100 and an H200 the crossing rows of tests/service/core/test_llama_serving.py decoded other tokens than
transformers from their crossing on, standard float32 attention under CUDA, while every row that never crossed
matched and the same tests pass on the CPU provider. Each row here is one server (the tests' settings, then one
thing changed): a lone stream that crosses at its 5th token, and the tests' six streams on four rows (three cross
mid-stream, one is long from its prompt, two stay short). A cell says "=" where every token equals transformers',
else the streams that differ, each with the index of its first differing token. The variant whose cells turn "="
names the feature the fault lives in; if none does, the fault is in the graph's kernels (then bench/provider_diff.py).
Before the servers, the export's own parity driver (the refill alone, no row decoding beside it) on its own row.

    python bench/crossing_bisect.py [--provider cuda] [--work DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from machine import describe  # noqa: E402
from parity_errors import hf_llama  # noqa: E402

from kvserve.export.parity_drivers import artifact_greedy  # noqa: E402
from kvserve.export.pipeline import export_artifact  # noqa: E402
from kvserve.v1 import generation_pb2 as pb  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402
from tests.conftest import LLAMA_CONFIGS  # noqa: E402
from tests.hf_reference import hf_greedy  # noqa: E402
from tests.service.conftest import start_server  # noqa: E402

CONFIG = next(name for name in LLAMA_CONFIGS if name.startswith("phi3") and "longrope" in name)
TESTS_SERVER = {"max_batch_size": 4, "max_queue": 64, "step_token_budget": 8}  # test_llama_serving.serve's
# (label, what changes from the tests' server): each one thing, so a row whose cells turn "=" names it
VARIANTS = (
    ("the tests' server", {}),
    ("speculation off", {"speculation": False}),
    ("prompt cache off", {"prompt_cache": False}),
    ("no step token budget (a refill in one chunk)", {"step_token_budget": 0}),
    ("one row (no row decodes beside a refill)", {"max_batch_size": 1}),
    ("all four above", {"speculation": False, "prompt_cache": False, "step_token_budget": 0, "max_batch_size": 1}),
)
NEW_TOKENS = 20


def served(artifact: Path, provider: str, overrides: dict, prompts: list[list[int]]) -> list[list[list[int]]]:
    """Each group of prompts' greedy continuations (NEW_TOKENS each) from a server of artifact with the tests' settings
    and overrides: the first group one stream alone, the second all at once."""
    running = start_server(artifact, provider=provider, **{**TESTS_SERVER, **overrides})
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)

            def generate(prompt: list[int]) -> list[int]:
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=NEW_TOKENS, ignore_eos=True)
                return [response.token.id for response in stub.Generate(request, timeout=300) if response.HasField("token")]

            lone = [generate(prompts[0])]
            with ThreadPoolExecutor(len(prompts) - 1) as pool:
                together = list(pool.map(generate, prompts[1:]))
        return [lone, together]
    finally:
        running.stop()


def differences(got: list[list[int]], want: np.ndarray, names: list[str]) -> str:
    """"=" where every stream equals want, else "name@first differing index" for each that does not."""
    parts = []
    for name, tokens, reference in zip(names, got, want.tolist()):
        if tokens != reference:
            first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
            parts.append(f"{name}@{first}")
    return ", ".join(parts) or "="


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    import torch
    import transformers

    work = args.work or Path(tempfile.mkdtemp(prefix="crossing-bisect-"))
    model, source = hf_llama(CONFIG, work)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source["path"], dtype=torch.float32, attn_implementation="eager").eval()
    after = hf.config.rope_parameters["original_max_position_embeddings"]
    artifact = work / "artifact"
    export_artifact(model, source, artifact, attention="standard", provider=args.provider, overwrite=True)
    lone = [(13 * j) % 290 + 4 for j in range(after - 4)]  # crosses at its 5th token
    mix = [[(7 * j + i) % 290 + 3 for j in range(length)] for i, length in enumerate((after - 9, after - 1, after, after + 7, 5, 30))]
    names = [f"len{len(p)}" for p in mix]
    want_lone, want_mix = hf_greedy(hf, [lone], NEW_TOKENS), hf_greedy(hf, mix, NEW_TOKENS)
    print(f"## {CONFIG}: standard float32 on the {args.provider} provider against transformers, {NEW_TOKENS} greedy tokens a "
          f"stream; crossing at {after} tokens (Phi-3: the row prefilled again, long)\n")
    print("| path | lone stream crossing at its 5th token | six streams on four rows (len: prompt tokens) |\n|---|---|---|")
    driver = artifact_greedy(artifact, [lone], NEW_TOKENS, args.provider)
    print(f"| export's parity driver (the refill alone) | {differences(driver.tolist(), want_lone, ['lone'])} | |")
    for label, overrides in VARIANTS:
        got_lone, got_mix = served(artifact, args.provider, overrides, [lone] + mix)
        print(f"| {label} | {differences(got_lone, want_lone, ['lone'])} | {differences(got_mix, want_mix, names)} |")
    print(f"\nmachine: {describe(args.provider)}")


if __name__ == "__main__":
    main()
