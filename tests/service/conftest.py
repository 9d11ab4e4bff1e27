"""Service fixtures: a real server on loopback (port 0) in a background event loop, real channels to it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvserve.service.core.drafts import PromptLookup, StepCosts

from ..conftest import FUSED_DTYPES


class ServerThread:
    """An App running in its own event loop thread, so tests can call it with ordinary blocking stubs."""

    def __init__(self, options, load: bool = True):
        from kvserve.service.process.app import App

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.app = App(options)
        self.port = self.call(self.app.start())
        if load:
            self.call(self.app.load())
        self.target = f"127.0.0.1:{self.port}"

    def call(self, coroutine, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.app.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_server(artifact, load: bool = True, **overrides) -> ServerThread:
    """A server for artifact on a free port; overrides are ServerOptions' fields and EngineLimits' (max_batch_size=...),
    the provider the suite's (KVSERVE_TEST_PROVIDER) unless one is given."""
    import dataclasses

    from kvserve.service.core.limits import EngineLimits
    from kvserve.service.process.options import ServerOptions

    from ..conftest import PROVIDER

    limit_names = {f.name for f in dataclasses.fields(EngineLimits)}
    limits = EngineLimits(**{k: v for k, v in overrides.items() if k in limit_names})
    rest = {k: v for k, v in overrides.items() if k not in limit_names}
    return ServerThread(ServerOptions(**{"artifact": str(artifact), "port": 0, "provider": PROVIDER, "limits": limits, **rest}), load=load)


@contextlib.contextmanager
def serving(artifact, **overrides):
    """start_server's server, stopped on the way out (a failing fixture's too)."""
    running = start_server(artifact, **overrides)
    try:
        yield running
    finally:
        running.stop()


@contextlib.contextmanager
def stub_of(server):
    """A GenerationService stub on a channel of its own to server, closed on the way out."""
    from kvserve.v1 import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="session")
def server(tiny_artifact):
    with serving(tiny_artifact, max_batch_size=8, max_queue=256) as running:
        yield running


@pytest.fixture(scope="session")
def stub(server):
    with stub_of(server) as client:
        yield client


def collect(stub, request, timeout: float = 60):
    """(token ids, text, final finish message) of one Generate stream."""
    ids, text, finish = [], "", None
    for response in stub.Generate(request, timeout=timeout):
        ids.append(response.token.id)
        text += response.token.text_delta
        if response.HasField("finish"):
            finish = response.finish
    return ids, text, finish


def long_request(n=200):
    from kvserve.v1 import generation_pb2 as pb

    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_new_tokens=n, ignore_eos=True)


def wait_for(predicate, timeout=10.0, interval=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def live(stub):
    from kvserve.v1 import generation_pb2 as pb

    return stub.GetModelInfo(pb.GetModelInfoRequest()).live


def slow_down(monkeypatch, app, seconds=0.01):
    """Make each model step of this server take a little longer, so tests can act mid-generation."""
    for name in ("run_slots", "run_decode"):  # a slots step, a fixed-shape decode step
        real = getattr(app.runtime, name)

        def slowed(*args, real=real):
            time.sleep(seconds)
            return real(*args)

        monkeypatch.setattr(app.runtime, name, slowed)


@contextlib.contextmanager
def slowed_server(artifact, monkeypatch, seconds: float = 0.01, **options):
    """A server of the test's own whose model steps each take `seconds` longer: (server, stub, channel)."""
    from kvserve.v1 import generation_pb2_grpc as pb_grpc

    with serving(artifact, **options) as running:
        slow_down(monkeypatch, running.app, seconds)
        with grpc.insecure_channel(running.target) as channel:
            yield running, pb_grpc.GenerationServiceStub(channel), channel


def scrape(port: int) -> dict:
    """A server's /metrics: {(sample name, frozenset(labels)): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture(scope="session")
def tiny_chat_artifact(tiny_artifact, tmp_path_factory):
    """The tiny artifact (one token per byte) with the default model's chat template beside it, named tiny-chat."""
    import shutil

    from ..conftest import DEFAULT_CHECKPOINT

    directory = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_artifact, directory)
    shutil.copy2(DEFAULT_CHECKPOINT / "chat_template.jinja", directory / "chat_template.jinja")
    return directory


def random_prompt(seed: int, length: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(1, 256, length).tolist()


def hole_between_rows(batch, seqs, leaving: int, steps: int, budget: int):
    """As under CUDA, where a freed row stays a hole until a join fills it: seqs run steps steps in a batch that does not
    compact, then seqs[leaving] is cancelled and leaves at the next step. Returns the scheduler."""
    from kvserve.service.core.scheduler import Scheduler

    scheduler = Scheduler(batch, step_token_budget=budget)
    scheduler.kv.compact = False
    for seq in seqs:
        scheduler.waiting.append(seq)
    for _ in range(steps):
        scheduler.run_step(scheduler.plan())
    seqs[leaving].cancelled = True
    scheduler.run_step(scheduler.plan())
    assert scheduler.kv.slots[leaving] is None
    return scheduler


def sequence(seq_id: int, prompt: list[int], max_new_tokens: int, return_logprobs: bool = False, **sampling):
    """A server-internal sequence (no client, no stop rules) with the sampling parameters given (default: greedy)."""
    from kvserve.contract.tokenizer import ByteTokenizer
    from kvserve.service.core.sampling import SamplingParams
    from kvserve.service.core.sequence import Sequence
    from kvserve.service.core.text import IncrementalDecoder, StopSequences

    return Sequence(id=seq_id, prompt_ids=prompt, max_new_tokens=max_new_tokens, params=SamplingParams(**sampling), stop_ids=frozenset(),
                    return_logprobs=return_logprobs, decoder=IncrementalDecoder(ByteTokenizer()), stops=StopSequences(()))


@dataclass(frozen=True)
class SlotsGraph:
    """One slots artifact opened on the tests' provider, its eager model, and what its numbers are held to."""

    artifact_dir: Path
    runtime: object  # kvserve.runtime.DecoderRuntime
    model: object  # the eager torch module
    greedy_is_eager: bool  # float32: a sequence's tokens are eager generate's; float16: the artifact's own, run alone
    kv_relative_error: float  # largest |K/V - eager| relative to the eager values' largest |value|
    kv_scales: tuple | None = None  # an int8 pool's K and V scales, each (L, H_kv, d_k)

    def read_row(self, pool, row: int, columns: int) -> list:
        """A pool row's first columns per layer K then V, each (H_kv, columns, d_k), as attention reads them: float32."""
        return pool.read_row(row, columns, self.kv_scales)

    def assert_row_holds_eager_kv(self, scheduler, seq) -> None:
        """seq's row (in scheduler's pool) holds, at each position it kept, the eager model's K/V over the tokens it fed
        (its prompt and every generated token but the last), within kv_relative_error of the eager values' largest."""
        import numpy as np
        import torch

        fed = seq.prompt_ids + seq.generated[:-1]
        hold = scheduler.kv.held[seq]
        assert hold.cached_tokens == len(fed)
        ids = torch.tensor([fed])
        with torch.no_grad():
            _, present = self.model(ids, torch.ones_like(ids), torch.arange(len(fed))[None], self.model.empty_cache(1))
        row = self.read_row(scheduler.batch.pool, hold.index, hold.cached_tokens)  # per layer K then V, (H, L, d_k)
        for layer, (k, v) in enumerate(present):
            for got, want in ((row[2 * layer], k[0].numpy()), (row[2 * layer + 1], v[0].numpy())):
                assert np.abs(got - want).max() <= self.kv_relative_error * max(1.0, np.abs(want).max())

    def alone(self, seq) -> list[int]:
        """The tokens seq must generate, batched or not: float16 greedy is not held to eager's (a near-tie may flip:
        contract/tolerances.py), so there the reference is the same artifact generating the prompt on its own."""
        from kvserve.export.parity import artifact_greedy
        from kvserve.model.generate import generate

        from ..conftest import PROVIDER

        if self.greedy_is_eager:
            return generate(self.model, [seq.prompt_ids], seq.max_new_tokens).tokens[0].tolist()
        return artifact_greedy(self.artifact_dir, [seq.prompt_ids], seq.max_new_tokens, PROVIDER)[0].tolist()


# The slots graphs the batch runs: GPT-2's standard attention, GPT-2's and a Llama's fused attention (GroupQueryAttention),
# the Llama's fused one in each of FUSED_DTYPES (float32 and float16; float16 alone under CUDA, whose kernel has no float32),
# and float32 graphs whose pool holds int8 (fused) or float16 (standard) K/V (export --kv-dtype). GPT-2's fused graph is
# in the first of FUSED_DTYPES; the int8 pool beside a float32 fused graph is the CPU's alone (CUDA's kernel is float16).
@pytest.fixture(scope="module", params=["gpt2 standard", "gpt2 fused"] + [f"llama fused {dtype}" for dtype in FUSED_DTYPES]
                + (["llama fused int8-kv"] if "float32" in FUSED_DTYPES else []) + ["gpt2 standard float16-kv"])
def slots_graph(request, tiny_llama_fused_artifacts, kv_dtype_artifacts) -> SlotsGraph:
    import copy

    import torch

    from kvserve.contract.artifact import open_artifact
    from kvserve.model.kv_storage import store_kv_as
    from kvserve.runtime import DecoderRuntime

    from ..conftest import PROVIDER

    family, attention, kind = (request.param.split() + [""])[:3]
    model = request.getfixturevalue("tiny_model" if family == "gpt2" else "tiny_llama_model")
    if kind.endswith("-kv"):
        artifact_dir = kv_dtype_artifacts("tiny" if family == "gpt2" else "tiny-llama", attention, kind.removesuffix("-kv"))
    elif family == "gpt2":
        artifact_dir = request.getfixturevalue("tiny_standard_artifact" if attention == "standard" else "tiny_fused_artifact")
    else:
        artifact_dir = tiny_llama_fused_artifacts(kind)
    artifact = open_artifact(artifact_dir)
    assert artifact.attention == attention
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER)
    tolerance = artifact.tolerance
    scales = artifact.kv_scales()
    if artifact.kv_dtype != artifact.dtype:  # the eager model storing K/V as the pool does (a copy: the session's model stays as it is)
        model = store_kv_as(copy.deepcopy(model), artifact.kv_dtype, *(() if scales is None else map(torch.from_numpy, scales)))
    # float32: rounding only; float16 and K/V stored in fewer bits: the parity tolerance, relative like it (tiny-llama's wide
    # weights make K of 10 and more)
    kv_error = 1e-5 if artifact.precision == "float32" else tolerance.kv_max_abs
    return SlotsGraph(artifact_dir, runtime, model, tolerance.greedy_identical, kv_error, scales)


@pytest.fixture(scope="module")
def slots_runtime(slots_graph):
    return slots_graph.runtime


@pytest.fixture(scope="module")
def slots_model(slots_graph):
    return slots_graph.model


@pytest.fixture(scope="session")
def float16_fused(tiny_fused_float16_artifact, tiny_model, tiny_llama_model, tiny_llama_fused_artifacts):
    """family -> (the tiny or tiny-llama preset exported float16 with fused attention: a decode graph and a chunk graph
    beside its step graph, what CUDA serves; its eager model)."""
    return {"gpt2": (tiny_fused_float16_artifact, tiny_model), "llama": (tiny_llama_fused_artifacts("float16"), tiny_llama_model)}


class FlatCosts(StepCosts):
    """Step costs that say every draft pays (a step costs one, drafts or not), whatever this machine measures: which rows
    draft then depends on the drafts alone, never on timing."""

    def record(self, rows: int, drafts: int, seconds: float) -> None:
        pass

    def cost(self, rows: int, drafts: int) -> float:
        return 1.0

    def may_pay(self, rows: int) -> bool:
        return True


@pytest.fixture
def oracle(monkeypatch):
    """Prompt lookup replaced by drafts that are each row's true next tokens (from a run without drafts), every third
    offer with one of them wrong: drafts accepted whole, cut short, refused at once, all in one run. Returns the dict
    to fill: {prompt: the tokens it generates without drafts}; a row whose tokens begin with several is offered the
    longest's."""
    truth: dict[tuple, list[int]] = {}

    def propose(self, k: int) -> list[int]:
        for prompt, generated in sorted(truth.items(), key=lambda item: -len(item[0])):  # the longest that matches
            if tuple(self.tokens[: len(prompt)]) == prompt:
                done = len(self.tokens) - len(prompt)
                drafts = list(generated[done: done + k])
                self.offers = getattr(self, "offers", 0) + 1
                if drafts and self.offers % 3 == 0:
                    wrong = done % len(drafts)
                    drafts[wrong] = (drafts[wrong] + 1) % 250
                return drafts
        return []

    monkeypatch.setattr(PromptLookup, "propose", propose)
    return truth
