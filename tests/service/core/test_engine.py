"""The engine in process (service/core/engine.py): admission and the queue's limit, refusal while draining, n completions fanned
out and merged, and what it reports of its load; no gRPC or HTTP in front of it."""

import asyncio
import time

import pytest

from kvserve.contract.artifact import open_artifact
from kvserve.contract.tokenizer import ByteTokenizer
from kvserve.runtime import DecoderRuntime
from kvserve.service.core.engine import Engine
from kvserve.service.core.engine_errors import InvalidArgument, QueueFull, Unavailable
from kvserve.service.core.limits import EngineLimits
from kvserve.service.core.sampling import SamplingParams
from kvserve.service.core.sequence import GenerationRequest

from ...conftest import PROVIDER


@pytest.fixture(scope="module")
def tiny_runtime(tiny_artifact):
    artifact = open_artifact(tiny_artifact)
    return DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER), artifact.config


def with_engine(tiny_runtime, scenario, **limits):
    """Run scenario(engine) on a started engine over the tiny artifact, closed afterwards."""
    runtime, config = tiny_runtime

    async def run():
        engine = Engine(runtime, config, ByteTokenizer(), EngineLimits(**limits))
        engine.start()
        try:
            return await scenario(engine)
        finally:
            await engine.close()
            engine.batch.close()

    return asyncio.run(run())


LONG = GenerationRequest(prompt_ids=(1, 2, 3), max_new_tokens=200, ignore_eos=True)


def test_with_every_row_busy_and_no_waiting_room_a_request_is_refused_and_a_free_row_admits_the_next(tiny_runtime):
    async def scenario(engine):
        running = engine.generate(LONG)
        first = await anext(running)  # admitted, holding the one row
        with pytest.raises(QueueFull, match=r"the queue is full \(0 requests waiting for one of 1 rows\)"):
            await anext(engine.generate(GenerationRequest(prompt_ids=(4,), max_new_tokens=2)))
        live = engine.live()
        await running.aclose()  # the caller goes away: its row is freed within a step
        await asyncio.wait_for(engine.scheduler.idle.wait(), 30)
        events = [event async for event in engine.generate(GenerationRequest(prompt_ids=(4,), max_new_tokens=2))]
        return first, live, events, engine.live()

    first, live, events, after = with_engine(tiny_runtime, scenario, max_batch_size=1, max_queue=0)
    assert first.finish is None and (live.active, live.queued, len(live.sequences)) == (1, 0, 1) and live.kv_bytes > 0
    assert len(events) == 2 and events[-1].finish is not None
    assert (after.active, after.queued, after.kv_bytes) == (0, 0, 0) and after.cached_rows == 1  # its K/V kept for the cache


def test_a_draining_engine_refuses_new_requests_and_waits_for_the_running_ones(tiny_runtime):
    async def scenario(engine):
        running = engine.generate(GenerationRequest(prompt_ids=(1, 2), max_new_tokens=20, ignore_eos=True))
        await anext(running)
        engine.stop_accepting()
        with pytest.raises(Unavailable, match="shutting down"):
            await anext(engine.generate(GenerationRequest(prompt_ids=(1,), max_new_tokens=1)))
        rest = [event async for event in running]
        return rest, await engine.drain(30)

    rest, drained = with_engine(tiny_runtime, scenario)
    assert rest[-1].finish is not None and len(rest) == 19 and drained


def test_n_completions_are_n_sequences_with_seeds_in_turn_each_ending_once(tiny_runtime):
    request = GenerationRequest(prompt_ids=(5, 6, 7), max_new_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=40))

    async def scenario(engine):
        fanned = [(index, event) async for index, event in engine.generate_n(request, 3)]
        alone = []
        for seed in (40, 41, 42):
            single = GenerationRequest(**{**request.__dict__, "sampling": SamplingParams(temperature=1.0, seed=seed)})
            alone.append([event.token_id async for event in engine.generate(single)])
        with pytest.raises(InvalidArgument, match=r"n: must be in \[1, 8\], got 9"):
            await anext(engine.generate_n(request, 9))
        return fanned, alone

    fanned, alone = with_engine(tiny_runtime, scenario)
    for index in range(3):
        events = [event for i, event in fanned if i == index]
        assert [e.token_id for e in events] == alone[index]  # completion i is the request with seed + i
        assert [e.finish is not None for e in events].count(True) == 1 and events[-1].finish is not None
    assert len({tuple(a) for a in alone}) == 3


def test_a_batched_stream_takes_every_event_ready_at_once_in_order_and_raises_after_the_tokens_before_an_error(tiny_runtime, monkeypatch):
    """generate(batched=True): lists of the events ready when the caller asks; a caller busy while the steps run gets
    them in one list; the lists concatenated are the unbatched stream; an error queued behind tokens comes after them."""
    request = GenerationRequest(prompt_ids=(9, 8, 7), max_new_tokens=40, ignore_eos=True, speculation=False)
    runtime, _ = tiny_runtime
    for name in ("run_slots", "run_decode"):  # 5 ms a step at least: the 200-token stream still runs when it is ended
        real = getattr(runtime, name)
        monkeypatch.setattr(runtime, name, lambda *args, real=real: (time.sleep(0.005), real(*args))[1])

    async def queued(engine, count: int) -> None:
        """Until a running stream has count events waiting for its caller (or none runs: every event is queued)."""
        while (running := engine.scheduler.sequences()) and all(s.events.qsize() < count for s in running if s.events is not None):
            await asyncio.sleep(0.002)

    async def scenario(engine):
        plain = [event async for event in engine.generate(request)]
        batches = []
        async for events in engine.generate(request, batched=True):
            batches.append(events)
            if len(batches) == 1:
                await asyncio.wait_for(queued(engine, 3), 30)  # busy while the steps go on
        stopped = engine.generate(LONG, batched=True)
        first = await anext(stopped)
        await asyncio.wait_for(queued(engine, 3), 30)  # tokens queue, then the server ends the stream behind them
        await engine.stop_streams("going away")
        before_error = await asyncio.wait_for(anext(stopped), 10)
        with pytest.raises(Unavailable, match="going away"):
            await asyncio.wait_for(anext(stopped), 10)
        return plain, batches, first, before_error

    plain, batches, first, before_error = with_engine(tiny_runtime, scenario)
    events = [event for batch in batches for event in batch]
    assert [(e.token_id, e.text) for e in events] == [(e.token_id, e.text) for e in plain]
    assert (events[-1].finish.reason, events[-1].finish.generated_tokens) == (plain[-1].finish.reason, 40)
    assert max(len(batch) for batch in batches) > 1 and len(batches) < len(events)
    assert all(e.finish is None for e in events[:-1]) and events[-1].finish is not None
    assert len(first) >= 1 and len(before_error) > 1 and all(e.finish is None for e in before_error)


def test_batched_n_completions_are_each_the_unbatched_ones(tiny_runtime):
    request = GenerationRequest(prompt_ids=(5, 6, 7), max_new_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=40))

    async def scenario(engine):
        plain = [(index, event) async for index, event in engine.generate_n(request, 3)]
        batched = [(index, events) async for index, events in engine.generate_n(request, 3, batched=True)]
        return plain, batched

    plain, batched = with_engine(tiny_runtime, scenario)
    for index in range(3):
        assert [e.token_id for i, batch in batched if i == index for e in batch] == [e.token_id for i, e in plain if i == index]


def test_one_bad_completion_refuses_the_whole_request_before_anything_is_sent(tiny_runtime):
    async def scenario(engine):
        stream = engine.generate_n(GenerationRequest(prompt_ids=(1,), max_new_tokens=2), 3)
        with pytest.raises(QueueFull):
            await anext(stream)  # two rows for three completions, no waiting room
        await stream.aclose()
        await asyncio.wait_for(engine.scheduler.idle.wait(), 30)
        return engine.live()

    after = with_engine(tiny_runtime, scenario, max_batch_size=2, max_queue=0)
    assert (after.active, after.queued) == (0, 0)  # the admitted ones were cancelled with it


def test_completions_that_do_not_fit_are_refused_together_however_their_tokenizing_is_timed(tiny_runtime):
    """n completions are admitted as one: the last one's tokenizing held back until the first two have finished (which
    would free their rows) does not let a request for more completions than the rows hold through."""
    async def scenario(engine):
        make_sequence, calls = engine.validator.make_sequence, []

        def slow_third(request):
            calls.append(request)
            if len(calls) == 3:  # the thread pool's timing, made the worst it can be
                while engine.live().active or engine.scheduler.waiting:
                    time.sleep(0.01)
            return make_sequence(request)

        engine.validator.make_sequence = slow_third
        stream = engine.generate_n(GenerationRequest(prompt_ids=(1,), max_new_tokens=2), 3)
        with pytest.raises(QueueFull):
            await anext(stream)
        await stream.aclose()
        return calls

    assert with_engine(tiny_runtime, scenario, max_batch_size=2, max_queue=0) == []  # refused before any was tokenized


def test_limits_outside_their_declared_bounds_are_refused_when_the_engine_is_made(tiny_runtime):
    runtime, config = tiny_runtime
    with pytest.raises(ValueError, match=r"--max-batch-size must be in \[1, 4096\], got 0"):
        Engine(runtime, config, ByteTokenizer(), EngineLimits(max_batch_size=0))


class RecordingTracer:
    """A stand-in for tracing.RequestTracer: what each finished sequence would be traced as."""

    def __init__(self):
        self.finishes = []

    def caller_context(self, traceparent, tracestate):
        return None

    def record(self, seq, finish, context, model, chat, error=None):
        self.finishes.append(None if finish is None else finish.reason.value)


def test_a_stream_its_consumer_leaves_at_its_last_event_is_traced_as_finished(tiny_runtime):
    """An edge that stops reading at the finish (closing the stream without resuming it) must not make a finished
    request look cancelled in its trace (a CI run saw a root span without its finish reason)."""
    runtime, config = tiny_runtime
    tracer = RecordingTracer()

    async def run():
        engine = Engine(runtime, config, ByteTokenizer(), EngineLimits(), tracer=tracer)
        engine.start()
        try:
            stream = engine.generate(GenerationRequest(prompt_ids=(1, 2), max_new_tokens=3, ignore_eos=True))
            async for event in stream:
                if event.finish is not None:
                    break  # not resumed: the generator is closed at the yield of its last event
            await stream.aclose()
            cancelled = engine.generate(GenerationRequest(prompt_ids=(1, 2), max_new_tokens=50, ignore_eos=True))
            await anext(cancelled)
            await cancelled.aclose()  # a real cancellation, for contrast
        finally:
            await engine.close()
            engine.batch.close()

    asyncio.run(run())
    assert tracer.finishes == ["length", None]
