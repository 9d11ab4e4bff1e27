"""The prompt cache: finished rows keep their K/V, a new prompt takes the row holding its longest start (or copies it
from a row in use) and prefills only the rest, with the same numbers as with the cache off; and it is visible in
FinishDetails, GetModelInfo and the metrics, and switched off by --prompt-cache off."""


import numpy as np
import pytest

from kvserve.contract.artifact import open_artifact
from kvserve.contract.tolerances import TOLERANCES
from kvserve.runtime.step import DecoderRuntime
from kvserve.service.core.batch import SlotBatch
from kvserve.service.core.prompt_cache import BLOCK_TOKENS, PrefixIndex
from kvserve.service.core.scheduler import Scheduler
from kvserve.service.core.step_plan import StepPlan
from kvserve.v1 import generation_pb2 as pb

from ...conftest import FUSED_DTYPES, PROVIDER
from ..conftest import collect, live, random_prompt, scrape, sequence, start_server

# --- the index ---------------------------------------------------------------------------------------------


def test_the_index_finds_each_rows_shared_start_and_forgets_what_is_removed():
    index = PrefixIndex()
    base = list(range(100, 200))
    index.put(0, base)
    index.put(1, base[:40] + [7] * 30)
    index.put(2, base[:20])  # one whole block and a few ids
    index.put(3, [5] * 64)
    assert index.matches(base[:70] + [1]) == {0: 70, 1: 40, 2: 20}
    assert index.matches(base[:BLOCK_TOKENS - 1]) == {}  # shorter than a block: not looked for
    assert index.matches([9] * 64) == {}
    index.swap(0, 3)
    assert index.matches(base) == {3: 100, 1: 40, 2: 20} and index.matches([5] * 70) == {0: 64}
    index.remove(3)
    assert 3 not in index and index.matches(base) == {1: 40, 2: 20}


def test_a_key_collision_shortens_a_match_and_never_makes_a_wrong_one():
    index = PrefixIndex()
    index.put(0, list(range(64)))
    index._tokens[0][5] = 999  # the row's ids no longer agree with the keys it was indexed by
    prompt = list(range(64)) + [1]
    assert index.matches(prompt)[0] == 64  # the keys say 64
    assert index.confirm(0, prompt, 64) == 5  # the ids say 5


# --- the batch: same numbers with the cache on and off ------------------------------------------------------


@pytest.fixture(scope="module", params=["gpt2", "llama fused"])
def runtime_and_config(request, tiny_artifact, tiny_llama_fused_artifacts):
    # gpt2: the default export (fused on the CPU, standard under CUDA); the Llama's fused graph in the provider's dtype
    artifact_dir = tiny_artifact if request.param == "gpt2" else tiny_llama_fused_artifacts(FUSED_DTYPES[0])
    artifact = open_artifact(artifact_dir)
    return DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER), artifact.config


def chat_workload():
    """Sequences that share starts the way real traffic does: requests sharing a system prompt arriving together (the
    later ones take it from the first, still running), one of them cancelled mid-prefill, one sharing nothing."""
    system = random_prompt(1, 40)
    first = [sequence(100 + i, system + random_prompt(10 + i, 9 + 5 * i), 12, return_logprobs=True) for i in range(2)]
    cancelled = sequence(102, system + random_prompt(50, 80), 4, return_logprobs=True)
    unrelated = sequence(103, random_prompt(99, 30), 6, return_logprobs=True)
    return first, cancelled, unrelated


def run_workload(runtime, config, prompt_cache: bool, compact: bool, plant: bool = False):
    """The workload through a 3-row batch (so rows are evicted) with a 12-token budget (so prompts are chunked), then
    two second turns, each sending a first turn's prompt and answer again. Returns ({sequence id: (tokens, log-
    probabilities)}, {sequence id: prompt tokens reused}). plant: before the second turns, every free row's columns
    past what it holds are filled with large numbers (a request reading past its shared prefix would change)."""
    batch = SlotBatch(runtime, config, 3)
    scheduler = Scheduler(batch, step_token_budget=12, prompt_cache=prompt_cache)
    scheduler.kv.compact = compact and batch.pool.copies_rows
    first, cancelled, unrelated = chat_workload()
    results = []
    for seq in first + [cancelled]:
        scheduler.waiting.append(seq)
    held = scheduler.kv.held
    while cancelled not in held or held[cancelled].cached_tokens <= cancelled.reused_prompt_tokens:  # until it has prefilled a chunk of its own
        results += scheduler.run_step(scheduler.plan())
    assert held[cancelled].cached_tokens < len(cancelled.prompt_ids)  # mid-prefill
    cancelled.cancelled = True
    results += scheduler.drive([unrelated])
    if plant and batch.pool.arrays is not None:
        rng = np.random.default_rng(0)
        for row in scheduler.kv.cached:
            held = len(scheduler.kv.prefixes.tokens(row))
            for array in batch.pool.arrays:
                array[row, :, held:-1] = rng.normal(0, 100, array[row, :, held:-1].shape)
    second = [sequence(200 + i, seq.prompt_ids + seq.generated + random_prompt(20 + i, 7), 10, return_logprobs=True)
              for i, seq in enumerate(first[:2])]
    results += scheduler.drive(second)
    assert not [event for _, event in results if isinstance(event, BaseException)]
    outputs = {}
    for seq, event in results:
        tokens, logprobs = outputs.setdefault(seq.id, ([], []))
        tokens.append(event.token_id)
        logprobs.append(event.logprob)
    reused = {seq.id: seq.reused_prompt_tokens for seq in first + [cancelled, unrelated] + second}
    return outputs, reused, {seq.id: seq for seq in first}


@pytest.mark.parametrize("compact", [True, False], ids=["rows kept dense", "holes (no row copies)"])
def test_tokens_and_log_probabilities_are_the_same_with_the_cache_on_and_off(runtime_and_config, compact):
    runtime, config = runtime_and_config
    runtime.traffic.host_bytes = runtime.traffic.device_copies = 0
    on, reused, first = run_workload(runtime, config, True, compact, plant=True)
    copies = runtime.traffic.device_copies
    off, not_reused, _ = run_workload(runtime, config, False, compact)
    assert on.keys() == off.keys() == {100, 101, 103, 200, 201}  # the cancelled one produced nothing
    bound = 10 * TOLERANCES["float32"].logits_max_abs  # a log-probability moves at most twice its logits' error
    for seq_id, (tokens, logprobs) in on.items():
        assert tokens == off[seq_id][0], seq_id
        assert np.allclose(logprobs, off[seq_id][1], atol=bound, rtol=0), seq_id
    assert not any(not_reused.values()) and reused[103] == 0
    assert reused[101] == reused[102] == 40  # the system prompt, copied from the first request's row while it ran
    assert copies >= 2 and runtime.traffic.host_bytes == 0
    for turn, earlier in ((200, first[100]), (201, first[101])):
        # the earlier turn's row holds its prompt and every generated token but the last (never fed back)
        assert reused[turn] == len(earlier.prompt_ids) + len(earlier.generated) - 1


def test_a_request_cancelled_mid_prefill_leaves_exactly_the_tokens_it_wrote(runtime_and_config):
    runtime, config = runtime_and_config
    batch = SlotBatch(runtime, config, 2)
    scheduler = Scheduler(batch, step_token_budget=12)
    runner = sequence(1, random_prompt(60, 5), 30)  # decoding, so the long prompt is prefilled in chunks beside it
    scheduler.waiting.append(runner)
    scheduler.run_step(scheduler.plan())
    long = sequence(2, random_prompt(61, 90), 2)
    scheduler.waiting.append(long)
    for _ in range(2):
        scheduler.run_step(scheduler.plan())
    written = scheduler.kv.held[long].cached_tokens
    assert written == 2 * 11  # two chunks of the budget less the runner's token
    long.cancelled = True
    scheduler.run_step(scheduler.plan())
    (row,) = scheduler.kv.cached
    assert scheduler.kv.prefixes.tokens(row) == long.prompt_ids[:written]
    retry = sequence(3, list(long.prompt_ids), 2)
    scheduler.drive([retry])
    assert retry.reused_prompt_tokens == written


def test_a_prefix_taken_from_a_row_still_prefilling_stops_at_what_that_row_has_written(runtime_and_config):
    """The scheduler admits a request only when no prompt is mid-prefill; the rows hold this on their own too."""
    runtime, config = runtime_and_config
    scheduler = Scheduler(SlotBatch(runtime, config, 2), step_token_budget=0)
    prompt = random_prompt(70, 60)
    first, second = sequence(1, prompt, 4), sequence(2, prompt + [5], 4)
    scheduler.kv.join(first)
    kv = scheduler.kv
    scheduler.run_step(StepPlan(joining=[first], chunk=first, chunk_tokens=20, slots=list(kv.slots), held=kv.held))
    kv.join(second)  # while the first has written 20
    scheduler.run_step(StepPlan(joining=[second], chunk=first, chunk_tokens=20, slots=list(kv.slots), held=kv.held))
    assert second.reused_prompt_tokens == 20 and kv.held[first].cached_tokens == 40
    scheduler.drive([])
    alone = [sequence(3 + i, seq.prompt_ids, 4) for i, seq in enumerate((first, second))]
    Scheduler(SlotBatch(runtime, config, 1), step_token_budget=0, prompt_cache=False).drive(alone)
    assert [first.generated, second.generated] == [seq.generated for seq in alone]


def test_the_longest_match_is_chosen_and_the_least_recently_used_row_is_evicted(runtime_and_config):
    runtime, config = runtime_and_config
    batch = SlotBatch(runtime, config, 3)
    scheduler = Scheduler(batch, step_token_budget=0)
    prompts = [random_prompt(300 + i, 48) for i in range(3)]
    for i, prompt in enumerate(prompts):  # one after the other: finished in this order, the first least recently used
        scheduler.drive([sequence(i, prompt, 2)])
    assert scheduler.kv.cached_rows() == 3
    longer = sequence(10, prompts[1][:40] + prompts[2][:8], 2)  # shares 40 with the second, 0 with the rest
    scheduler.drive([longer])
    assert longer.reused_prompt_tokens == 40
    stranger = sequence(11, random_prompt(999, 20), 2)  # nothing shared: overwrites the least recently used row
    scheduler.drive([stranger])
    assert stranger.reused_prompt_tokens == 0
    held = [scheduler.kv.prefixes.tokens(row)[:48] for row in scheduler.kv.cached]
    assert prompts[0] not in held and prompts[2] in held  # the first was the oldest; the third stays
    again = sequence(12, prompts[2] + [1], 2)
    scheduler.drive([again])
    assert again.reused_prompt_tokens == 48


def test_with_the_cache_off_nothing_is_kept_or_reused(runtime_and_config):
    runtime, config = runtime_and_config
    scheduler = Scheduler(SlotBatch(runtime, config, 2), step_token_budget=0, prompt_cache=False)
    prompt = random_prompt(5, 40)
    seqs = [sequence(i, prompt, 3) for i in range(3)]
    for seq in seqs:
        scheduler.drive([seq])
    assert scheduler.kv.cached_rows() == 0 and all(seq.reused_prompt_tokens == 0 for seq in seqs)


# --- through the server --------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_cache", [True, False], ids=["--prompt-cache on", "--prompt-cache off"])
def test_the_server_reports_reused_prompt_tokens_in_finish_details_model_info_and_metrics(tiny_artifact, prompt_cache):
    running = start_server(tiny_artifact, max_batch_size=2, prompt_cache=prompt_cache, metrics_port=0)
    try:
        import grpc

        from kvserve.v1 import generation_pb2_grpc as pb_grpc

        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            prompt = random_prompt(7, 50)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=5, ignore_eos=True)
            first_ids, _, first = collect(stub, request)
            assert first.cached_prompt_tokens == 0 and live(stub).cached_rows == (1 if prompt_cache else 0)
            again_ids, _, again = collect(stub, request)
            assert again_ids == first_ids
            assert again.cached_prompt_tokens == (49 if prompt_cache else 0)  # all but the last prompt token
            metrics = scrape(running.app.metrics_port)
            reused = metrics[("kvserve_prompt_tokens_total", frozenset({("source", "reused")}))]
            computed = metrics[("kvserve_prompt_tokens_total", frozenset({("source", "computed")}))]
            assert (reused, computed) == ((49, 51) if prompt_cache else (0, 100))
            assert metrics[("kvserve_prompt_cache_rows", frozenset())] == (1 if prompt_cache else 0)
    finally:
        running.stop()
