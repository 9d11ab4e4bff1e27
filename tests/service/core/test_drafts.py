"""Speculation (service/core/drafts.py): rows that check drafts in one step generate exactly what they generate without
(greedy), keep the target distribution (sampled), roll back what they did not keep, and stop inside an accepted draft
where they would stop without it. The batch tests run on every slots graph (conftest.slots_graph)."""

import json

import numpy as np
import pytest

from kvserve.contract.tokenizer import ByteTokenizer
from kvserve.service.core.batch import SlotBatch
from kvserve.service.core.drafts import (FORGET_EVERY, FORGET_STEPS, MAX_DRAFT_TOKENS, OUTLIER, Acceptance, DraftState,
                                         PromptLookup, StepCosts, SuffixCache, most_drafts)
from kvserve.service.core.sampling import SamplingParams, choose
from kvserve.service.core.scheduler import Scheduler
from kvserve.service.core.structured import FormatCompiler, FormatKind, ResponseFormat
from kvserve.service.core.text import StopSequences

from ..conftest import FlatCosts, random_prompt, sequence

# --- the draft sources and the cost model --------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence_of_the_last_tokens():
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    assert lookup.propose(4) == []  # "7 8" and "8" never came before
    lookup.push(2)
    lookup.push(3)  # "2 3": last followed by 7 8 (the latest occurrence wins over the one followed by 4 5)
    assert lookup.propose(4) == [7, 8, 2, 3]
    assert lookup.propose(1) == [7]
    lookup.push(4)  # "2 3 4" (three tokens) occurred once, followed by 5 9
    assert lookup.propose(3) == [5, 9, 2]
    assert PromptLookup([6]).propose(4) == [] and PromptLookup([]).propose(4) == []


def test_the_output_cache_drafts_what_followed_in_an_earlier_answer_and_keeps_at_most_its_tokens():
    cache = SuffixCache(20)
    cache.add([9, 9, 1, 2, 3], [4, 5, 6, 7, 8])  # kept with the prompt's last 3 tokens: [1, 2, 3, 4, ..., 8]
    assert cache.propose([7, 1, 2, 3], 3) == [4, 5, 6]  # a new answer starting where that one started
    assert cache.propose([5, 6, 7], 4) == [8] and cache.propose([2, 3], 4) == [] and cache.held == 8
    cache.add([0], [30, 31, 32, 33, 34, 35, 36])  # 8 tokens more: 16 held
    cache.add([0], [40, 41, 42, 43, 44, 45, 46])  # 8 more than 20: the oldest answer goes, and its 3-grams
    assert cache.held == 16 and cache.propose([1, 2, 3], 3) == [] and cache.propose([30, 31, 32], 2) == [33, 34]
    cache.add([1, 2, 3], list(range(100, 130)))  # longer than the whole cache: not kept
    assert cache.held == 16
    off = SuffixCache(0)
    off.add([1, 2, 3], [4, 5, 6])
    assert off.held == 0 and off.propose([1, 2, 3], 2) == []


def test_a_lookup_whose_match_ends_near_the_end_drafts_the_text_since_it_repeating():
    looping = PromptLookup([5, 1, 2, 3, 1, 2, 3, 1, 2])  # "1 2" last came 3 tokens back: the loop "3 1 2" goes on
    assert looping.propose(8) == [3, 1, 2, 3, 1, 2, 3, 1]
    assert looping.propose(2) == [3, 1]  # as many as there are after it: nothing repeated
    assert PromptLookup([4, 7, 7, 7]).propose(3) == [7, 7, 7]  # a token repeating itself


def test_acceptance_counts_a_drafts_first_token_apart_and_never_the_tokens_after_a_refusal():
    copying = Acceptance(0.5, 0.5)
    for _ in range(6):
        copying.add(8, 8)  # taken whole
        copying.add(8, 0)  # refused at once
    assert 0.4 < copying.first < 0.6 and copying.then > 0.95  # half the drafts right, and those right to their end
    assert copying.expected_tokens(8) > 4  # about 1 + 8 / 2: one rate of 1/2 for every position would say under 2
    assert copying.expected_tokens(0) == 1.0
    broke = Acceptance(0.5, 0.5)
    for _ in range(8):
        broke.add(8, 5)  # 5 kept, the 6th refused: 4 of 5 later tokens tried were taken; the last two never were tried
    assert broke.first > 0.95 and broke.then == pytest.approx(0.8, abs=0.02)
    fixed = Acceptance(0.9)  # one rate for both
    assert fixed.expected_tokens(3) == pytest.approx(1 + 0.9 + 0.81 + 0.729)


def test_a_row_that_stopped_drafting_learns_from_its_unused_drafts_and_drafts_again():
    state = DraftState(PromptLookup([1, 2, 3, 4, 1, 2]))
    for _ in range(3):
        state.record(4, 0, grammar=False)  # refused at once three steps running
    low = state.acceptance.first
    drafts = state.lookup.propose(4)
    assert drafts == [3, 4, 1, 2]
    for token in (3, 4, 1):  # it does not draft, yet its tokens keep being what the lookup said
        state.found_unused(state.lookup.propose(4))
        state.lookup.push(token)
        state.check_unused()
    assert state.acceptance.first > low and state.unchecked is None
    state.found_unused([9])
    state.check_unused()  # its next token has not come yet: nothing learnt, still waiting
    assert state.unchecked is not None


def test_the_step_costs_draft_only_as_many_as_pay_for_their_acceptance():
    likely, rare = Acceptance(0.9), Acceptance(0.05)
    assert StepCosts().best_count(likely, 1, 8) == 0  # no plain step measured: nothing to weigh drafts against
    learning = StepCosts()
    assert not learning.may_pay(1)  # not yet measured: asked again at the next step, not held for GATE_STEPS
    learning.seconds[1, 0] = 1.0
    assert learning.may_pay(1)
    guessed = StepCosts({(1, 0): 1.0})  # drafts not tried yet: each guessed to cost PRIOR_SLOPE of a step
    assert guessed.cost(1, 4) == pytest.approx(1 + 4 * StepCosts.PRIOR_SLOPE) and guessed.best_count(likely, 1, 8) > 0
    assert guessed.best_count(rare, 1, 8) == 0  # drafts that are almost never taken never pay
    flat = StepCosts({(1, 0): 1.0, **{(1, k): 1.0 + 0.01 * k for k in (1, 2, 3, 4, 6, 8)}})  # as measured: barely grows
    assert flat.best_count(likely, 1, 8) == 8
    assert flat.best_count(likely, 1, 3) == 3  # no more than the drafts there are
    steep = StepCosts({(1, 0): 1.0, **{(1, k): 1.0 + k for k in (1, 2, 3, 4, 6, 8)}})  # every draft costs a whole step
    assert steep.best_count(likely, 1, 8) == 0
    wide = StepCosts({(16, 0): 1.0})  # one drafting row of 16: its gain is shared by a step that costs all 16 more
    assert wide.best_count(likely, 16, 8) == 0
    wide.record(16, 2, 9.0)  # a shape's first run (ONNX Runtime plans its memory) is not its cost
    assert (16, 2) not in wide.seconds
    wide.record(16, 2, 1.0)  # unless drafting measures as free there
    assert wide.best_count(likely, 16, 8) == 2
    wide.record(16, 2, 100.0)  # a stall counts as twice the running mean at most
    assert wide.seconds[16, 2] == pytest.approx(1.0 + StepCosts.WEIGHT * (2.0 - 1.0))


def test_the_step_costs_of_several_draft_counts_are_read_off_one_line_through_them():
    noisy = StepCosts({(1, 0): 1.0, (1, 2): 1.3, (1, 4): 1.5, (1, 6): 1.9, (1, 8): 1.6})  # 8 drafts timed below 6: noise
    assert noisy.cost(1, 8) > noisy.cost(1, 6) > noisy.cost(1, 4) > noisy.cost(1, 2) > noisy.cost(1, 0) == 1.0
    assert noisy.cost(1, 3) == pytest.approx((noisy.cost(1, 2) + noisy.cost(1, 4)) / 2)  # a count never run, on the line
    noisy.record(1, 8, 3.0)  # a new time moves the line
    assert noisy.cost(1, 8) > 1.9
    falling = StepCosts({(1, 0): 1.0, (1, 2): 1.4, (1, 8): 1.2})
    assert falling.cost(1, 8) == falling.cost(1, 2) >= 1.0  # more drafts are never read as cheaper
    below = StepCosts({(1, 0): 1.0, (1, 2): 0.8, (1, 6): 0.8})
    assert below.cost(1, 6) == 1.0  # nor as cheaper than a plain step
    close = StepCosts({(1, 0): 1.0, (1, 2): 1.1, (1, 3): 1.5})  # too close together for a slope: each mean as it is
    assert close.cost(1, 3) == 1.5 and close.cost(1, 8) == pytest.approx(1 + 8 * StepCosts.PRIOR_SLOPE)


def test_a_draft_counts_first_time_in_a_stall_counts_as_a_bounded_multiple_of_the_line():
    """A count's mean stands until that count runs again: its first time, taken in a stall (a server starting beside
    it), would steepen the line so far that the counts it priced out never run again to correct it."""
    likely = Acceptance(0.8, 0.95)
    costs = StepCosts({(1, 0): 1.0, **{(1, k): 1.0 + 0.12 * k for k in (1, 2, 3, 4, 6, 8, 12, 16)}})
    expected = costs.cost(1, 32)
    costs.record(1, 32, 50.0)  # a count's first run is not counted
    costs.record(1, 32, 50.0)  # its first counted time, in a stall: as OUTLIER times what the line says at most
    assert costs.seconds[1, 32] == pytest.approx(OUTLIER * expected) and costs.best_count(likely, 1, 32) >= 4
    costs.record(1, 32, 50.0)  # from then on, OUTLIER times its own mean at most, as every count's
    assert costs.seconds[1, 32] == pytest.approx(OUTLIER * expected * (1 + StepCosts.WEIGHT))


def test_draft_counts_not_run_for_long_are_forgotten_so_drafts_are_tried_again():
    """Draft counts whose means say no draft pays (timed in a slow spell) are never run again to correct them: after
    FORGET_STEPS steps without them they are forgotten, their cost is the prior again, and drafts are tried."""
    likely = Acceptance(0.8, 0.95)
    costs = StepCosts({(1, 0): 1.0, (1, 2): 9.0, (1, 8): 40.0})
    assert not costs.may_pay(1) and costs.best_count(likely, 1, 32) == 0
    for _ in range(FORGET_STEPS):
        costs.record(1, 0, 1.0)  # plain steps only: nothing drafts
    assert (1, 8) in costs.seconds and not costs.may_pay(1)
    for _ in range(FORGET_EVERY):
        costs.record(1, 0, 1.0)
    assert (1, 2) not in costs.seconds and (1, 8) not in costs.seconds and (1, 0) in costs.seconds
    assert costs.may_pay(1) and costs.best_count(likely, 1, 32) > 0
    costs.record(1, 4, 1.4)
    costs.record(1, 4, 1.4)  # a count run lately is kept
    for _ in range(FORGET_STEPS - FORGET_EVERY):
        costs.record(1, 0, 1.0)
    assert costs.seconds[1, 4] == pytest.approx(1.4)


def test_a_sampled_row_takes_a_draft_exactly_when_its_own_draw_is_the_draft():
    """A sampled row draws each position as it would without drafts (its seed's draws, in order) and takes the draft
    when the draw equals it: the draft is taken with probability p(draft), else the token is p's with the draft left
    out (speculative sampling's rule for one guessed token). Counted over 20,000 draws: each draft's acceptance is its
    probability, and a rejection's token follows p without it (chi-square, its 99.9% bound)."""
    logits = np.array([2.0, 1.5, 0.3, -0.5, 1.0, -2.0, 0.0, 0.7], np.float32)
    params = SamplingParams(temperature=0.9, top_k=6, seed=1)
    weights = np.exp(logits.astype(np.float64) / 0.9)
    weights[np.argsort(-logits)[6:]] = 0.0  # top_k 6
    p = weights / weights.sum()
    rng = np.random.default_rng(7)
    draws = np.array([choose(logits, params, rng, None) for _ in range(20000)])
    for draft in (0, 4, 5):  # likely, less likely, outside top_k
        taken = draws == draft
        assert abs(taken.mean() - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / 20000) + 1e-9
        rest = np.delete(p, draft) / (1 - p[draft])  # p with the draft left out
        counts = np.bincount(draws[~taken], minlength=8)
        counts = np.delete(counts, draft)
        support = rest > 0
        assert counts[~support].sum() == 0
        expected = (~taken).sum() * rest[support]
        statistic = float((((counts[support] - expected) ** 2) / expected).sum())
        assert statistic < {4: 18.47, 5: 20.52}[int(support.sum()) - 1], (draft, counts, expected)


# --- the batch: the same tokens, the K/V of a row that never drafted ---------------------------------------------


def workload(max_new: int = 24):
    """Sequences joining a 3-row batch one after another (rows leave and are taken again), prompts chunked beside
    decoding rows; greedy, one with log-probabilities (its logits read back), two sampled with seeds of their own."""
    sampled = {1: dict(temperature=0.9, top_k=20, seed=5), 3: dict(temperature=1.2, top_p=0.9, seed=6)}
    return [sequence(i, random_prompt(40 + i, 9 + 5 * i), max_new - 3 * (i % 2), return_logprobs=i == 4, **sampled.get(i, {}))
            for i in range(6)]


def run(runtime, config, seqs, speculation: bool, rows: int = 3, budget: int = 12):
    batch = SlotBatch(runtime, config, rows)
    batch.step_costs = FlatCosts()
    results = Scheduler(batch, step_token_budget=budget, speculation=speculation).drive(seqs)
    return batch, results


def test_rows_that_check_drafts_generate_what_they_generate_without(slots_graph, slots_runtime, slots_model, oracle):
    """Greedy and sampled rows alike: the tokens with drafts are the tokens without, seed for seed."""
    off, on = workload(), workload()
    run(slots_runtime, slots_model.config, off, speculation=False)
    oracle.update({tuple(seq.prompt_ids): seq.generated for seq in off})
    _, results = run(slots_runtime, slots_model.config, on, speculation=True)
    for plain, drafted in zip(off, on):
        assert drafted.generated == plain.generated, drafted.id
        assert len(drafted.generated) == drafted.max_new_tokens  # reached inside a step that checked drafts, or not
        events = [event for seq, event in results if seq is drafted]
        assert [e.token_id for e in events] == drafted.generated  # one event a token, none past the last
        assert events[-1].finish is not None and sum(e.finish is not None for e in events) == 1
        assert events[-1].finish.accepted_draft_tokens == drafted.drafts.accepted
        assert events[-1].finish.rejected_draft_tokens == drafted.drafts.drafted - drafted.drafts.accepted
    assert all(e.logprob is not None for s, e in results if s is on[4])
    drafted = sum(seq.drafts.drafted for seq in on)
    accepted = sum(seq.drafts.accepted for seq in on)
    assert accepted > drafted / 2 and drafted > accepted  # drafts were taken, and some were rolled back


def test_a_row_that_rolled_drafts_back_holds_the_kv_of_a_row_that_never_drafted(slots_graph, slots_runtime, slots_model, oracle):
    """After steps whose later drafts were refused, a row's K/V at its real positions is the eager model's over the
    tokens it kept: the refused columns are never read, and later tokens overwrite them."""
    off = [sequence(i, random_prompt(60 + i, 20 + 9 * i), 60) for i in range(2)]
    run(slots_runtime, slots_model.config, off, speculation=False, rows=2, budget=8)
    oracle.update({tuple(seq.prompt_ids): seq.generated for seq in off})
    batch = SlotBatch(slots_runtime, slots_model.config, 2)
    batch.step_costs = FlatCosts()
    scheduler = Scheduler(batch, step_token_budget=8, speculation=True)
    scheduler.most_drafts = 8  # short drafts: a row that refused some still has tokens to go, and its next step writes
    seqs = [sequence(i, random_prompt(60 + i, 20 + 9 * i), 60) for i in range(2)]
    for seq in seqs:
        scheduler.waiting.append(seq)
    kv = scheduler.kv
    while not any(kv.held[seq].overshoot for seq in seqs if seq in kv.held):  # until a row holds columns it refused
        scheduler.run_step(scheduler.plan())
        assert not any(seq.finished for seq in seqs), "no step refused a draft: the test checks nothing"
    refused = [seq for seq in seqs if kv.held[seq].overshoot]
    scheduler.run_step(scheduler.plan())  # and a step more, writing over some of them
    held = [seq for seq in seqs if seq in kv.held]
    assert any(seq in held for seq in refused)
    for seq in held:
        slots_graph.assert_row_holds_eager_kv(scheduler, seq)


def test_a_stop_sequence_inside_an_accepted_draft_ends_the_row_there(tiny_artifact, oracle):
    """The text a row sends with drafts is the text it sends without, cut at the same stop sequence, nothing after it."""
    from kvserve.contract.artifact import open_artifact
    from kvserve.runtime import DecoderRuntime

    artifact = open_artifact(tiny_artifact)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, "cpu")

    def make(stop: tuple[str, ...]):
        seq = sequence(1, random_prompt(71, 30), 40)
        seq.stops = StopSequences(stop)
        return seq

    free = make(())
    run(runtime, artifact.config, [free], speculation=False, rows=1)
    oracle[tuple(free.prompt_ids)] = free.generated
    text = ByteTokenizer().decode(free.generated)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    results = {}
    for speculation in (False, True):
        seq = make((stop,))
        _, steps = run(runtime, artifact.config, [seq], speculation, rows=1)
        results[speculation] = ([(e.token_id, e.text) for s, e in steps], steps[-1][1].finish.reason, seq)
    assert results[True][:2] == results[False][:2]
    assert results[True][2].drafts.accepted > 0
    assert stop not in "".join(text for _, text in results[True][0])


# --- structured output: its grammar's forced tokens --------------------------------------------------------------


def test_a_constrained_row_checks_its_grammars_forced_tokens_and_writes_what_it_writes_without(tiny_artifact):
    """A JSON schema's keys and punctuation are forced: a constrained row drafts them (llguidance's fast-forward
    tokens), each checked under its mask, and its output is the same valid JSON as without drafts."""
    from kvserve.contract.artifact import open_artifact
    from kvserve.contract.tokenizer import load_tokenizer
    from kvserve.runtime import DecoderRuntime

    artifact = open_artifact(tiny_artifact)
    config = artifact.config
    runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, "cpu")
    tokenizer = load_tokenizer(artifact.tokenizer_path)
    compiler = FormatCompiler(tokenizer, config.vocab_size, tuple(config.eos_token_ids), 65536)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "color": {"enum": ["red", "green"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["name", "color", "count"], "additionalProperties": False}
    outputs = {}
    for speculation in (False, True):
        seqs = []
        for i in range(2):
            seq = sequence(i, random_prompt(80 + i, 6), 60, **({"temperature": 0.8, "seed": 3} if i else {}))
            seq.constraint = compiler.compile(ResponseFormat(FormatKind.JSON_SCHEMA, json.dumps(schema)))
            seq.stop_ids = frozenset(config.eos_token_ids)
            seqs.append(seq)
        run(runtime, config, seqs, speculation, rows=2)
        outputs[speculation] = seqs
    greedy_off, greedy_on = outputs[False][0], outputs[True][0]
    assert greedy_on.generated == greedy_off.generated
    for seq in (greedy_on, outputs[True][1]):
        ids = [t for t in seq.generated if t not in config.eos_token_ids]
        assert set(json.loads(tokenizer.decode(ids))) == {"name", "color", "count"}
    assert greedy_on.drafts.accepted > 0  # forced keys and punctuation were taken from drafts


def test_drafts_never_exceed_what_a_ring_row_can_lose():
    # a refused draft's column overwrites a ring position that must fall outside the window (contract RING_SLACK); a
    # pool without ring rows has no such bound
    from kvserve.contract.config import RING_SLACK

    assert most_drafts(None) == MAX_DRAFT_TOKENS > RING_SLACK
    assert most_drafts(5 + RING_SLACK) == RING_SLACK


def test_a_row_checks_at_most_what_its_pool_allows_a_step(llama_artifact, tiny_standard_artifact, oracle, monkeypatch):
    """Drafts offered in full every step (the oracle) and every count paying (FlatCosts): a pool with ring rows checks
    at most RING_SLACK drafts a step, one without more (up to MAX_DRAFT_TOKENS, where the acceptance so far says
    they pay); the tokens are those without drafts."""
    from kvserve.contract.artifact import open_artifact
    from kvserve.contract.config import RING_SLACK
    from kvserve.runtime import DecoderRuntime

    from ...conftest import PROVIDER

    checked = []
    run_plan = SlotBatch.run

    def counted(self, plan, before_model=None):
        checked.append((self.pool.ring is not None, len(plan.drafts)))
        return run_plan(self, plan, before_model)

    monkeypatch.setattr(SlotBatch, "run", counted)
    _, _, ring_dir = llama_artifact("mistral sliding window 7 head_dim 16", attention="standard")
    for directory in (ring_dir, tiny_standard_artifact):
        artifact = open_artifact(directory)
        runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER)
        off, on = ([sequence(0, random_prompt(70, 5), 44)] for _ in range(2))
        run(runtime, artifact.config, off, speculation=False)
        oracle.update({tuple(off[0].prompt_ids): off[0].generated})
        run(runtime, artifact.config, on, speculation=True)
        assert on[0].generated == off[0].generated
    assert max(k for ring, k in checked if ring) == RING_SLACK
    assert MAX_DRAFT_TOKENS >= max(k for ring, k in checked if not ring) > RING_SLACK


# --- the server: the switch, the request's opt-out, what FinishDetails, usage and the metrics say ------------------


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "kind": {"enum": ["alpha", "beta"]}},
          "required": ["name", "kind"], "additionalProperties": False}


@pytest.mark.parametrize("speculation", [True, False], ids=["--speculation on", "--speculation off"])
def test_the_server_reports_drafts_in_finish_details_usage_and_metrics_and_a_request_may_opt_out(tiny_chat_artifact, speculation):
    """A constrained request's forced keys are drafted and checked (greedy: the same JSON either way); FinishDetails and
    the HTTP usage count them as OpenAI counts predicted outputs; `speculation: false` in a request, or the server's
    --speculation off, checks none."""
    import httpx2 as httpx  # openai 3 brings it (the httpx API under another name)

    from kvserve.v1 import generation_pb2 as pb

    from ..conftest import collect, scrape, serving, stub_of

    def grpc_request(**extra):
        return pb.GenerateRequest(text="Name it: ", max_new_tokens=60, response_format=pb.ResponseFormat(json_schema=json.dumps(SCHEMA)),
                                  **extra)

    with serving(tiny_chat_artifact, speculation=speculation, http_port=0, metrics_port=0) as running, stub_of(running) as stub:
        assert stub.GetModelInfo(pb.GetModelInfoRequest()).limits.speculation is speculation
        ids, text, finish = collect(stub, grpc_request())
        opted_ids, opted_text, opted = collect(stub, grpc_request(speculation=False))
        assert (opted_ids, opted_text) == (ids, text) and set(json.loads(text)) == {"name", "kind"}
        assert opted.accepted_draft_tokens == opted.rejected_draft_tokens == 0
        checked = finish.accepted_draft_tokens + finish.rejected_draft_tokens
        assert (checked > 0) is speculation and finish.accepted_draft_tokens <= finish.generated_tokens
        url = f"http://127.0.0.1:{running.app.http_port}/v1"
        model = httpx.get(f"{url}/models", timeout=60).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Name it: ", "max_tokens": 60, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "it", "schema": SCHEMA}}}
        url += "/completions"
        answer = httpx.post(url, json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == text
        details = answer["usage"]["completion_tokens_details"]
        http_checked = details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
        assert (http_checked > 0) is speculation  # how many: what this machine's step times made pay, as over gRPC
        assert details["accepted_prediction_tokens"] <= answer["usage"]["completion_tokens"]
        opted_out = httpx.post(url, json={**body, "speculation": False}, timeout=60).json()["usage"]["completion_tokens_details"]
        assert opted_out["accepted_prediction_tokens"] == opted_out["rejected_prediction_tokens"] == 0
        refused = httpx.post(url, json={**body, "speculation": "no"}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "speculation"
        metrics = scrape(running.app.metrics_port)
        assert metrics[("kvserve_draft_tokens_total", frozenset())] == checked + http_checked
        accepted = finish.accepted_draft_tokens + details["accepted_prediction_tokens"]
        assert metrics[("kvserve_accepted_draft_tokens_total", frozenset())] == accepted
        steps, tokens = metrics[("kvserve_step_tokens_count", frozenset())], metrics[("kvserve_step_tokens_sum", frozenset())]
        assert tokens == metrics[("kvserve_generated_tokens_total", frozenset())]
        assert (tokens > steps) is (accepted > 0)  # a step that took drafts made more tokens than it had rows


@pytest.mark.parametrize("cache_tokens", [32768, 0])
def test_a_request_asked_again_drafts_the_earlier_answer_from_the_output_cache(tiny_artifact, cache_tokens):
    """The same greedy request twice: the second drafts the first's answer from the output cache (--draft-cache-tokens)
    and takes it nearly whole, the same tokens; with the cache at 0 it drafts from its own text only."""
    from kvserve.v1 import generation_pb2 as pb

    from ..conftest import collect, serving, stub_of

    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=random_prompt(90, 12)), max_new_tokens=40, ignore_eos=True)
    with serving(tiny_artifact, max_batch_size=1, prompt_cache=False, draft_cache_tokens=cache_tokens) as running, \
            stub_of(running) as stub:
        first_ids, _, first = collect(stub, request)
        again_ids, _, again = collect(stub, request)
        opted_ids, _, opted = collect(stub, pb.GenerateRequest(**{f.name: v for f, v in request.ListFields()}, speculation=False))
    assert again_ids == first_ids == opted_ids
    assert opted.accepted_draft_tokens == opted.rejected_draft_tokens == 0
    # 40 tokens: the first from the prompt's step, then a plain step or two while the step costs are measured, then
    # drafts; a random model's own text repeats little, the earlier answer all of it
    assert (again.accepted_draft_tokens >= 20) is bool(cache_tokens), (first.accepted_draft_tokens, again.accepted_draft_tokens)
