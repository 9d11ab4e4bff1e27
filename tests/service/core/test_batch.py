"""The slots batch on its own (no gRPC, service/core/batch.py): one model call a step over its rows, the K/V each row holds,
greedy rows reading tokens alone, cancellation, prompts chunked into a hole. Each test runs on every slots graph
(conftest.slots_graph)."""


from kvserve.service.core.batch import SlotBatch
from kvserve.service.process.gate import _greedy_sequence
from kvserve.service.core.scheduler import Scheduler

from ..conftest import hole_between_rows, sequence
from ..conftest import random_prompt as prompt


def test_a_rows_kv_equals_the_eager_models_at_its_real_positions(slots_graph, slots_runtime, slots_model):
    batch = SlotBatch(slots_runtime, slots_model.config, 3)
    scheduler = Scheduler(batch, step_token_budget=6)
    seqs = [_greedy_sequence(i, prompt(10 + i, n), 40) for i, n in enumerate((3, 17, 40))]
    for seq in seqs:
        scheduler.waiting.append(seq)
    for _ in range(16):  # every prompt in (chunks for the two longer ones), then some decode steps
        scheduler.run_step(scheduler.plan())
    for seq in seqs:
        slots_graph.assert_row_holds_eager_kv(scheduler, seq)


def test_greedy_rows_read_back_tokens_alone_and_a_row_that_samples_reads_the_logits(slots_graph, slots_runtime, slots_model):
    """A step whose rows all choose greedily takes the graph's greedy_tokens and leaves the logits where the step ran;
    one row that samples or reports log-probabilities makes the steps it shares read the logits, for every row, and
    every row gets what it would get alone."""
    slots_runtime.traffic.logits_bytes = 0
    batch = SlotBatch(slots_runtime, slots_model.config, 4)
    greedy = [_greedy_sequence(i, prompt(500 + i, 1 + (9 * i) % 40), 1 + (5 * i) % 13) for i in range(10)]
    Scheduler(batch, step_token_budget=10).drive(greedy)
    assert slots_runtime.traffic.logits_bytes == 0
    for seq in greedy[::3]:
        assert seq.generated == slots_graph.alone(seq)

    def mixed():
        return [sequence(20, prompt(20, 7), 12, temperature=0.8, top_k=20, seed=5),
                sequence(21, prompt(21, 9), 12, return_logprobs=True)] + [_greedy_sequence(22 + i, prompt(22 + i, 5), 12) for i in range(2)]

    together = mixed()
    results = Scheduler(batch, step_token_budget=10).drive(together)
    assert slots_runtime.traffic.logits_bytes > 0
    assert all(event.logprob is not None for seq, event in results if seq is together[1])
    for seq, alone in zip(together, mixed()):
        Scheduler(SlotBatch(slots_runtime, slots_model.config, 1), step_token_budget=10).drive([alone])
        assert seq.generated == alone.generated, seq.id
    assert together[1].generated == slots_graph.alone(together[1])  # greedy with log-probabilities: its logits' argmax


def test_a_cancelled_sequence_frees_its_row_within_one_step(slots_runtime, slots_model):
    batch = SlotBatch(slots_runtime, slots_model.config, 3)
    scheduler = Scheduler(batch, step_token_budget=8)
    seqs = [_greedy_sequence(i, prompt(i, 6), 50) for i in range(3)]
    for seq in seqs:
        scheduler.waiting.append(seq)
    for _ in range(4):
        scheduler.run_step(scheduler.plan())
    assert len(scheduler.kv.rows) == 3
    seqs[0].cancelled = True
    scheduler.run_step(scheduler.plan())
    assert seqs[0] not in scheduler.kv.rows and seqs[0] not in scheduler.kv.held and len(scheduler.kv.rows) == 2
    # on the CPU the last row moved into the freed one (rows stay dense); under CUDA the freed row stays a hole
    assert sorted(scheduler.kv.held[s].index for s in scheduler.kv.rows) == ([0, 1] if scheduler.kv.compact else [1, 2])


def test_a_prompt_chunked_into_a_hole_between_decoding_rows_generates_what_it_would_alone(slots_graph, slots_runtime, slots_model):
    """As under CUDA, where a freed row stays a hole until a join fills it: the joining prompt's chunks run in a row
    below decoding ones (the fused graph's decode run then covers the chunk's row with a scratch token)."""
    batch = SlotBatch(slots_runtime, slots_model.config, 3)
    seqs = [_greedy_sequence(i, prompt(200 + i, 5), 40) for i in range(3)]
    scheduler = hole_between_rows(batch, seqs, leaving=1, steps=6, budget=7)
    assert scheduler.kv.held[seqs[2]].index == 2  # a hole between two decoding rows
    joining = _greedy_sequence(9, prompt(209, 30), 12)
    scheduler.waiting.append(joining)
    chunked = 0
    while not joining.generated:
        plan = scheduler.plan()
        chunked += plan.chunk is joining and len(plan.decode) == 2
        scheduler.run_step(plan)
    assert scheduler.kv.held[joining].index == 1 and chunked >= 3  # its prompt went in chunks beside both decoding rows
    for seq in (seqs[0], seqs[2], joining):
        while not seq.finished:
            scheduler.run_step(scheduler.plan())
        assert seq.generated == slots_graph.alone(seq)


