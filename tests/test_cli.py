"""The command line on bad input: one line naming the problem, exit 2, no traceback, nothing listening."""

import hashlib
import json
import re
import shutil
import socket
from pathlib import Path

import onnx
import pytest

from .conftest import run_cli


def one_line_error(result, *fragments):
    """Exit 2 and one line of error; the server's own timestamped log lines before it do not count."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not re.match(r"\d{4}-\d\d-\d\d \d\d:", line)]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "x", "--max-new-tokens", "-5"], "--max-new-tokens: -5 is outside"),
        (["generate", "x", "--seed", "-1"], "--seed: -1 is outside"),
        (["generate", "x", "--timeout", "0"], "--timeout: 0 is outside"),
        (["health", "--wait", "-1"], "--wait: -1 is outside"),
        (["generate", "x", "--target", "notahost:abc"], "--target: 'notahost:abc': the port 'abc' is not a number"),
        (["health", "--target", "localhost"], "--target: 'localhost' is not HOST:PORT"),
        (["health", "--target", "::1:5"], "--target: '::1:5' is not HOST:PORT"),
        (["generate", "x", "--target", "host:70000"], "the port '70000' is not a number in [1, 65535]"),
    ],
    ids=["negative max new tokens", "negative seed", "zero timeout", "negative wait", "unparseable port", "no port",
         "unbracketed ipv6", "port out of range"],
)
def test_client_flags_out_of_range(args, message):
    one_line_error(run_cli(*args), message)


@pytest.mark.parametrize("steps, message", [("0", "--steps: 0 is outside"), ("-1", "--steps: -1 is outside"),
                                            ("1000", "--steps must be in [1, 242] for this model (context 256), got 1000")])
def test_verify_steps_out_of_range(tiny_artifact, tmp_path, steps, message):
    one_line_error(run_cli("verify", str(tiny_artifact), "--steps", steps, "--report", str(tmp_path / "r.json")), message)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("report, message", [("", "--report is empty"), ("DIR", "not a file in an existing directory"),
                                             ("DIR/nowhere/r.json", "not a file in an existing directory")])
def test_a_report_that_cannot_be_written_is_refused_before_the_run(tiny_artifact, tmp_path, report, message):
    one_line_error(run_cli("verify", str(tiny_artifact), "--report", report.replace("DIR", str(tmp_path))), message)


def test_an_artifact_whose_own_report_cannot_be_rewritten_keeps_the_verdict(tiny_artifact, tmp_path):
    """A read-only artifact volume, say (here its parity.json is a directory, which no user writes over; a read-only mode
    would not stop root): verify's exit says what the checks found, and a line says where the report did not go."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_artifact, copy)
    (copy / "parity.json").unlink()
    (copy / "parity.json").mkdir()
    result = run_cli("verify", str(copy))
    assert result.returncode == 0 and "result: PASS" in result.stdout, result.stderr
    assert "the report was not written to" in result.stderr and "Traceback" not in result.stderr


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _corrupt_model(manifest, directory):
    (directory / "model.onnx").write_bytes(b"\x08not an onnx graph" * 64)
    manifest["files"]["model.onnx"] = _sha256(directory / "model.onnx")  # the checksum agrees: only loading tells


def _weights_apart(manifest, directory) -> Path:
    """The tiny graph's weights moved to model.onnx.data, as a large model's are written, the manifest's checksums
    those of the files as moved; the weights file's path."""
    graph = onnx.load(str(directory / "model.onnx"))
    onnx.save_model(graph, str(directory / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data")  # the shapes' small constants stay in the graph, as the exporter keeps them
    for name in ("model.onnx", "model.onnx.data"):
        manifest["files"][name] = _sha256(directory / name)
    return directory / "model.onnx.data"


def _changed_weights(manifest, directory):
    path = _weights_apart(manifest, directory)
    weights = bytearray(path.read_bytes())
    weights[len(weights) // 2] ^= 0x40  # one weight off: the session loads it; only the checksum tells
    path.write_bytes(bytes(weights))


def _weights_cut_short(manifest, directory):
    path = _weights_apart(manifest, directory)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # the session cannot load it; the checksum is the cause


def _signed(name: str, content: bytes):
    """An edit writing content to the artifact's file name and its checksum to the manifest: a file changed on purpose,
    which only reading it can refuse."""
    def edit(manifest, directory):
        (directory / name).write_bytes(content)
        manifest["files"][name] = _sha256(directory / name)

    return edit


def _golden_without_logits(manifest, directory):
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.savez(buffer, prompt_ids=np.arange(4), tokens=np.arange(2))
    _signed("golden.npz", buffer.getvalue())(manifest, directory)


def _config_with_another_layer(manifest, directory):
    config = json.loads((directory / "config.json").read_text())
    _signed("config.json", json.dumps(config | {"n_layer": config["n_layer"] + 1}).encode())(manifest, directory)


WEIGHTS_CHANGED = "model.onnx.data: checksum mismatch (the file changed after export)"
# the weights are checked as the session opens; the tokenizer, chat template and golden record are read by the load
FOUND_AFTER_LISTENING = ("corrupt model.onnx", "changed weights", "weights cut short", "unreadable golden record", "golden record without logits",
                         "unreadable tokenizer.json", "template that does not compile", "config.json with a layer more than the graph")

BROKEN_ARTIFACTS = {
    "no files": (lambda m, d: m.pop("files"), "manifest.json: 'files' must map each file name to its sha256"),
    "files of the wrong type": (lambda m, d: m.update(files=["model.onnx"]), "'files' must map each file name to its sha256, got list"),
    "no dtype": (lambda m, d: m.pop("dtype"), "manifest.json: dtype None is not one of float32, float16"),
    "bfloat16": (lambda m, d: m.update(dtype="bfloat16"), "dtype 'bfloat16' is not one of float32, float16"),
    "corrupt model.onnx": (_corrupt_model, "model.onnx: ONNX Runtime cannot load it"),
    "changed weights": (_changed_weights, WEIGHTS_CHANGED),
    "weights cut short": (_weights_cut_short, WEIGHTS_CHANGED),
    "unknown attention": (lambda m, d: m.update(attention="flash"), "manifest.json: attention 'flash' is not one of standard, fused"),
    "an older format": (lambda m, d: m.update(format="kvserve-artifact/1"),
                        "manifest.json: format 'kvserve-artifact/1'; this kvserve reads 'kvserve-artifact/2': re-export with kvserve export"),
    # each of these was a traceback from serve (and verify called the artifact a PASS)
    "unreadable golden record": (_signed("golden.npz", b"garbage"), "golden.npz: not a golden record this kvserve reads"),
    "golden record without logits": (_golden_without_logits, "golden.npz: not a golden record this kvserve reads (KeyError"),
    "unreadable tokenizer.json": (_signed("tokenizer.json", b"{}"), "tokenizer.json: not a tokenizer.json the tokenizers library reads"),
    "template that does not compile": (_signed("chat_template.jinja", b"{% for %}"), "chat_template.jinja: its chat template does not compile"),
    "config.json not an object": (_signed("config.json", b"[]"), "unreadable manifest or config (config.json is not a JSON object)"),
    "config.json with a layer more than the graph": (_config_with_another_layer, {
        "serve": "model.onnx: its graph takes the K/V of 2 layers where config.json says 3: the graph and config of different exports",
        "verify": "the reference checkpoint's config differs from the artifact's config.json"}),
}


@pytest.mark.parametrize("case", list(BROKEN_ARTIFACTS))
@pytest.mark.parametrize("command", ["verify", "serve"])
def test_a_broken_artifact_is_refused_in_one_line(tiny_artifact, tmp_path, case, command):
    edit, message = BROKEN_ARTIFACTS[case]
    broken = tmp_path / "broken"
    shutil.copytree(tiny_artifact, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    edit(manifest, broken)
    (broken / "manifest.json").write_text(json.dumps(manifest))
    args = ["verify", str(broken)] if command == "verify" else ["serve", "--model", str(broken), "--port", "0", "--provider", "cpu"]
    result = run_cli(*args)
    one_line_error(result, message if isinstance(message, str) else message[command])
    if case not in FOUND_AFTER_LISTENING:  # a manifest problem is found before anything listens
        assert "listening" not in result.stderr


def test_serve_refuses_a_concat_artifact_in_one_line_saying_how_to_re_export(tiny_concat_artifact):
    result = run_cli("serve", "--model", str(tiny_concat_artifact), "--port", "0", "--provider", "cpu")
    one_line_error(result, f"{tiny_concat_artifact}: its concat KV cache is an export for tools that drive the graph themselves; "
                   "kvserve serves the slots layout: re-export with kvserve export (without --kv-cache concat)")
    assert "listening" not in result.stderr


@pytest.mark.parametrize("flag, refusal", [("--metrics-port", "cannot serve metrics on"),
                                           ("--gateway-metrics-port", "cannot serve the gateway's gauges on")])
def test_a_metrics_port_equal_to_the_grpc_port_out_of_range_or_taken(flag, refusal, tiny_artifact):
    one_line_error(run_cli("serve", "--model", str(tiny_artifact), "--port", "50999", flag, "50999"), f"--port and {flag} are both 50999")
    one_line_error(run_cli("serve", "--model", str(tiny_artifact), flag, "70000"), f"{flag} must be in [0, 65535], got 70000")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("serve", "--model", str(tiny_artifact), "--port", "0", flag, str(port), "--provider", "cpu")
    one_line_error(result, f"{refusal} 127.0.0.1:{port}")
    assert "listening" not in result.stderr


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e999"])
def test_a_drain_period_that_is_no_period_is_refused_in_one_line(value, tiny_artifact, monkeypatch):
    one_line_error(run_cli("serve", "--model", str(tiny_artifact), "--port", "0", "--drain-seconds", value, timeout=60),
                   "--drain-seconds must be in [0, 86400]")
    monkeypatch.setenv("KVSERVE_DRAIN_SECONDS", value)  # a container's variable: the same refusal, not a server that never stops
    one_line_error(run_cli("serve", "--model", str(tiny_artifact), "--port", "0", timeout=60), "--drain-seconds must be in [0, 86400]")


@pytest.mark.parametrize("flags, message", [
    (["--auth-tokens", ""], "--auth-tokens is empty: give a file's path"),  # never read as "no tokens": a server open to anyone
    (["--tls-cert", "", "--tls-key", ""], "--tls-key is empty: give a file's path"),
    (["--auth-tokens", "/nonexistent/tokens"], "--auth-tokens /nonexistent/tokens: No such file or directory"),
    (["--auth-tokens", "COMMENTS"], "no tokens in the file"),
    (["--tls-cert", "COMMENTS"], "--tls-cert and --tls-key go together"),
    (["--auth-tokens", "UNSENDABLE"], "line 3 holds a space or a character that is not printable ASCII"),
], ids=["empty tokens path", "empty TLS paths", "missing tokens file", "comments only", "cert alone", "unsendable token"])
def test_a_security_file_that_cannot_be_used_is_refused_in_one_line(flags, message, tiny_artifact, tmp_path):
    (tmp_path / "comments").write_text("# no token yet\n\n")
    (tmp_path / "unsendable").write_text("# tokens\ns3cret\nünï\n", encoding="utf-8")  # no header can carry it
    flags = [str(tmp_path / flag.lower()) if flag in ("COMMENTS", "UNSENDABLE") else flag for flag in flags]
    one_line_error(run_cli("serve", "--model", str(tiny_artifact), "--port", "0", *flags, timeout=60), message)


def test_a_health_port_equal_to_the_grpc_port(tiny_artifact):
    one_line_error(run_cli("serve", "--model", str(tiny_artifact), "--port", "50999", "--health-port", "50999"),
                   "--port and --health-port are both 50999")


def test_max_context_beyond_the_models_is_refused_in_one_line(tiny_artifact):
    one_line_error(run_cli("serve", "--model", str(tiny_artifact), "--port", "0", "--provider", "cpu", "--max-context", "257"),
                   "--max-context must be in [2, 256] (the model's context), got 257")
    one_line_error(run_cli("serve", "--model", str(tiny_artifact), "--port", "0", "--max-context", "0"), "--max-context")


@pytest.mark.parametrize("variable", ["KVSERVE_CUDA_GRAPH", "KVSERVE_ALLOW_PARITY_FAILURE", "KVSERVE_NO_REFLECTION"])
def test_an_on_off_variable_that_is_neither_is_refused_in_one_line(variable, monkeypatch):
    monkeypatch.setenv(variable, "maybe")
    one_line_error(run_cli("serve", "--model", "does-not-matter"), f"{variable}='maybe' is not a valid on/off value")


def test_split_steps_are_refused_in_one_line_for_an_artifact_without_a_chunk_graph_or_a_value_not_a_choice(tiny_artifact, monkeypatch):
    one_line_error(run_cli("serve", "--model", str(tiny_artifact), "--port", "0", "--provider", "cpu", "--split-steps", "on"),
                   "splitting steps between a chunk graph and a decode graph needs both, and it has no chunk.onnx")
    monkeypatch.setenv("KVSERVE_SPLIT_STEPS", "maybe")
    one_line_error(run_cli("serve", "--model", str(tiny_artifact)), "KVSERVE_SPLIT_STEPS='maybe' is not one of auto, on, off")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_bad_serve_variable_breaks_only_serve(monkeypatch):
    monkeypatch.setenv("KVSERVE_PORT", "abc")
    for args in (["--help"], ["export", "--help"], ["generate", "--help"], ["--version"]):
        result = run_cli(*args)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (args, result.stderr)
    one_line_error(run_cli("serve", "--model", "x"), "KVSERVE_PORT='abc' is not a valid int")


def test_help_is_written_for_users_and_version_is_there():
    import kvserve

    top = run_cli("--help").stdout
    assert "Export a transformer decoder" in top and "OpenAI-compatible HTTP API" in top and "imports only what it needs" not in top
    assert run_cli("--version").stdout.strip() == f"kvserve {kvserve.__version__}"
    assert "OpenAI-compatible HTTP API" in top and "the text to continue" in run_cli("generate", "--help").stdout
    export = run_cli("export", "--help").stdout
    assert "compute and K/V type" in export and "--no-tokenizer" in export
    assert "where the parity check runs" in export
    assert "where the graph runs for the check" in run_cli("verify", "--help").stdout
    assert "Prometheus metrics" in top


def test_export_refuses_a_wrong_path_before_torch_loads(tmp_path):
    import time

    start = time.perf_counter()
    result = run_cli("export", "--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "a"))
    elapsed = time.perf_counter() - start
    one_line_error(result, "checkpoint directory not found")
    assert elapsed < 0.5, elapsed  # 0.07 s measured, the interpreter's start included; torch alone takes 2-3 s


def test_a_checkpoint_without_a_tokenizer_is_refused_unless_asked_for(tmp_path, make_hf_checkpoint):
    _, checkpoint = make_hf_checkpoint(vocab_size=300, n_positions=64, n_embd=32, n_head=2, n_layer=1)
    one_line_error(run_cli("export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "a")),
                   "has no tokenizer.json", "--no-tokenizer")
    assert not (tmp_path / "a").exists()
    result = run_cli("export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "a"), "--no-tokenizer", "--provider", "cpu")
    assert result.returncode == 0 and "result: PASS" in result.stdout, result.stderr
    assert "== parity: " in result.stderr  # its stages, one line each, though no terminal reads them


@pytest.mark.parametrize("flags", [["--tls-ca", ""], ["--tls-cert", " ", "--tls-key", "k"], ["--token-file", ""]],
                         ids=["tls-ca", "tls-cert", "token-file"])
def test_a_client_security_flag_given_empty_is_refused_not_read_as_plaintext(flags):
    for command in (["generate", "x"], ["health"]):
        one_line_error(run_cli(*command, "--target", "127.0.0.1:1", *flags), f"{flags[0]} is empty: give a file's path")


def test_generate_and_health_against_nothing_or_the_wrong_port_say_so():
    import http.server
    import threading

    silent = f"127.0.0.1:{free_port()}"
    for command in (["generate", "x"], ["health"]):
        result = run_cli(*command, "--target", silent, "--timeout" if command[0] == "generate" else "--wait", "1")
        one_line_error(result, f"nothing answers at {silent}")
        assert not result.stdout.strip()
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # HTTP/1, as the HTTP API's port
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        one_line_error(run_cli("generate", "x", "--target", f"127.0.0.1:{web.server_port}", "--timeout", "5"), "does not speak gRPC")
    finally:
        web.shutdown()
    unknown = "bad..host:50051"  # refused by the resolver itself, no DNS asked; it was a bare UNAVAILABLE, exit 1
    for command in (["generate", "x", "--timeout", "5"], ["health"]):
        one_line_error(run_cli(*command, "--target", unknown), f"{unknown}: its host name does not resolve")
    with socket.socket() as mute:  # accepts the connection, never answers: it said only "DEADLINE_EXCEEDED: Deadline Exceeded"
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        target = f"127.0.0.1:{mute.getsockname()[1]}"
        for command in (["generate", "x", "--timeout", "2"], ["health"]):
            result = run_cli(*command, "--target", target)
            assert result.returncode == 1, result.stderr
            assert f"{target} did not answer in time (DEADLINE_EXCEEDED" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_ctrl_c_during_export_ends_it_with_130_and_leaves_nothing(tmp_path):
    """Ctrl-C wherever it lands (torch's import, the exporter, parity): exit 130, no traceback, no artifact. Each Ctrl-C is
    timed from the moment torch's library is mapped (the command is running, importing torch), not from the start: under a
    loaded suite the interpreter alone once took 1.5 s, and a Ctrl-C before the command runs is Python's own."""
    import signal
    import subprocess
    import sys
    import time

    from .conftest import REPO

    def torch_mapped(pid: int) -> bool:
        try:
            return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return False

    out = tmp_path / "a"
    for delay in (0.0, 1.5):
        export = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "export", "--preset", "tiny", "--out", str(out), "--overwrite"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        deadline = time.monotonic() + 60
        while not torch_mapped(export.pid) and export.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert export.poll() is None, "the export ended before torch loaded"
        time.sleep(delay)
        export.send_signal(signal.SIGINT)
        _, stderr = export.communicate(timeout=120)
        # 130, or death by SIGINT, which a shell reports as 130 too: a Ctrl-C landing inside torch's exporter at times
        # ends the process by SIGINT, nothing written, with the handler installed (seen 1 run in 3 at 1.5 s on a fresh
        # clone; which part of the interpreter or torch re-raises it is not known).
        assert export.returncode in (130, -signal.SIGINT) and "Traceback" not in stderr, (delay, export.returncode, stderr[-2000:])
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name != "a"]


def test_the_top_level_help_names_every_model_type_served():
    from kvserve.contract.config import MODEL_TYPES

    help_text = " ".join(run_cli("--help").stdout.split())
    assert all(name in help_text for name in MODEL_TYPES)


def test_export_help_names_every_preset_and_model_type():
    """The CLI names the presets without loading model code; this holds its list to model/presets.py's."""
    from kvserve.cli import PRESET_NAMES
    from kvserve.contract.config import MODEL_TYPES
    from kvserve.model.presets import PRESETS

    assert PRESET_NAMES == tuple(PRESETS)
    export = " ".join(run_cli("export", "--help").stdout.split())
    assert all(name in export for name in (*PRESETS, *MODEL_TYPES))


@pytest.mark.parametrize("args", [["--quantize-block", "48", "--quantize", "int4"], ["--quantize-block", "8", "--quantize", "int8"],
                                  ["--quantize-block", "32"]])
def test_a_quantize_block_that_cannot_be_is_refused_before_export_starts(tmp_path, args):
    result = run_cli("export", "--preset", "tiny", "--out", str(tmp_path / "out"), *args)
    one_line_error(result, f"--quantize-block {args[1]}: give a power of 2 from 16, with --quantize int8 or int4")
    assert not (tmp_path / "out").exists()


def test_a_kv_budget_too_small_or_not_a_size_is_refused_in_one_line(tiny_artifact, monkeypatch):
    result = run_cli("serve", "--model", str(tiny_artifact), "--port", "0", "--provider", "cpu", "--kv-cache-memory", "1Ki")
    one_line_error(result, "--kv-cache-memory 1024 holds")
    assert "give it at least" in result.stderr
    one_line_error(run_cli("serve", "--model", str(tiny_artifact), "--kv-cache-memory", "lots"), "argument --kv-cache-memory: invalid size value: 'lots'")
    monkeypatch.setenv("KVSERVE_KV_CACHE_MEMORY", "lots")
    one_line_error(run_cli("serve", "--model", str(tiny_artifact)), "KVSERVE_KV_CACHE_MEMORY='lots' is not a valid size")
    monkeypatch.setenv("KVSERVE_KV_CACHE_MEMORY", "9" * 400)  # past what a machine addresses: no OverflowError
    one_line_error(run_cli("serve", "--model", str(tiny_artifact)), "is not a valid size")
    monkeypatch.delenv("KVSERVE_KV_CACHE_MEMORY")
    one_line_error(run_cli("serve", "--model", str(tiny_artifact), "--kv-cache-memory", "9" * 400), "argument --kv-cache-memory: invalid size value")


@pytest.mark.parametrize("endpoint, message", [
    ("http://[::1", "is not a valid URL (Invalid IPv6 URL)"), ("http://collector:99999", "is not a valid URL (Port out of range"),
    ("http://", "names no host"), ("grpc://collector:4317", "must be an http:// or https:// URL")])
def test_a_trace_endpoint_the_exporter_would_fail_on_is_refused_at_start(tiny_artifact, endpoint, message):
    result = run_cli("serve", "--model", str(tiny_artifact), "--port", "0", "--otlp-traces-protocol", "grpc", "--otlp-traces-endpoint", endpoint)
    one_line_error(result, message)


@pytest.mark.parametrize("flags, message", [
    (["--kv-events", "http://x:1"], "--kv-events must be tcp://HOST:PORT (HOST may be *) or ipc://PATH, got 'http://x:1'"),
    (["--kv-events", "tcp://*:99999"], "--kv-events must be tcp://HOST:PORT"),
    (["--kv-events-replay", "tcp://*:5558"], "--kv-events-replay replays --kv-events: give that too"),
    (["--kv-events", "tcp://*:5557", "--prompt-cache", "off"], "it needs --prompt-cache on"),
])
def test_kv_event_flags_that_cannot_work_are_refused_at_start(tiny_artifact, flags, message):
    one_line_error(run_cli("serve", "--model", str(tiny_artifact), "--port", "0", *flags), message)


def test_a_kv_events_endpoint_already_bound_is_one_line_and_exit_2(tiny_artifact):
    import zmq

    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")  # (an ipc path is taken over, not refused: tcp is what is taken)
    try:
        result = run_cli("serve", "--model", str(tiny_artifact), "--port", "0", "--kv-events", f"tcp://127.0.0.1:{port}", timeout=120)
    finally:
        taken.close(0)
        context.term()
    one_line_error(result, "for KV events")
