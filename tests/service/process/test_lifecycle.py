"""The server's lifecycle: cancellation, deadlines, back-pressure, health, drain and shutdown, the parity
gate, reflection, and the rule that serving never imports torch."""

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.model.generate import generate
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from ...conftest import REPO, unrunnable_copy
from ..conftest import live, long_request, slow_down, slowed_server, start_server, wait_for


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cancelling_100_streams_frees_every_sequence_and_its_cache(stub, server):
    from kvserve.service.core.sequence import Sequence

    def cancel_a_hundred():
        streams = [stub.Generate(long_request(), timeout=60) for _ in range(100)]
        for stream in streams[:8]:
            next(stream)  # these are running: cancelled mid-generation, the rest while queued
        for stream in streams:
            stream.cancel()
        assert wait_for(lambda: live(stub).active_sequences == 0 and live(stub).queued_sequences == 0)

    cancel_a_hundred()  # warm: allocator pools and gRPC buffers reach their working size
    growth = []
    for _ in range(3):
        gc.collect()
        before = rss_bytes()
        cancel_a_hundred()
        info = live(stub)
        assert (info.active_sequences, info.queued_sequences, info.kv_slots_in_use, info.kv_cache_bytes) == (0, 0, 0, 0)
        assert list(info.sequences) == []
        assert wait_for(lambda: gc.collect() >= 0 and not [o for o in gc.get_objects() if type(o) is Sequence], timeout=5)
        growth.append(rss_bytes() - before)
    # A leak grows the process every round; the allocator's and the rest of the session's noise does not
    # (a clean-clone CI run once saw one round grow 24 MB with nothing leaked).
    assert min(growth) < 16 * 2**20, growth


def test_a_deadline_ends_the_stream_and_frees_the_sequence(stub, server, monkeypatch):
    # A step gives at most 1 + drafts.MAX_DRAFT_TOKENS tokens, so the 200 take at least 7 steps: at 0.1 s a step they
    # outlast the deadline however many drafts the session's earlier requests taught the server to take (at 0.01 s a
    # step, after the suite's other streams of the same request, all 200 once came before it).
    slow_down(monkeypatch, server.app, seconds=0.1)
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(long_request(), timeout=0.3))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: live(stub).active_sequences == 0)
    assert live(stub).kv_cache_bytes == 0


def test_a_full_queue_is_resource_exhausted(tiny_artifact, monkeypatch):
    with slowed_server(tiny_artifact, monkeypatch, max_batch_size=1, max_queue=2) as (_, stub, _):
        streams = [stub.Generate(long_request(100), timeout=60) for _ in range(3)]
        assert wait_for(lambda: (live(stub).active_sequences, live(stub).queued_sequences) == (1, 2))
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(long_request(5), timeout=10))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in error.value.details()
        for stream in streams:
            stream.cancel()


def test_max_queue_zero_means_no_waiting_room_not_no_service(tiny_artifact, monkeypatch):
    with slowed_server(tiny_artifact, monkeypatch, max_batch_size=2, max_queue=0) as (_, stub, _):
        streams = [stub.Generate(long_request(100), timeout=60) for _ in range(2)]  # both get a row
        for stream in streams:
            next(stream)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(long_request(5), timeout=10))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "0 requests waiting for one of 2 rows" in error.value.details()
        for stream in streams:
            stream.cancel()
        assert wait_for(lambda: live(stub).active_sequences == 0)
        assert len(list(stub.Generate(long_request(5), timeout=30))) == 5  # an idle server serves


def test_health_is_not_serving_until_loaded_then_serving_then_draining(tiny_artifact, tiny_model, monkeypatch):
    running = start_server(tiny_artifact, load=False, drain_seconds=20)
    try:
        with grpc.insecure_channel(running.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = pb_grpc.GenerationServiceStub(channel)
            check = lambda: health.Check(health_pb2.HealthCheckRequest(service="kvserve.v1.GenerationService")).status  # noqa: E731
            assert check() == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(long_request(1), timeout=10))
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in error.value.details()
            running.call(running.app.load())
            assert check() == health_pb2.HealthCheckResponse.SERVING

            slow_down(monkeypatch, running.app)
            in_flight = stub.Generate(long_request(60), timeout=60)
            first = next(in_flight)
            with ThreadPoolExecutor(1) as pool:
                stopping = pool.submit(running.stop)
                assert wait_for(lambda: check() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
                with pytest.raises(grpc.RpcError) as error:
                    list(stub.Generate(long_request(1), timeout=10))
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in error.value.details()
                rest = list(in_flight)  # the stream in flight still finishes, within the grace period
                stopping.result(30)
            assert 1 + len(rest) == 60 and rest[-1].finish.reason == pb.FINISH_REASON_LENGTH
            expected = generate(tiny_model, [[1, 2, 3]], 60).tokens[0].tolist()
            assert [first.token.id] + [r.token.id for r in rest] == expected
    finally:
        if running.thread.is_alive():
            running.loop.call_soon_threadsafe(running.loop.stop)


def start_process(artifact, *extra):
    process = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(artifact), "--port", "0", "--provider", "cpu", *extra],
        cwd=REPO, stderr=subprocess.PIPE, text=True,
    )
    lines = []
    for line in process.stderr:
        lines.append(line)
        if "kvserve.server: SERVING " in line or "error" in line.lower():
            break
    port = next((m.group(1) for m in (re.search(r"listening on [\d.]+:(\d+)", x) for x in lines) if m), None)
    return process, port, "".join(lines)


def sigterm_mid_stream(artifact, drain_seconds: str):
    """A server process streaming 250 tokens gets SIGTERM after the first: (the rest of the stream or the
    RpcError that ended it, exit code, what it logged after the signal)."""
    process, port, log = start_process(artifact, "--drain-seconds", drain_seconds)
    try:
        assert "SERVING" in log, log
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = pb_grpc.GenerationServiceStub(channel).Generate(long_request(250), timeout=60)
            next(stream)
            process.send_signal(signal.SIGTERM)
            try:
                outcome = list(stream)
            except grpc.RpcError as error:
                outcome = error
        return outcome, process.wait(30), process.stderr.read()
    finally:
        process.kill()


def test_sigterm_lets_the_stream_in_flight_finish_and_exits_zero(tiny_artifact):
    rest, code, log = sigterm_mid_stream(tiny_artifact, "20")
    assert len(rest) == 249 and rest[-1].finish.reason == pb.FINISH_REASON_LENGTH
    assert code == 0 and "draining" in log and "stopped" in log


def test_sigterm_with_a_drain_too_short_ends_the_stream_with_unavailable_and_exits_zero(tiny_artifact):
    error, code, log = sigterm_mid_stream(tiny_artifact, "0.01")
    assert isinstance(error, grpc.RpcError), "the stream finished within a 10 ms drain"
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "drain period ran out" in error.details()
    assert code == 0 and "Traceback" not in log


def tampered_copy(artifact, destination):
    """The artifact with a golden record the graph does not reproduce, as a broken export would have."""
    from kvserve.contract.artifact import GoldenRecord, sha256_file

    shutil.copytree(artifact, destination)
    golden = GoldenRecord.load(destination / "golden.npz")
    GoldenRecord(golden.prompt_ids, golden.tokens, golden.logits + np.float32(0.01)).save(destination / "golden.npz")
    manifest = json.loads((destination / "manifest.json").read_text())
    manifest["files"]["golden.npz"] = sha256_file(destination / "golden.npz")
    (destination / "manifest.json").write_text(json.dumps(manifest))
    return destination


def test_an_artifact_failing_the_parity_gate_is_refused(tiny_artifact, tmp_path):
    bad = tampered_copy(tiny_artifact, tmp_path / "bad")
    process, _, log = start_process(bad)
    process.wait(30)
    remaining = process.stderr.read()
    assert process.returncode == 1
    assert "parity gate failed, refusing to serve" in log + remaining and "max abs logit diff 1.00e-02" in log + remaining
    assert "Traceback" not in log + remaining


def test_an_artifact_whose_graph_fails_its_steps_is_refused_in_one_line(tiny_artifact, tmp_path):
    bad = unrunnable_copy(tiny_artifact, tmp_path / "bad")
    process, _, log = start_process(bad)
    process.wait(30)
    remaining = process.stderr.read()
    assert process.returncode == 2, log + remaining
    error = next(line for line in (log + remaining).splitlines() if line.startswith("kvserve serve: error: "))
    assert f"{bad}: its graph does not run here (ONNX Runtime failed a step on CPUExecutionProvider: " in error
    assert "Gather node" in error and error.endswith("export it again with this kvserve, or serve it on another provider")
    assert "Traceback" not in log + remaining and "ExecuteKernel" not in log + remaining  # ONNX Runtime's own log line: not again


def test_the_override_serves_a_failing_artifact_and_says_so(tiny_artifact, tmp_path):
    running = start_server(tampered_copy(tiny_artifact, tmp_path / "bad"), allow_parity_failure=True)
    try:
        with grpc.insecure_channel(running.target) as channel:
            gate = pb_grpc.GenerationServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest()).parity_gate
        assert (gate.passed, gate.overridden) == (False, True)
    finally:
        running.stop()


def test_the_contract_check_names_a_mismatched_axis(tiny_artifact, tmp_path):
    from kvserve.contract.artifact import contract_problems, open_artifact
    from kvserve.runtime.step import DecoderRuntime

    copy = tmp_path / "copy"
    shutil.copytree(tiny_artifact, copy)
    config = json.loads((copy / "config.json").read_text())
    config["n_head"] = 8  # the graph has 4 heads of 16; this claims 8 of 8
    (copy / "config.json").write_text(json.dumps(config))
    artifact = open_artifact(copy, check_files=False)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, "cpu")
    problems = contract_problems(runtime.signature(), artifact)
    assert "past_key_values.0.key axis 1 is 4, expected 8" in problems


def test_reflection_lists_the_services(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.target) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"kvserve.v1.GenerationService", "grpc.health.v1.Health"} <= services


def test_serving_never_imports_torch(tiny_artifact):
    code = (
        "import asyncio, sys\n"
        "from kvserve.service.process.options import ServerOptions\n"
        "from kvserve.service.process.app import App\n"
        "async def main():\n"
        f"    app = App(ServerOptions(artifact={str(tiny_artifact)!r}, port=0, provider='cpu'))\n"
        "    await app.start(); await app.load(); await app.shutdown()\n"
        "asyncio.run(main())\n"
        "import kvserve.service.edges.client, kvserve.cli\n"
        "print('torch loaded' if 'torch' in sys.modules else 'no torch')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.stdout.strip().endswith("no torch"), result.stderr
    for source in [*(REPO / "service").rglob("*.py"), *(REPO / "runtime").rglob("*.py"), *(REPO / "contract").rglob("*.py")]:
        assert not re.search(r"^\s*(import|from)\s+torch", source.read_text(), re.M), source


def test_the_cli_client_streams_and_summarises(server):
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--target", server.target, "abc", "--max-new-tokens", "8"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"-- 8 tokens, time to first token [\d.]+ ms, [\d.]+ tokens/s, finished: length", result.stdout)
    bad = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--target", server.target, "abc", "--max-new-tokens", "9999"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )
    assert bad.returncode == 2 and "INVALID_ARGUMENT: max_new_tokens" in bad.stderr and "Traceback" not in bad.stderr


def test_a_taken_port_and_a_bad_variable_are_one_line_errors(server):
    taken = server.target.rsplit(":", 1)[1]
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(server.app.options.artifact), "--port", taken],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2 and f"cannot listen on 127.0.0.1:{taken}" in result.stderr
    assert "add_port" not in result.stderr  # gRPC's own line about it, before ours, is off
    assert "Traceback" not in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve"], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "KVSERVE_MODEL": "x", "KVSERVE_PORT": "fifty"},
    )
    assert result.returncode == 2 and "KVSERVE_PORT='fifty' is not a valid int" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(server.app.options.artifact), "--step-token-budget", "-1"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2 and "--step-token-budget: -1 is outside [0, 2147483647]" in result.stderr
    result = subprocess.run(  # a variable is held to the same declared bounds as its flag
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(server.app.options.artifact)], cwd=REPO, capture_output=True,
        text=True, timeout=60, env={**os.environ, "KVSERVE_MAX_N": "65"},
    )
    assert result.returncode == 2 and "--max-n must be in [1, 64], got 65" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_warm_up_runs_each_kind_of_step_once_whatever_the_batch_size(server, monkeypatch):
    """A chunk alone, a chunk beside a decoding row, a decode alone: what the serving loop runs, once each, and no
    more at 8 rows than at 2 (a Llama-3.1-8B start spent 23 s warming 16 rows the same way)."""
    from kvserve.service.core.batch import SlotBatch
    from kvserve.service.core.scheduler import Scheduler
    from kvserve.service.process.gate import warm_up

    for rows in (2, 8):
        kinds = []
        run_step = Scheduler.run_step

        def recording(self, plan, before_model=None):
            if self.batch is batch:  # the warm-up's own steps, not any the running server takes meanwhile
                kinds.append((plan.chunk is not None, len(plan.decode)))
            return run_step(self, plan, before_model)

        monkeypatch.setattr(Scheduler, "run_step", recording)
        batch = SlotBatch(server.app.runtime, server.app.artifact.config, rows)
        try:
            warm_up(batch, server.app.artifact, chunk_lengths=False)  # as on the CPU, by default
        finally:
            batch.close()  # its bound steps are the shared runtime's until let go
        assert kinds == [(True, 0), (True, 1), (False, 1)]
        monkeypatch.undo()


def test_the_cuda_warm_up_runs_every_chunk_length_beside_a_decoding_row_and_times_none(server, tiny_model, monkeypatch):
    """On CUDA each new chunk length's first run stalled every stream ~50-100 ms: the warm-up runs each length the
    scheduler gives a chunk beside one decoding row, from an empty row and after a first chunk, times none of those
    first runs into the step costs, then serves exactly."""
    from kvserve.service.core.batch import SlotBatch
    from kvserve.service.core.limits import EngineLimits
    from kvserve.service.core.scheduler import Scheduler
    from kvserve.service.process.gate import _greedy_sequence, chunk_warm_up_prompts, warm_up

    budget = EngineLimits.step_token_budget
    # the budget less the decoding row, on the CPU; on CUDA the rows take none of it (Scheduler.budget_counts_rows)
    allowance, tail = budget - (server.app.runtime.device != "cuda"), budget // 4
    assert chunk_warm_up_prompts(allowance, tail, 10**6) == list(range(1, allowance + tail + 1)) + [allowance + n for n in range(tail + 1, allowance + tail + 1)]
    assert max(chunk_warm_up_prompts(allowance, tail, 20)) == 20  # none longer than a row may hold
    chunks = []
    run_step = Scheduler.run_step

    def recording(self, plan, before_model=None):
        if self.batch is batch and plan.chunk is not None:
            chunks.append((len(plan.decode), plan.held[plan.chunk].cached_tokens > 0, plan.chunk_tokens))
        return run_step(self, plan, before_model)

    monkeypatch.setattr(Scheduler, "run_step", recording)
    # chunks at their own lengths, as on the CPU (CUDA's run padded to a few: test_fixed_decode.py's warm-up test)
    monkeypatch.setattr(server.app.runtime, "pads_prompts", False)
    batch = SlotBatch(server.app.runtime, server.app.artifact.config, 4)
    try:
        warm_up(batch, server.app.artifact, chunk_lengths=True)
        monkeypatch.undo()
        beside_a_row = {(after_a_chunk, tokens) for rows, after_a_chunk, tokens in chunks if rows == 1}
        assert {(False, n) for n in range(1, allowance + tail + 1)} <= beside_a_row
        assert {(True, n) for n in range(tail + 1, allowance + tail + 1)} <= beside_a_row
        assert not batch.step_costs.seconds and batch.step_costs.chunks.steps == 0  # no first run timed into the step costs
        prompt = [5, 9, 200, 17, 3, 3, 80]
        seq = _greedy_sequence(1, prompt, 12)
        Scheduler(batch, budget).drive([seq])
        assert seq.reused_prompt_tokens == 0  # no warm-up row is found in the prompt cache
        assert seq.generated == generate(tiny_model, [prompt], 12).tokens[0].tolist()
    finally:
        batch.close()


def test_warm_up_fails_when_a_sequence_fails_in_the_prefill_step(server, monkeypatch):
    from kvserve.service.core.batch import SlotBatch
    from kvserve.service.process.gate import warm_up
    from kvserve.service.core.sequence import Sequence

    def failing_advance(*args):
        raise RuntimeError("sampling broke during warm-up")

    monkeypatch.setattr(Sequence, "advance", failing_advance)  # greedy warm-up rows take the graph's token: no choose
    batch = SlotBatch(server.app.runtime, server.app.artifact.config, 2)
    with pytest.raises(RuntimeError, match="sampling broke during warm-up"):
        warm_up(batch, server.app.artifact)


def test_streams_still_running_when_the_drain_period_runs_out_end_with_unavailable(tiny_artifact, monkeypatch):
    running = start_server(tiny_artifact, drain_seconds=0.3)
    slow_down(monkeypatch, running.app, seconds=0.02)
    with grpc.insecure_channel(running.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        streams = [stub.Generate(long_request(200), timeout=60) for _ in range(2)]
        for stream in streams:
            next(stream)
        with ThreadPoolExecutor(1) as pool:
            stopping = pool.submit(running.stop)
            for stream in streams:
                with pytest.raises(grpc.RpcError) as error:
                    list(stream)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "drain period ran out" in error.value.details()
            stopping.result(30)  # the server stops within the grace period and one second more


def test_a_failed_model_step_fails_every_stream_in_it_and_the_server_goes_on(stub, server, monkeypatch, tiny_model):
    runtime = server.app.runtime
    slow_down(monkeypatch, server.app, 0.02)  # 150 tokens take 3 s: every stream is still running when the step fails
    real = runtime.run_slots
    armed = {"fail": False}

    def run_slots(*args):
        if armed["fail"]:
            armed["fail"] = False
            raise RuntimeError("injected failure of a whole step")
        return real(*args)

    monkeypatch.setattr(runtime, "run_slots", run_slots)
    streams = [stub.Generate(long_request(150), timeout=60) for _ in range(3)]
    for stream in streams:
        next(stream)  # all three are running
    armed["fail"] = True
    for stream in streams:
        with pytest.raises(grpc.RpcError) as error:
            list(stream)
        assert error.value.code() == grpc.StatusCode.INTERNAL and "injected failure of a whole step" in error.value.details()
    assert wait_for(lambda: live(stub).active_sequences == 0)
    ids = [r.token.id for r in stub.Generate(long_request(10), timeout=30)]
    assert ids == generate(tiny_model, [[1, 2, 3]], 10).tokens[0].tolist()


def test_the_tokenize_worker_ends_with_a_server_that_is_killed(tiny_artifact):
    """A server killed outright (no exit hooks run) must not leave its Tokenize worker process behind."""
    from pathlib import Path

    process, _, log = start_process(tiny_artifact)
    try:
        assert "SERVING" in log, log
        children = lambda: [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()  # noqa: E731
                            and _parent_of(p) == process.pid]
        workers = wait_for(children, timeout=10) and children()
        assert workers, "the server spawned no Tokenize worker"
    finally:
        process.kill()
        process.wait(10)
    assert wait_for(lambda: not any(_running(Path(f"/proc/{pid}")) for pid in workers), timeout=10), workers


def _stat_fields(proc_dir) -> list[str]:
    """/proc/PID/stat after the command name: state, parent pid, ...; [] when the process is gone."""
    try:
        return (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _parent_of(proc_dir) -> int | None:
    fields = _stat_fields(proc_dir)
    return int(fields[1]) if fields else None


def _running(proc_dir) -> bool:
    """Alive, not a zombie waiting for whoever reaps orphans here."""
    fields = _stat_fields(proc_dir)
    return bool(fields) and fields[0] != "Z"
