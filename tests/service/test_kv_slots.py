"""The slots batch on its own (no gRPC): rows in a device pool, chunked prefill interleaved with decode, the
K/V each row holds, joins and leaves that never send K/V through the host, and a step that fails. The batch's
tests run on both slots graphs: GPT-2's standard attention, GPT-2's and a Llama's fused attention (GroupQueryAttention),
the Llama's fused one in each of FUSED_DTYPES (float32 and float16; float16 alone under CUDA, whose kernel has no float32)."""

import asyncio
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.contract.artifact import open_artifact
from kvserve.export.parity import artifact_greedy
from kvserve.contract.tolerances import TOLERANCES
from kvserve.model.generate import generate
from kvserve.service.gate import _greedy_sequence
from kvserve.service.batch import SlotBatch
from kvserve.runtime.step import DecoderRuntime
from kvserve.service.scheduler import Scheduler

from ..conftest import FUSED_DTYPES, PROVIDER
from .conftest import hole_between_rows, sequence
from .conftest import random_prompt as prompt


@dataclass(frozen=True)
class Served:
    """One slots artifact opened on the tests' provider, its eager model, and what its numbers are held to."""

    artifact_dir: Path
    runtime: DecoderRuntime
    model: torch.nn.Module
    greedy_is_eager: bool  # float32: a sequence's tokens are eager generate's; float16: the artifact's own, run alone
    kv_relative_error: float  # largest |K/V - eager| relative to the eager values' largest |value|

    def alone(self, seq) -> list[int]:
        """The tokens seq must generate, batched or not: float16 greedy is not held to eager's (a near-tie may flip:
        contract/tolerances.py), so there the reference is the same artifact generating the prompt on its own."""
        if self.greedy_is_eager:
            return generate(self.model, [seq.prompt_ids], seq.max_new_tokens).tokens[0].tolist()
        return artifact_greedy(self.artifact_dir, [seq.prompt_ids], seq.max_new_tokens, PROVIDER)[0].tolist()


@pytest.fixture(scope="module", params=["gpt2 standard", "gpt2 fused"] + [f"llama fused {dtype}" for dtype in FUSED_DTYPES])
def served(request, tiny_llama_fused_artifacts) -> Served:
    if request.param.startswith("gpt2"):
        fixture = "tiny_standard_artifact" if request.param == "gpt2 standard" else "tiny_artifact"
        model, artifact_dir = request.getfixturevalue("tiny_model"), request.getfixturevalue(fixture)
    else:
        model, artifact_dir = request.getfixturevalue("tiny_llama_model"), tiny_llama_fused_artifacts(request.param.split()[-1])
    artifact = open_artifact(artifact_dir)
    assert artifact.attention == request.param.split()[1]
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER)
    tolerance = TOLERANCES[artifact.precision]
    # float32: rounding only; float16: the parity tolerance, relative like it (tiny-llama's wide weights make K of 10 and more)
    kv_error = 1e-5 if artifact.dtype == "float32" else tolerance.kv_max_abs
    return Served(artifact_dir, runtime, model, tolerance.greedy_identical, kv_error)


@pytest.fixture(scope="module")
def runtime(served):
    return served.runtime


@pytest.fixture(scope="module")
def model(served):
    return served.model


def test_every_row_decodes_every_step_while_a_long_prompt_is_prefilled_in_chunks(served, runtime, model):
    scheduler = Scheduler(SlotBatch(runtime, model.config, 4), step_token_budget=8)
    running = [_greedy_sequence(i, prompt(i, 5), 60) for i in range(2)]
    scheduler.drive([])  # nothing to do
    for seq in running:
        scheduler.waiting.append(seq)
    while any(not s.generated for s in running):
        scheduler.batch.run(scheduler.plan())
    long = _greedy_sequence(9, prompt(9, 70), 5)
    scheduler.waiting.append(long)
    chunks = []
    while not long.generated:
        before = [len(s.generated) for s in running]
        plan = scheduler.plan()
        chunks.append(plan.chunk_tokens)
        scheduler.batch.run(plan)
        assert [len(s.generated) for s in running] == [n + 1 for n in before]  # nobody waits for the prefill
    assert sum(chunks) == 70 and max(chunks) == 8 - len(running)  # the budget: 2 decode tokens + a 6-token chunk
    for seq in running + [long]:
        while not seq.finished:
            scheduler.batch.run(scheduler.plan())
    for seq in running + [long]:
        assert seq.generated == served.alone(seq)


def test_a_prompt_arriving_at_an_idle_batch_is_prefilled_in_one_step(runtime, model):
    scheduler = Scheduler(SlotBatch(runtime, model.config, 2), step_token_budget=8)
    scheduler.waiting.append(_greedy_sequence(1, prompt(1, 50), 3))
    plan = scheduler.plan()
    assert plan.chunk_tokens == 50 and not plan.decode
    unlimited = Scheduler(SlotBatch(runtime, model.config, 2), step_token_budget=0)
    unlimited.drive([_greedy_sequence(2, prompt(2, 4), 30)])
    assert not unlimited.batch.kv.rows


@torch.no_grad()
def test_a_rows_kv_equals_the_eager_models_at_its_real_positions(served, runtime, model):
    batch = SlotBatch(runtime, model.config, 3)
    scheduler = Scheduler(batch, step_token_budget=6)
    seqs = [_greedy_sequence(i, prompt(10 + i, n), 40) for i, n in enumerate((3, 17, 40))]
    for seq in seqs:
        scheduler.waiting.append(seq)
    for _ in range(16):  # every prompt in (chunks for the two longer ones), then some decode steps
        batch.run(scheduler.plan())
    for seq in seqs:
        fed = seq.prompt_ids + seq.generated[:-1]  # the tokens whose K/V the row holds
        assert seq.cached_tokens == len(fed)
        ids = torch.tensor([fed])
        _, present = model(ids, torch.ones_like(ids), torch.arange(len(fed))[None], model.empty_cache(1))
        row = batch.kv.pool.row_to_host(seq.slot, seq.cached_tokens)  # per layer K then V, (H, L, d_k)
        for layer, (k, v) in enumerate(present):
            for got, want in ((row[2 * layer], k[0].numpy()), (row[2 * layer + 1], v[0].numpy())):
                assert np.abs(got - want).max() <= served.kv_relative_error * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("prompt_cache", [False, True], ids=["cache off", "cache on"])
def test_fifty_joins_and_leaves_move_no_kv_through_the_host(served, runtime, model, prompt_cache):
    runtime.traffic.host_bytes = runtime.traffic.device_copies = 0
    batch = SlotBatch(runtime, model.config, 4, prompt_cache=prompt_cache)
    seqs = [_greedy_sequence(i, prompt(100 + i, 1 + (7 * i) % 40), 1 + (5 * i) % 17) for i in range(50)]
    results = Scheduler(batch, step_token_budget=10).drive(seqs)
    assert all(s.finished for s in seqs) and not batch.kv.rows
    assert not [e for _, e in results if isinstance(e, BaseException)]
    assert runtime.traffic.host_bytes == 0
    # a leave moves at most one row (on CPU; none under CUDA), a join at most one (a cached row moving into place)
    assert runtime.traffic.device_copies <= (100 if prompt_cache else 50)
    if runtime.device == "cpu" and not prompt_cache:
        assert runtime.traffic.device_copies > 0  # leaves below the last row were compacted
    for seq in seqs[::7]:
        assert seq.generated == served.alone(seq)


def test_greedy_rows_read_back_tokens_alone_and_a_row_that_samples_reads_the_logits(served, runtime, model):
    """A step whose rows all choose greedily takes the graph's greedy_tokens and leaves the logits where the step ran;
    one row that samples or reports log-probabilities makes the steps it shares read the logits, for every row, and
    every row gets what it would get alone."""
    runtime.traffic.logits_bytes = 0
    batch = SlotBatch(runtime, model.config, 4)
    greedy = [_greedy_sequence(i, prompt(500 + i, 1 + (9 * i) % 40), 1 + (5 * i) % 13) for i in range(10)]
    Scheduler(batch, step_token_budget=10).drive(greedy)
    assert runtime.traffic.logits_bytes == 0
    for seq in greedy[::3]:
        assert seq.generated == served.alone(seq)

    def mixed():
        return [sequence(20, prompt(20, 7), 12, temperature=0.8, top_k=20, seed=5),
                sequence(21, prompt(21, 9), 12, return_logprobs=True)] + [_greedy_sequence(22 + i, prompt(22 + i, 5), 12) for i in range(2)]

    together = mixed()
    results = Scheduler(batch, step_token_budget=10).drive(together)
    assert runtime.traffic.logits_bytes > 0
    assert all(event.logprob is not None for seq, event in results if seq is together[1])
    for seq, alone in zip(together, mixed()):
        Scheduler(SlotBatch(runtime, model.config, 1), step_token_budget=10).drive([alone])
        assert seq.generated == alone.generated, seq.id
    assert together[1].generated == served.alone(together[1])  # greedy with log-probabilities: its logits' argmax


def test_a_cancelled_sequence_frees_its_row_within_one_step(runtime, model):
    batch = SlotBatch(runtime, model.config, 3)
    scheduler = Scheduler(batch, step_token_budget=8)
    seqs = [_greedy_sequence(i, prompt(i, 6), 50) for i in range(3)]
    for seq in seqs:
        scheduler.waiting.append(seq)
    for _ in range(4):
        batch.run(scheduler.plan())
    assert len(batch.kv.rows) == 3
    seqs[0].cancelled = True
    batch.run(scheduler.plan())
    assert seqs[0] not in batch.kv.rows and seqs[0].slot is None and len(batch.kv.rows) == 2
    assert sorted(s.slot for s in batch.kv.rows) == [0, 1]  # the last row moved into the freed one


def test_a_failed_step_fails_every_sequence_in_it_exactly_once(tiny_artifact, tiny_model, monkeypatch):
    artifact = open_artifact(tiny_artifact)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER)
    batch = SlotBatch(runtime, artifact.config, 4)
    # the failure comes after the joining sequence has its row: the case that once reported it twice
    inner = "_step"
    real = batch._step

    async def scenario():
        scheduler = Scheduler(batch, step_token_budget=32)
        seqs = [_greedy_sequence(i, prompt(i, 4), 20) for i in range(3)]
        rows_before_failure = []

        def fail_after(*args):  # the step in which the third sequence joined (one joins a step), after it ran
            rows_before_failure.append(len(batch.kv.rows))
            results = real(*args)
            if seqs[2].slot is None:
                return results
            raise RuntimeError("injected step failure")

        monkeypatch.setattr(batch, inner, fail_after)
        for seq in seqs:
            seq.events = asyncio.Queue()
            scheduler.submit(seq)
        await scheduler._step()  # the steps the step thread runs on, up to the failure
        assert rows_before_failure[-1] == 3 and seqs[0].generated and seqs[1].generated
        failures = {}
        for seq in seqs:
            while not seq.events.empty():
                event = seq.events.get_nowait()
                if isinstance(event, BaseException):
                    failures[seq.id] = failures.get(seq.id, 0) + 1
        scheduler.close()
        return failures, seqs

    failures, seqs = asyncio.run(scenario())
    assert failures == {0: 1, 1: 1, 2: 1}
    assert all(s.finished for s in seqs) and not batch.kv.rows
    monkeypatch.setattr(batch, inner, real)
    after = _greedy_sequence(7, prompt(7, 5), 6)  # the batch serves again
    Scheduler(batch, step_token_budget=32).drive([after])
    assert after.generated == generate(tiny_model, [after.prompt_ids], 6).tokens[0].tolist()


def test_a_prompt_chunked_into_a_hole_between_decoding_rows_generates_what_it_would_alone(served, runtime, model):
    """As under CUDA, where a freed row stays a hole until a join fills it: the joining prompt's chunks run in a row
    below decoding ones (the fused graph's decode run then covers the chunk's row with a scratch token)."""
    batch = SlotBatch(runtime, model.config, 3)
    seqs = [_greedy_sequence(i, prompt(200 + i, 5), 40) for i in range(3)]
    scheduler = hole_between_rows(batch, seqs, leaving=1, steps=6, budget=7)
    assert seqs[2].slot == 2  # a hole between two decoding rows
    joining = _greedy_sequence(9, prompt(209, 30), 12)
    scheduler.waiting.append(joining)
    chunked = 0
    while not joining.generated:
        plan = scheduler.plan()
        chunked += plan.chunk is joining and len(plan.decode) == 2
        batch.run(plan)
    assert joining.slot == 1 and chunked >= 3  # its prompt went in chunks beside both decoding rows
    for seq in (seqs[0], seqs[2], joining):
        while not seq.finished:
            batch.run(scheduler.plan())
        assert seq.generated == served.alone(seq)


def test_the_handoff_never_leaves_a_flush_waiting_when_it_is_closed_meanwhile():
    """The step thread flushes the hand-off (scheduler.Handoff) while the engine may be closing it from another
    thread. Here the close is started at the worst moment, just as the flush hands in its marker: the flush must still
    return (a marker handed in after the thread's stop once waited forever, and the interpreter hung at exit waiting
    for the step thread), and what was handed over before reaches the loop."""
    import threading

    from kvserve.service.scheduler import Handoff

    loop = asyncio.new_event_loop()
    delivered = []
    handoff = Handoff(delivered.append)
    handoff.hand_over(loop, ["step"])
    real_queue = handoff._queue

    class CloseAsFlushHandsIn:
        def put(self, item):
            if isinstance(item, threading.Event):
                closing = threading.Thread(target=handoff.close)
                closing.start()
                closing.join(0.5)  # a close that can run now, runs to its end first
            real_queue.put(item)

        def get(self):
            return real_queue.get()

    handoff._queue = CloseAsFlushHandsIn()
    flushing = threading.Thread(target=handoff.flush, daemon=True)
    try:
        flushing.start()
        flushing.join(5)
        assert not flushing.is_alive(), "the flush waits for a hand-off thread that has stopped"
        handoff.close()
        handoff.hand_over(loop, ["after close"])  # passed to the loop directly
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    assert delivered == [["step"], ["after close"]]
