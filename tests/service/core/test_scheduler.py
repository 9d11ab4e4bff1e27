"""The scheduler (service/core/scheduler.py): what each step runs (plan: decode never waits for a prefill, chunks within the
token budget, one join at a time), a failed step failing each of its sequences once, and the hand-off to the event loop.
The planning tests run on a batch with no model behind it; the rest on every slots graph (conftest.slots_graph)."""

import asyncio
from dataclasses import dataclass, field, replace

import pytest

from kvserve.contract.artifact import open_artifact
from kvserve.contract.config import DecoderConfig, RopeScaling
from kvserve.model.generate import generate
from kvserve.runtime import DecoderRuntime
from kvserve.service.core.batch import SlotBatch
from kvserve.service.core.drafts import FORGET_STEPS, MIN_CHUNK_TOKENS, StepCosts
from kvserve.service.process.gate import _greedy_sequence
from kvserve.service.core.kv_rows import HeldRow
from kvserve.service.core import scheduler as scheduler_module
from kvserve.service.core.scheduler import MAX_PROMPT_GROUP, Scheduler

from ...conftest import PROVIDER
from ..conftest import random_prompt as prompt


@dataclass
class PlannedRows:
    """What plan() asks of the rows, with no pool or model: the sequences in rows, free rows, cached prefix length; a
    join takes a row past the cached prefix, a release lets it go."""

    rows: list = field(default_factory=list)
    max_rows: int = 4
    cached_prefix: int = 0
    fitting: set = field(default_factory=lambda: {"all"})  # ids of the sequences the K/V budget has room for now
    held: dict = field(default_factory=dict)  # each sequence in rows: its HeldRow

    def free_rows(self) -> int:
        return self.max_rows - len(self.rows)

    def fits(self, seq) -> bool:
        return "all" in self.fitting or seq.id in self.fitting

    @property
    def slots(self) -> list:
        return list(self.rows)

    def join(self, seq) -> None:
        self.held[seq] = HeldRow(len(self.rows), self.cached_prefix)
        seq.reused_prompt_tokens = self.cached_prefix
        self.rows.append(seq)

    def release(self, leaving) -> None:
        self.rows = [s for s in self.rows if s not in leaving]
        self.held = {s: hold for s, hold in self.held.items() if s not in leaving}

    def refill(self, seq) -> None:  # as KvRows.refill, without the prompt cache
        seq.long_rope, seq.refill_ids, self.held[seq].cached_tokens = True, seq.prompt_ids + seq.generated, 0


@dataclass
class PlannedBatch:
    config: DecoderConfig = DecoderConfig()
    step_costs: StepCosts = field(default_factory=StepCosts)


def planner(budget: int, rows: list | None = None, max_rows: int = 4, cached_prefix: int = 0, config: DecoderConfig = DecoderConfig(),
            cached: dict | None = None) -> Scheduler:
    """rows: sequences in rows, each holding the K/V of every token it has but the last (a decoding row's), or what
    cached says ({sequence: tokens})."""
    scheduler = Scheduler.__new__(Scheduler)  # plan() reads the queue, the budget and the rows: no loop, no thread
    rows = rows or []
    written = {seq: (cached or {}).get(seq, seq.total_tokens - 1 if seq.generated else 0) for seq in rows}
    held = {seq: HeldRow(index, written[seq]) for index, seq in enumerate(rows)}
    scheduler.kv = PlannedRows(rows, max_rows, cached_prefix, held=held)
    scheduler.batch, scheduler.step_token_budget = PlannedBatch(config), budget
    scheduler.speculation = False  # drafts are planned by test_drafts.py
    scheduler.step_time_bound = 0  # chunks cut to the measured step times: test_a_chunk_is_cut_to_keep_its_step_within_the_bound
    scheduler.budget_counts_rows = True  # the CPU's rule: test_on_cuda_decoding_rows_take_none_of_the_budget
    scheduler.prompt_group_rows = 1  # a prompt a step: test_fresh_prompts_join_together_...
    from collections import deque

    scheduler.waiting = deque()
    return scheduler


def decoding(seq_id: int):
    seq = _greedy_sequence(seq_id, [1, 2, 3], 10)
    seq.generated = [4]  # its prompt's 3 tokens in its row
    return seq


@pytest.mark.parametrize("decoders, prompt_len, budget, chunk", [
    (2, 70, 8, 6),  # two rows decode: the chunk gets the rest of the budget
    (2, 8, 8, 8),  # a tail of at most a quarter of the budget rides along
    (2, 9, 8, 6),  # ... and a longer one does not
    (0, 70, 8, 70),  # nobody decodes: the whole prompt in one step
    (2, 70, 0, 70),  # budget 0: no limit
    (9, 70, 8, 1),  # more rows than the budget: the chunk still advances
])
def test_a_chunk_takes_what_the_decoding_rows_leave_of_the_budget(decoders, prompt_len, budget, chunk):
    scheduler = planner(budget, [decoding(i) for i in range(decoders)], max_rows=16)
    joining = _greedy_sequence(99, list(range(prompt_len)), 4)
    scheduler.waiting.append(joining)
    plan = scheduler.plan()
    assert plan.joining == [joining] and plan.chunk is joining and plan.chunk_tokens == chunk and len(plan.decode) == decoders


@pytest.mark.parametrize("decoders, chunk", [(1, 32), (3, 32), (40, 32), (200, 32)])
def test_on_cuda_decoding_rows_take_none_of_the_budget(decoders, chunk):
    """On CUDA a step reads the weights once whatever its rows: a prompt gets the whole budget beside any number of
    decoding rows (on the CPU it got one token a step beside 32 or more, and the batch stayed near 32 rows)."""
    scheduler = planner(32, [decoding(i) for i in range(decoders)], max_rows=256)
    scheduler.budget_counts_rows = False
    scheduler.waiting.append(_greedy_sequence(99, list(range(70)), 4))
    plan = scheduler.plan()
    assert plan.chunk_tokens == chunk and len(plan.decode) == decoders
    assert scheduler.chunk_allowance(decoders) == (32, 8)


def test_a_scheduler_counts_decoding_rows_against_the_budget_on_the_cpu_and_not_on_cuda(tiny_artifact, monkeypatch):
    artifact = open_artifact(tiny_artifact)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, "cpu")
    batch = SlotBatch(runtime, artifact.config, 4)
    assert Scheduler(batch, step_token_budget=32).chunk_allowance(20) == (12, 8)
    monkeypatch.setattr(runtime, "device", "cuda")  # what the scheduler reads of where the steps run
    assert Scheduler(batch, step_token_budget=32).chunk_allowance(20) == (32, 8)


@pytest.mark.parametrize("added, chunk", [
    (None, 30),  # no chunk measured yet: the budget's
    (0.01, 30),  # a chunk token adds 1% of a plain step: 30 of them fit in 1.3 steps, the budget's chunk too
    (0.02, 15),  # 2%: the chunk is cut to the 15 that keep the step within 1.3 plain ones
    (1.0, 4),  # a chunk token costs a whole step: the chunk still advances by MIN_CHUNK_TOKENS
])
def test_a_chunk_is_cut_to_keep_its_step_within_the_bound(added, chunk):
    """--step-time-bound 130: a step with a prompt chunk beside decoding rows takes at most 1.3 times a decode-only step
    of as many rows, by the step times measured (StepCosts)."""
    scheduler = planner(32, [decoding(i) for i in range(2)], max_rows=16)
    scheduler.step_time_bound = 1.3
    costs = scheduler.batch.step_costs
    costs.seconds[2, 0] = 1.0
    if added is not None:  # a chunk's cost its tokens', no fixed part (ChunkCosts: a short chunk and a long one timed)
        costs.record_chunk(2, MIN_CHUNK_TOKENS, 1.0 + MIN_CHUNK_TOKENS * added)
        costs.record_chunk(2, 10, 1.0 + 10 * added)
    scheduler.waiting.append(_greedy_sequence(99, list(range(200)), 4))
    assert scheduler.plan().chunk_tokens == chunk


def test_a_chunk_measured_free_once_is_bounded_again_by_the_chunks_after_it():
    """One chunk step timed below its plain step's mean (noise) says chunk tokens cost nothing, and the bound gives the
    budget's chunk; the chunks after it must be able to say otherwise (a free estimate never moved before: OUTLIER
    times zero capped every later time at zero, so the bound stayed off at that row count for the server's life)."""
    costs = StepCosts({(8, 0): 1.0})
    costs.record_chunk(8, 10, 0.9)
    assert costs.chunk_cut(8, 1.3, 30) is None  # measured free: the budget's chunk
    costs.record_chunk(8, 10, 1.5)  # 0.05 a token
    assert costs.chunk_seconds[8] == pytest.approx(StepCosts.WEIGHT * 0.05)
    for _ in range(40):
        costs.record_chunk(8, 10, 1.5)
        costs.record_chunk(8, MIN_CHUNK_TOKENS, 1.0 + MIN_CHUNK_TOKENS * 0.05)
    assert costs.chunk_cut(8, 1.3, 30) == 6  # 0.3 / 0.05


@pytest.mark.parametrize("small, large, cut", [
    ((4, 4.0), (20, 20.0), MIN_CHUNK_TOKENS),  # the CPU's: a token costs a whole step, no fixed part: 4 tokens stall least
    ((4, 1.4), (20, 3.0), MIN_CHUNK_TOKENS),  # 1.0 any chunk adds, then 0.1 a token: 4 tokens add 1.4 of 30's 4.0
    ((4, 3.9), (32, 3.95), None),  # CUDA's: ~3.9 any chunk adds (its graphs beside the captured decode step)
], ids=["per token", "the fewest tokens halve the stall", "a fixed part dominates"])
def test_where_no_chunk_keeps_the_bound_it_is_cut_only_if_the_fewest_tokens_halve_what_it_adds(small, large, cut):
    """ChunkCosts splits what a chunk adds into a fixed part and a part a token (a line through chunks of at most
    SMALL_CHUNK_TOKENS and longer ones); where not even MIN_CHUNK_TOKENS keep a step within the bound, a chunk is cut to
    them only where that makes the step much shorter."""
    costs = StepCosts({(16, 0): 1.0})
    for tokens, seconds in (small, large) * 10:
        costs.record_chunk(16, tokens, 1.0 + seconds)
    assert costs.chunk_cut(16, 1.3, 30) == cut


def test_a_fixed_part_stops_the_cuts_that_learnt_it_and_is_measured_again_after_forget_steps():
    """On CUDA (a step with a chunk ~4.75 ms of any size beside a 0.9 ms decode step, bench/results/h200.md) the first
    chunks' cost looks proportional: one is cut to the fewest tokens, which shows the fixed part, and the chunks after it
    keep the budget's size (before, every chunk was cut to 4 tokens: a 32-token prompt took 8 such steps). A fixed part
    not measured again in FORGET_STEPS chunk steps is forgotten and a chunk is cut once more to measure it."""
    costs = StepCosts({(16, 0): 0.9e-3})
    costs.record_chunk(16, 32, 0.9e-3 + 3.9e-3)
    assert costs.chunk_cut(16, 1.3, 32) == MIN_CHUNK_TOKENS  # proportional so far: 0.27 ms of slack fits < 4 tokens
    costs.record_chunk(16, MIN_CHUNK_TOKENS, 0.9e-3 + 3.85e-3)
    assert costs.chunk_cut(16, 1.3, 32) is None
    for _ in range(FORGET_STEPS):
        costs.record_chunk(16, 32, 0.9e-3 + 3.9e-3)
        assert costs.chunk_cut(16, 1.3, 32) is None
    costs.record_chunk(16, 32, 0.9e-3 + 3.9e-3)
    assert costs.chunks.line() == (0.0, pytest.approx(3.9e-3 / 32))  # the short chunks forgotten: long ones alone
    assert costs.chunk_cut(16, 1.3, 32) == MIN_CHUNK_TOKENS


def test_a_cut_waits_for_the_fixed_part_of_a_chunks_cost_and_none_is_made_where_that_part_alone_passes_the_bound():
    """Long chunks alone cannot tell a fixed part from tokens' cost: a GPU's 180-token prompt padded to 256 adds 5.2 ms
    beside a 0.87 ms step, 0.02 ms a token read as proportional, so 12 tokens would seem to keep the bound, and the
    chunks cut to 12 (long chunks again) would never show otherwise (bench/scheduler_emulation.py: 64 streams of
    180-token prompts then prefilled 17-32 tokens a step). Until a short chunk has run, a chunk over the bound is cut to
    MIN_CHUNK_TOKENS; once it has, a fixed part that alone passes the bound leaves the chunk uncut."""
    plain = 0.87e-3
    costs = StepCosts({(16, 0): plain})
    costs.record_chunk(16, 256, plain + 5.2e-3)
    assert int(0.3 * plain / costs.chunk_seconds[16]) == 12
    assert costs.chunk_cut(16, 1.3, 192) == MIN_CHUNK_TOKENS
    costs.record_chunk(16, MIN_CHUNK_TOKENS, plain + 4.75e-3)
    assert costs.chunk_cut(16, 1.3, 192) is None
    cpu = StepCosts({(16, 0): 20e-3})  # the CPU's: a token costs its compute, no fixed part; 12 tokens keep the bound
    for tokens in (32, MIN_CHUNK_TOKENS):
        cpu.record_chunk(16, tokens, 20e-3 + tokens * 0.5e-3)
    assert cpu.chunk_cut(16, 1.3, 32) == 12


def test_a_short_rest_of_a_prompt_is_not_cut_where_cutting_halves_only_a_budgets_chunk():
    """A chunk is cut to MIN_CHUNK_TOKENS where that halves what it adds, weighed against the chunk it would be: on a
    GPU's costs (3.2 ms any chunk adds, 10 us a token) a 512-token budget's chunk adds 8.3 ms and 4 tokens 3.24, but a
    180-token prompt's whole rest adds 5.0: cut, it would pay the 3.2 ms at 45 steps (bench/scheduler_emulation.py, 64
    streams of 180-token prompts prefilled two together at a budget of 512: ~6,900 tokens/s with such cuts, ~8,700
    without)."""
    plain = 0.87e-3
    scheduler = planner(512, [decoding(i) for i in range(16)], max_rows=32)
    scheduler.step_time_bound, scheduler.budget_counts_rows = 1.3, False
    costs = scheduler.batch.step_costs
    costs.seconds[16, 0] = plain
    for tokens in (MIN_CHUNK_TOKENS, 300):
        costs.record_chunk(16, tokens, plain + 3.2e-3 + tokens * 1e-5)
    assert costs.chunk_cut(16, 1.3, 512) == MIN_CHUNK_TOKENS and costs.chunk_cut(16, 1.3, 180) is None
    scheduler.waiting.append(_greedy_sequence(99, list(range(180)), 4))
    assert scheduler.plan().chunk_tokens == 180


def test_a_cut_never_takes_more_than_the_budget_gives():
    """Where the decoding rows leave the chunk fewer tokens than MIN_CHUNK_TOKENS, the bound does not raise it."""
    costs = StepCosts({(30, 0): 1.0})
    costs.record_chunk(30, 20, 21.0)  # a token costs a whole step: none keeps the bound
    assert costs.chunk_cut(30, 1.3, 3) is None
    assert costs.chunk_cut(30, 1.3, 2 * MIN_CHUNK_TOKENS) == MIN_CHUNK_TOKENS


def test_a_joiner_starts_past_its_cached_prefix_and_one_joins_at_a_time_while_rows_are_free():
    scheduler = planner(32, cached_prefix=16)
    first, second = (_greedy_sequence(i, list(range(40)), 4) for i in (1, 2))
    scheduler.waiting.extend([first, second])
    plan = scheduler.plan()
    assert plan.joining == [first] and plan.chunk_tokens == 40 - 16 and list(scheduler.waiting) == [second]
    full = planner(32, [decoding(i) for i in range(4)], max_rows=4)
    full.waiting.append(second)
    plan = full.plan()
    assert not plan.joining and plan.chunk is None and len(plan.decode) == 4 and list(full.waiting) == [second]  # no free row


def test_a_prefilling_row_keeps_the_chunk_and_a_cancelled_row_is_planned_nowhere():
    prefilling = _greedy_sequence(5, list(range(30)), 4)
    cancelled = decoding(6)
    cancelled.cancelled = True
    scheduler = planner(8, [decoding(1), prefilling, cancelled], cached={prefilling: 10})  # 20 prompt tokens left, none generated
    waiting = _greedy_sequence(7, [1, 2], 4)
    scheduler.waiting.append(waiting)
    plan = scheduler.plan()
    assert plan.chunk is prefilling and plan.chunk_tokens == 8 - 1 and not plan.joining  # no join while a prompt is being prefilled
    assert [s.id for s in plan.decode] == [1]


def test_a_longrope_row_about_to_pass_the_original_context_is_prefilled_again_whole_and_a_long_prompt_starts_long():
    """Phi-3's longrope: a row whose next token is the 17th of a 16-position original context (16 prompt tokens in the
    cache and one generated) becomes the chunk, every token so far, turned long; a row one short (its next token the
    16th) decodes on; a waiting prompt past the original context joins turned long, one within it short."""
    config = DecoderConfig(model_type="phi3", n_ctx=64, rope_scaling=RopeScaling("longrope", 4.0, 16, short_factor=(1.0,) * 4,
                                                                                   long_factor=(2.0,) * 4), d_model=32, n_head=4)
    crossing, within = _greedy_sequence(1, list(range(16)), 10), _greedy_sequence(2, list(range(15)), 10)
    for seq in (crossing, within):
        seq.generated = [99]  # its prompt in its row
    plan = planner(8, [crossing, within], config=config).plan()
    assert plan.chunk is crossing and crossing.long_rope and crossing.prefill_ids == list(range(16)) + [99]
    assert plan.chunk_tokens == 8 - 1 and [s.id for s in plan.decode] == [2] and not within.long_rope
    for length, long in ((17, True), (16, False)):
        scheduler = planner(8, config=config)
        scheduler.waiting.append(_greedy_sequence(3, list(range(length)), 4))
        assert scheduler.plan().joining[0].long_rope == long
    # a Llama with longrope keeps what it cached (transformers recomputes only Phi-3's): the row decodes on, long
    crossing = _greedy_sequence(4, list(range(16)), 10)
    crossing.generated = [99]  # 16 tokens in its row
    plan = planner(8, [crossing], config=replace(config, model_type="llama")).plan()
    assert plan.decode == [crossing] and plan.chunk is None and crossing.long_rope and crossing.long_rope_from == 16


def test_every_row_decodes_every_step_while_a_long_prompt_is_prefilled_in_chunks(slots_graph, slots_runtime, slots_model):
    scheduler = Scheduler(SlotBatch(slots_runtime, slots_model.config, 4), step_token_budget=8)
    running = [_greedy_sequence(i, prompt(i, 5), 60) for i in range(2)]
    scheduler.drive([])  # nothing to do
    for seq in running:
        scheduler.waiting.append(seq)
    while any(not s.generated for s in running):
        scheduler.run_step(scheduler.plan())
    long = _greedy_sequence(9, prompt(9, 70), 5)
    scheduler.waiting.append(long)
    chunks = []
    while not long.generated:
        before = [len(s.generated) for s in running]
        plan = scheduler.plan()
        chunks.append(plan.chunk_tokens)
        scheduler.run_step(plan)
        assert [len(s.generated) for s in running] == [n + 1 for n in before]  # nobody waits for the prefill
    # the budget: 2 decode tokens + a 6-token chunk; on CUDA the decoding rows take none of it
    assert sum(chunks) == 70 and max(chunks) == (8 if slots_runtime.device == "cuda" else 8 - len(running))
    for seq in running + [long]:
        while not seq.finished:
            scheduler.run_step(scheduler.plan())
    for seq in running + [long]:
        assert seq.generated == slots_graph.alone(seq)


def test_a_prompt_arriving_at_an_idle_batch_is_prefilled_in_one_step(slots_runtime, slots_model):
    scheduler = Scheduler(SlotBatch(slots_runtime, slots_model.config, 2), step_token_budget=8)
    scheduler.waiting.append(_greedy_sequence(1, prompt(1, 50), 3))
    plan = scheduler.plan()
    assert plan.chunk_tokens == 50 and not plan.decode
    unlimited = Scheduler(SlotBatch(slots_runtime, slots_model.config, 2), step_token_budget=0)
    unlimited.drive([_greedy_sequence(2, prompt(2, 4), 30)])
    assert not unlimited.kv.rows


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
            rows_before_failure.append(len(scheduler.kv.rows))
            results = real(*args)
            if seqs[2] not in scheduler.kv.held:
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
        return failures, seqs, scheduler

    failures, seqs, scheduler = asyncio.run(scenario())
    assert failures == {0: 1, 1: 1, 2: 1}
    assert all(s.finished for s in seqs) and not scheduler.kv.rows
    monkeypatch.setattr(batch, inner, real)
    after = _greedy_sequence(7, prompt(7, 5), 6)  # the batch serves again
    Scheduler(batch, step_token_budget=32).drive([after])
    assert after.generated == generate(tiny_model, [after.prompt_ids], 6).tokens[0].tolist()


@pytest.mark.parametrize("streamed, bound_ns, separate", [
    (True, 10**12, True),  # a streamed token reaches the loop before the next model call
    (False, 10**12, False),  # an answer taken whole: the loop has its tokens with its last
    (False, 0, True),  # ... or within UNSTREAMED_HANDOFF_NS
])
def test_steps_whose_tokens_nobody_streams_reach_the_loop_with_the_last_or_within_the_bound(tiny_artifact, tiny_model, monkeypatch,
                                                                                            streamed, bound_ns, separate):
    artifact = open_artifact(tiny_artifact)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER)
    monkeypatch.setattr(scheduler_module, "UNSTREAMED_HANDOFF_NS", bound_ns)
    deliveries = []
    real = Scheduler._deliver

    def deliver(self, steps):
        deliveries.append([event.token_id for done in steps for _, event in done.results])
        real(self, steps)

    monkeypatch.setattr(Scheduler, "_deliver", deliver)

    async def scenario():
        scheduler = Scheduler(SlotBatch(runtime, artifact.config, 2), step_token_budget=32)
        seq = _greedy_sequence(1, prompt(1, 4), 12)
        seq.streamed, seq.events = streamed, asyncio.Queue()
        scheduler.submit(seq)
        await scheduler._step()  # every step of the sequence, on the step thread
        scheduler.close()
        received = []
        while not seq.events.empty():
            received.append(seq.events.get_nowait())
        return seq, scheduler, received

    seq, scheduler, received = asyncio.run(scenario())
    assert [event.token_id for event in received] == seq.generated == generate(tiny_model, [seq.prompt_ids], 12).tokens[0].tolist()
    assert received[-1].finish is not None and sum(deliveries, []) == seq.generated
    assert len(deliveries) == (12 if separate else 1)


def test_the_handoff_never_leaves_a_flush_waiting_when_it_is_closed_meanwhile():
    """The step thread flushes the hand-off (scheduler.Handoff) while the engine may be closing it from another
    thread. Here the close is started at the worst moment, just as the flush hands in its marker: the flush must still
    return (a marker handed in after the thread's stop once waited forever, and the interpreter hung at exit waiting
    for the step thread), and what was handed over before reaches the loop."""
    import threading

    from kvserve.service.core.scheduler import Handoff

    loop = asyncio.new_event_loop()
    delivered = []
    handoff = Handoff(delivered.append)
    real_queue = handoff._queue
    flush_began = threading.Event()  # the thread passes nothing on before: the flush has a step to wait for

    class CloseAsFlushHandsIn:
        def put(self, item):
            if isinstance(item, threading.Event):
                flush_began.set()
                closing = threading.Thread(target=handoff.close)
                closing.start()
                closing.join(0.5)  # a close that can run now, runs to its end first
            real_queue.put(item)

        def get(self):
            flush_began.wait()
            return real_queue.get()

    handoff._queue = CloseAsFlushHandsIn()
    handoff.hand_over(loop, ["step"])
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


def test_a_flush_with_every_step_passed_on_returns_without_a_round_trip_through_the_handoff_thread():
    """What the step thread handed over has reached the loop's queue once the hand-off thread passed it on: a flush then
    returns at once (no marker through the thread, whose round trip costs two thread wake-ups at every request's end),
    and one with a step still in the thread waits for it."""
    import threading
    import time

    from kvserve.service.core.scheduler import Handoff

    loop = asyncio.new_event_loop()
    delivered, markers = [], []
    handoff = Handoff(delivered.append)
    real_queue = handoff._queue
    hold, marker_sent = threading.Event(), threading.Event()

    class Counting:
        def put(self, item):
            if isinstance(item, threading.Event):
                markers.append(item)
                marker_sent.set()
            real_queue.put(item)

        def get(self):
            hold.wait()
            return real_queue.get()

    handoff._queue = Counting()
    try:
        handoff.hand_over(loop, ["first"])
        flushing = threading.Thread(target=handoff.flush, daemon=True)
        flushing.start()
        assert marker_sent.wait(60), "the flush sent no marker through the thread"
        assert flushing.is_alive() and len(markers) == 1  # the thread holds "first": the flush waits for it
        hold.set()
        flushing.join(60)
        assert not flushing.is_alive()
        handoff.hand_over(loop, ["second"])
        deadline = time.monotonic() + 60  # a guard against a hang, not a wait: the loop ends once the thread passed it on
        while handoff._passed != 2:
            assert time.monotonic() < deadline, "the hand-off thread never passed the second list on"
            time.sleep(0.001)
        handoff.flush()
        assert len(markers) == 1  # nothing in flight: no marker through the thread
        loop.run_until_complete(asyncio.sleep(0))
        assert delivered == [["first"], ["second"]]
    finally:
        handoff.close()
        loop.close()


def test_the_first_in_line_waits_for_kv_memory_and_none_overtakes_it():
    scheduler = planner(8)
    first, second = _greedy_sequence(1, [1, 2, 3], 10), _greedy_sequence(2, [1, 2], 1)
    scheduler.waiting.extend([first, second])
    scheduler.kv.fitting = {2}  # a free row, but memory only for the second
    assert scheduler.plan().joining == [] and list(scheduler.waiting) == [first, second]
    scheduler.kv.fitting = {1, 2}  # memory freed
    assert scheduler.plan().joining == [first]


@pytest.fixture(scope="module")
def split_runtime(tiny_llama_fused_artifacts):
    """The tiny-llama float16 artifact with its steps split between the chunk graph and the decode graph, as CUDA runs
    them (on the tests' provider)."""
    artifact = open_artifact(tiny_llama_fused_artifacts("float16"))
    return DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER, chunk_graph=True), artifact.config


def test_fresh_prompts_join_together_where_steps_split_within_the_allowance_and_stop_at_the_first_that_would_not(split_runtime,
                                                                                                                   tiny_artifact):
    """Scheduler.prompt_group: where the runtime splits its steps, the queue's head joins together, in order, into
    consecutive rows, while rows x the longest's length stay within the chunk allowance; a prompt the prompt cache holds
    part of, or sharing an index block with one before it in the group, or past the K/V budget, or beyond the rows
    free, ends the group there; fewer than two is no group (one joins as before), and budget 0 groups nothing."""
    runtime, config = split_runtime
    unsplit = open_artifact(tiny_artifact)
    cpu = DecoderRuntime(unsplit.model_path, unsplit.config.n_layer, unsplit.dtype, "cpu")
    assert Scheduler(SlotBatch(cpu, unsplit.config, 4), 64).prompt_group_rows == 1  # the step graph: a prompt a step

    def queued(*prompts, budget=64, rows=8, kv_budget=None, new_tokens=4):
        batch = SlotBatch(runtime, config, rows, fixed_decode=True)
        scheduler = Scheduler(batch, budget, kv_budget=kv_budget)
        assert scheduler.prompt_group_rows == MAX_PROMPT_GROUP
        seqs = [_greedy_sequence(i, p, new_tokens) for i, p in enumerate(prompts)]
        scheduler.waiting.extend(seqs)
        return scheduler, seqs

    scheduler, seqs = queued(prompt(1, 10), prompt(2, 12), prompt(3, 14), prompt(4, 40))
    plan = scheduler.plan()  # 3 x 14 <= 64 < 4 x 40
    assert plan.prompts == plan.joining == seqs[:3] and plan.chunk is None and not plan.decode
    assert [plan.held[s].index for s in seqs[:3]] == [0, 1, 2] and list(scheduler.waiting) == seqs[3:]
    scheduler.run_step(plan)
    assert all(scheduler.kv.held[s].cached_tokens == len(s.prompt_ids) and len(s.generated) == 1 for s in seqs[:3])
    plan = scheduler.plan()  # one left: it joins alone beside the three decoding rows
    assert plan.joining == [seqs[3]] and plan.chunk is seqs[3] and not plan.prompts and len(plan.decode) == 3

    shared = prompt(5, 20)
    scheduler, seqs = queued(prompt(6, 8), shared, shared[:17] + prompt(7, 3), prompt(8, 5))
    assert scheduler.plan().prompts == seqs[:2]  # the third shares a block with the second: it waits for its row
    scheduler, seqs = queued(prompt(9, 8), prompt(10, 8), prompt(11, 8), budget=0)
    plan = scheduler.plan()
    assert not plan.prompts and plan.joining == seqs[:1]  # no budget, no bound on a group: one prompt as before
    scheduler, seqs = queued(*(prompt(20 + i, 6) for i in range(5)), rows=3)
    assert scheduler.plan().prompts == seqs[:3]  # three rows free
    scheduler, seqs = queued(*(prompt(70 + i, 16) for i in range(6)))
    assert scheduler.plan().prompts == seqs[:4]  # 4 x 16 = 64, the whole allowance

    scheduler, seqs = queued(prompt(12, 20), prompt(13, 20), budget=128)
    scheduler.drive([])  # the two queued run to their end: their rows keep their prompts for the prompt cache
    scheduler.waiting.extend(later := [_greedy_sequence(30 + i, p, 4) for i, p in enumerate(
        [prompt(14, 9), prompt(15, 9), seqs[1].prompt_ids + [3, 4], prompt(16, 9)])])
    assert scheduler.plan().prompts == later[:2]  # the third finds the second's prompt in the cache (4 x 22 <= 128): it waits

    token_bytes = scheduler.token_bytes
    scheduler, seqs = queued(*(prompt(40 + i, 6) for i in range(4)), kv_budget=3 * 10 * token_bytes)
    assert scheduler.plan().prompts == seqs[:3]  # each may hold 6 + 4 tokens: the budget holds three
    scheduler, seqs = queued(prompt(50, 3), prompt(51, 9), kv_budget=100 * token_bytes, new_tokens=2)
    assert not scheduler.plan().prompts  # under a budget a row's padding stays within what it may write: 3 + 2 < 9


def test_a_prompt_group_beside_decoding_rows_takes_what_a_chunk_would_be_cut_to(split_runtime, monkeypatch):
    runtime, config = split_runtime
    batch = SlotBatch(runtime, config, 8, fixed_decode=True)
    scheduler = Scheduler(batch, 64, step_time_bound=130)
    first = _greedy_sequence(0, prompt(60, 5), 20)
    scheduler.waiting.append(first)
    scheduler.run_step(scheduler.plan())  # its prompt: it decodes from now on
    seqs = [_greedy_sequence(1 + i, prompt(61 + i, 10), 4) for i in range(5)]
    scheduler.waiting.extend(seqs)
    monkeypatch.setattr(batch.step_costs, "chunk_cut", lambda rows, bound, allowance: 25)
    plan = scheduler.plan()
    assert plan.decode == [first] and plan.prompts == seqs[:2]  # 2 x 10 <= 25 < 3 x 10
    scheduler.run_step(plan)
    assert [len(s.generated) for s in [first, *seqs[:2]]] == [2, 1, 1]
    assert runtime.fixed_shapes(batch.pool) == [(1, 0)]  # the decoding row's step: its own shape, not the joiners' rows too
