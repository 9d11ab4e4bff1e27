"""`kvserve`: the command line. Each subcommand imports only what it needs, so `serve` and `generate` never load torch
(the serving image does not have it), and `export` and `verify` check their paths before they load it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import kvserve
from kvserve.contract.config import MODEL_TYPES
from kvserve.contract.io_contract import ATTENTION_BITS, KV_DTYPES, QUANTIZATIONS, attention_bits_refusal, kv_dtype_refusal, quantize_block_refusal
from kvserve.errors import JobFailed, UserError

DESCRIPTION = (f"Export a transformer decoder (a checkpoint of model_type {', '.join(MODEL_TYPES)}, or a built-in preset) to "
               "ONNX with its KV cache as graph inputs and outputs, check it against the eager PyTorch model, and serve it over "
               "gRPC and an OpenAI-compatible HTTP API.")
BYTE_VOCABULARY = 257  # 256 bytes and an end-of-sequence id: what an artifact without tokenizer.json reads text as


def _check_export_paths(args) -> None:
    """What export can refuse before torch loads (a second or more): a missing checkpoint, a checkpoint whose text would be
    read one byte a token, an existing --out (without --overwrite, or one it must not delete: not an artifact), a
    --quantize-block, --attention-bits or --kv-dtype that cannot be."""
    from kvserve.contract.artifact import replace_refusal

    if quantize_block_refusal(args.quantize, args.quantize_block):
        raise UserError(quantize_block_refusal(args.quantize, args.quantize_block))
    if attention_bits_refusal(args.quantize, args.attention_bits):
        raise UserError(attention_bits_refusal(args.quantize, args.attention_bits))
    if (refusal := kv_dtype_refusal(args.kv_dtype, args.dtype, args.kv_cache)) is not None:
        raise UserError(refusal)
    if args.checkpoint is not None:
        checkpoint = Path(args.checkpoint)
        if not checkpoint.is_dir():
            raise UserError(f"{checkpoint}: checkpoint directory not found")
        config = checkpoint / "config.json"
        if not config.is_file():
            raise UserError(f"{config}: missing (a transformers checkpoint directory holds config.json and its weights)")
        try:
            vocab_size = json.loads(config.read_text()).get("vocab_size")
        except (ValueError, AttributeError):
            vocab_size = None  # the loader names what is wrong with it
        if not (checkpoint / "tokenizer.json").is_file() and not args.no_tokenizer and isinstance(vocab_size, int) \
                and vocab_size > BYTE_VOCABULARY:
            raise UserError(f"{checkpoint} has no tokenizer.json: served, its {vocab_size:,}-token model would read text one byte "
                            "a token and answer garbage; copy the checkpoint's tokenizer.json there, or pass --no-tokenizer to "
                            "export it for token-id requests only")
    if not args.out.strip():
        raise UserError("--out is empty: give the artifact directory to write")
    if (refusal := replace_refusal(args.out, args.overwrite)) is not None:
        raise UserError(refusal)


def _export(args) -> int:
    _check_export_paths(args)
    from kvserve.export.parity import format_report
    from kvserve.export.pipeline import export_artifact, load_source

    model, source = load_source(args.preset, args.checkpoint, args.seed)
    report = export_artifact(
        model, source, args.out, dtype=args.dtype, overwrite=args.overwrite, provider=args.provider,
        tokenizer_dir=args.checkpoint, kv_cache=args.kv_cache, quantize=args.quantize, attention=args.attention,
        quantize_block=args.quantize_block, kv_dtype=args.kv_dtype, attention_bits=args.attention_bits,
    )
    print(format_report(report))
    print(f"artifact written to {args.out}")
    return 0


def _verify(args) -> int:
    from kvserve.contract.artifact import PARITY_FILE, open_artifact

    open_artifact(args.artifact, check_files=False)  # a wrong path is refused before torch loads
    if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
        raise UserError(f"{args.checkpoint}: checkpoint directory not found")
    if args.report is not None:  # a report that cannot be written is refused before the run, not after it
        if not args.report.strip():
            raise UserError("--report is empty: give the file to write the report to, or leave it out (the artifact's own)")
        if Path(args.report).is_dir() or not Path(args.report).parent.is_dir():
            raise UserError(f"--report {args.report}: not a file in an existing directory")
    from kvserve.export.parity import format_report, verify, write_report
    from kvserve.export.pipeline import reference_for

    report = verify(args.artifact, reference_for(args.artifact, args.checkpoint), provider=args.provider, steps=args.steps)
    print(format_report(report))
    report_path = Path(args.report) if args.report else Path(args.artifact) / PARITY_FILE
    try:
        write_report(report, report_path)
        print(f"report written to {report_path}")
    except OSError as exc:
        if args.report:
            raise UserError(f"--report {report_path}: {exc.strerror or exc}") from None
        # the artifact's own report, on a read-only volume say: the verdict stands, the file is not rewritten
        print(f"kvserve verify: the report was not written to {report_path} ({exc.strerror or exc}); --report FILE writes it "
              "elsewhere", file=sys.stderr)
    return 0 if report.passed else JobFailed.exit_code


def _serve(args) -> int:
    import asyncio

    # gRPC's own log lines (a taken port's `add_port.cc` error among them) would precede kvserve's one line saying the
    # same; set GRPC_VERBOSITY to see them.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    from kvserve.contract.artifact import prefetch_checksums

    prefetch_checksums(args.model or ".")  # the graph checked before anything listens, the weights before the gate
    from kvserve.service.process.app import serve
    from kvserve.service.core.limits import EngineLimits, declarations, out_of_bounds
    from kvserve.service.process.options import MAX_DRAIN_SECONDS, TRACE_PROTOCOLS, ServerOptions, TraceExport

    def _trace_export(endpoint: str | None, protocol: str):
        if not endpoint:
            return None
        if protocol not in TRACE_PROTOCOLS:  # a KVSERVE_* value is not checked by argparse's choices
            raise UserError(f"--otlp-traces-protocol must be one of {', '.join(TRACE_PROTOCOLS)}, got {protocol!r}")
        if not endpoint.startswith(("http://", "https://")):
            raise UserError(f"--otlp-traces-endpoint must be an http:// or https:// URL, got {endpoint!r}")
        try:  # what the exporter would fail on at load: a bracket left open, a port out of range
            parts = urlsplit(endpoint)
            host, _ = parts.hostname, parts.port
        except ValueError as exc:
            raise UserError(f"--otlp-traces-endpoint {endpoint!r} is not a valid URL ({exc})") from None
        if not host:
            raise UserError(f"--otlp-traces-endpoint {endpoint!r} names no host")
        return TraceExport(endpoint, protocol)

    limits = EngineLimits(**{d.name: getattr(args, d.name) for d in declarations()})
    problem = out_of_bounds(limits)  # a KVSERVE_* value is not checked by argparse, which checks the flags
    if problem is not None:
        raise UserError(problem)
    if not 0 <= args.drain_seconds <= MAX_DRAIN_SECONDS:  # NaN too
        raise UserError(f"--drain-seconds must be in [0, {MAX_DRAIN_SECONDS:g}], got {args.drain_seconds:g}")
    options = ServerOptions(
        artifact=args.model, host=args.host, port=args.port, limits=limits, provider=args.provider, drain_seconds=args.drain_seconds,
        allow_parity_failure=args.allow_parity_failure, metrics_port=args.metrics_port,
        gateway_metrics_port=args.gateway_metrics_port, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca, auth_tokens=args.auth_tokens, reflection=not args.no_reflection,
        health_port=args.health_port, max_context=args.max_context, cuda_graph=args.cuda_graph, http_port=args.http_port,
        split_steps=_split_steps(args.split_steps),
        traces=_trace_export(args.otlp_traces_endpoint, args.otlp_traces_protocol), kv_cache_memory=args.kv_cache_memory,
        kv_events=_zmq_endpoint("--kv-events", args.kv_events), kv_events_replay=_zmq_endpoint("--kv-events-replay", args.kv_events_replay),
        kv_events_topic=args.kv_events_topic,
    )
    if options.kv_events_replay and not options.kv_events:
        raise UserError("--kv-events-replay replays --kv-events: give that too")
    if options.kv_events and not limits.prompt_cache:
        raise UserError("--kv-events publishes the prompt cache's blocks: it needs --prompt-cache on")
    ports = {"--port": options.port, "--metrics-port": options.metrics_port, "--gateway-metrics-port": options.gateway_metrics_port,
             "--health-port": options.health_port, "--http-port": options.http_port}
    for flag, port in ports.items():
        if port is not None and not 0 <= port < 65536:
            raise UserError(f"{flag} must be in [0, 65535], got {port}")
    taken: dict[int, str] = {}
    for flag, port in ports.items():
        if port:  # 0 picks a free port, so zeros never collide
            if port in taken:
                raise UserError(f"{taken[port]} and {flag} are both {port}; give each endpoint a port of its own")
            taken[port] = flag
    return asyncio.run(serve(options))


def _client_security(args):
    from kvserve.service.edges.client import ClientSecurity

    return ClientSecurity(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key, token_file=getattr(args, "token_file", None))


def _generate(args) -> int:
    from kvserve.service.edges.client import stream_generation

    if args.system is not None and not args.chat:
        raise UserError("--system is the conversation's system message: it goes with --chat")
    response_format = next(((kind, value) for kind, value in (("json_schema", args.json_schema), ("json_object", args.json),
                                                               ("regex", args.regex), ("lark_grammar", args.grammar)) if value), None)
    stream_generation(args.target, args.prompt, args.max_new_tokens, args.temperature, args.seed, args.timeout,
                      security=_client_security(args), chat=args.chat, system=args.system, response_format=response_format)
    return 0


def _health(args) -> int:
    from kvserve.service.edges.client import check_health

    status = check_health(args.target, args.wait, security=_client_security(args))
    print(status)
    return 0 if status == "SERVING" else JobFailed.exit_code


def _bounded(kind, low=None, high=None, what=""):
    """An argparse type: kind(value) within [low, high], else argparse's own one-line error and exit 2."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if value != value or (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} is outside {what or f'[{low}, {high}]'}")
        return value

    return parse


# gRPC target schemes taken as they are (gRPC parses the rest); anything else must read HOST:PORT.
TARGET_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:")


def _target(text: str) -> str:
    """An argparse type for --target: HOST:PORT (an IPv6 host in brackets) or a gRPC URI; else one line, exit 2,
    before any connection is tried (an unparseable target would otherwise fail later as UNAVAILABLE)."""
    if text.startswith(TARGET_SCHEMES):
        return text
    host, colon, port = text.rpartition(":")
    if not colon or not host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: the port {port!r} is not a number in [1, 65535]")
    return text


ON_OFF = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False, "": False, "auto": True}


def _on_off(value: str) -> bool:
    parsed = ON_OFF.get(value.strip().lower())
    if parsed is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not on or off")
    return parsed


def size(text: str) -> int:
    """A byte count for --kv-cache-memory (kv_budget.parse_size)."""
    from kvserve.service.process.kv_budget import parse_size

    return parse_size(text)


@dataclass(frozen=True)
class FromEnv:
    """A `serve` flag's default, read from KVSERVE_<name> only once `serve` is the command: a bad variable for `serve`
    never breaks `--help`, `export` or `generate`."""

    name: str
    default: object
    kind: type = str

    def resolve(self):
        return _env(self.name, self.default, self.kind)


SPLIT_STEPS = {"auto": None, "on": True, "off": False}


def _split_steps(value: str) -> bool | None:
    if value not in SPLIT_STEPS:  # a KVSERVE_* value is not checked by argparse's choices
        raise UserError(f"KVSERVE_SPLIT_STEPS={value!r} is not one of {', '.join(SPLIT_STEPS)}")
    return SPLIT_STEPS[value]


def _zmq_endpoint(flag: str, endpoint: str | None) -> str | None:
    """A ZeroMQ endpoint to bind: tcp://HOST:PORT (HOST may be *) or ipc://PATH."""
    if endpoint is None:
        return None
    transport, _, address = endpoint.partition("://")
    if transport == "ipc" and address:
        return endpoint
    host, _, port = address.rpartition(":")
    if transport != "tcp" or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{flag} must be tcp://HOST:PORT (HOST may be *) or ipc://PATH, got {endpoint!r}")
    return endpoint


def _env(name: str, default, kind=str):
    """Defaults for `serve` come from KVSERVE_<FLAG> environment variables (how containers configure it)."""
    value = os.environ.get(f"KVSERVE_{name}")
    if value is None:
        return default
    if kind is bool:
        parsed = ON_OFF.get(value.strip().lower())
        if parsed is None:
            print(f"kvserve: error: KVSERVE_{name}={value!r} is not a valid on/off value (1/0, true/false, yes/no, on/off)", file=sys.stderr)
            sys.exit(UserError.exit_code)
        return parsed
    try:
        return kind(value)
    except ValueError:
        print(f"kvserve: error: KVSERVE_{name}={value!r} is not a valid {kind.__name__}", file=sys.stderr)
        sys.exit(UserError.exit_code)


def _client_security_flags(command) -> None:
    command.add_argument("--tls-ca", help="PEM CA bundle to check the server's certificate with (turns TLS on)")
    command.add_argument("--tls-cert", help="PEM client certificate, for a server that requires one (mTLS)")
    command.add_argument("--tls-key", help="its PEM private key")
    command.add_argument("--token-file", help="a file whose first line is the bearer token to send")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`kvserve CMD: error: ...`) and exit 2, like every other error."""

    def error(self, message: str):
        self.exit(UserError.exit_code, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# model/presets.py's names (the CLI loads no model code to say them; a test holds the two together).
PRESET_NAMES = ("tiny", "gpt2", "tiny-llama", "llama-135m", "qwen3-0.6b", "qwen2.5-0.5b", "gemma3-1b", "phi4-mini-6l")


def build_parser() -> argparse.ArgumentParser:
    from kvserve.service.core.limits import declarations  # plain Python: no runtime loaded
    from kvserve.service.process.options import TRACE_PROTOCOLS

    parser = _Parser(prog="kvserve", description=DESCRIPTION, epilog="kvserve COMMAND --help says more of each command.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    parser.add_argument("--version", action="version", version=f"kvserve {kvserve.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser("export", help="export a checkpoint or preset to a verified ONNX artifact")
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help=f"a built-in config with seeded random weights ({', '.join(PRESET_NAMES)})")
    source.add_argument("--checkpoint", help="a transformers checkpoint directory (config.json + safetensors or .bin weights; model_type "
                                             f"{', '.join(MODEL_TYPES)})")
    export.add_argument("--out", required=True, help="the artifact directory to write")
    export.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                        help="the graph's compute and K/V type: float32 (default; the CPU), float16 (GPU serving)")
    export.add_argument(
        "--kv-cache", choices=("slots", "concat"), default="slots",
        help="KV cache layout: slots (default, what kvserve serves: a row per sequence, chunked prefill) or concat "
        "(present = past + step; Optimum's I/O, for tools that drive the graph themselves; kvserve serve refuses it)",
    )
    export.add_argument(
        "--attention", choices=("auto", "fused", "standard"), default="auto",
        help="a slots graph's attention: fused (ONNX Runtime's GroupQueryAttention, one a layer, two in a step with a "
        "prompt chunk; GPT-2 and the Llama family with "
        "head_dim a multiple of 16), standard (ONNX ops), or auto (default: fused where it runs, except float32 "
        "exported on a CUDA machine, whose fused kernel is float16 only, and float16 K/V in a float32 graph, which the "
        "fused CPU kernel reads at a fifth of the standard graph's speed)",
    )
    export.add_argument(
        "--quantize", choices=QUANTIZATIONS, default=None,
        help="8- or 4-bit weights (MatMulNBits, blocks of 256 (int8) or 128 (int4, whose attention projections, and an untied model's LM head and token table, keep int8's 8 bits) unless "
        "--quantize-block; float32 graph only), verified against "
        "the float32 eager model within the int8 or int4 tolerances (docs/parity.md, \"Int8\" and \"Int4\")",
    )
    export.add_argument("--quantize-block", type=int, default=None, metavar="N",
                        help="weights sharing a scale in --quantize's blocks: a power of 2 from 16 (default 256 for int8, 128 for "
                        "int4's 4-bit weights; smaller follows the weights more closely, larger decodes faster: docs/parity.md, \"Block sizes\")")
    export.add_argument("--attention-bits", type=int, choices=ATTENTION_BITS, default=None,
                        help="with --quantize int4: the attention projections' bits, 8 (default: parity held on small models where 4 "
                        "missed) or 4 (every matrix in 4 bits but an untied LM head, as llama.cpp's Q4_0: 18%% fewer bytes a step and 1.14x llama.cpp's "
                        "batch-1 decode at the Qwen3-4B shape; docs/models.md)")
    export.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                        help="what a slots graph's K/V cache holds: the model's --dtype (default), float16 (half a float32 cache), or "
                        "int8 (a quarter; a scale per layer, K/V head and channel, calibrated at export on held-out text for a "
                        "checkpoint, random ids for a preset); verified against the eager model storing K/V the same way, int8 "
                        "also against float K/V on real text (docs/parity.md, \"K/V dtypes\")")
    export.add_argument("--seed", type=int, default=0, help="weight seed for --preset (default 0)")
    export.add_argument("--overwrite", action="store_true", help="replace an existing artifact directory (only an artifact, or an empty directory: anything else is refused)")
    export.add_argument("--no-tokenizer", action="store_true",
                        help="export a checkpoint that has no tokenizer.json anyway: its artifact takes token ids, and reads "
                        "text one byte a token")
    export.add_argument("--provider", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where the parity check runs the graph (default auto: CUDA if it works, else the CPU)")
    export.set_defaults(run=_export)

    verify = commands.add_parser("verify", help="check an artifact against the eager reference; non-zero on failure")
    verify.add_argument("artifact", help="the artifact directory")
    verify.add_argument("--checkpoint", help="the reference weights (default: the artifact's recorded source)")
    verify.add_argument("--provider", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where the graph runs for the check (default auto: CUDA if it works, else the CPU)")
    verify.add_argument("--steps", type=_bounded(int, 1, None, "[1, what the context allows]"), default=8, help="decode and greedy steps (default 8)")
    verify.add_argument("--report", help="where to write the JSON report (default: ARTIFACT/parity.json)")
    verify.set_defaults(run=_verify)

    serve = commands.add_parser("serve", help="serve an artifact over gRPC, the OpenAI-compatible HTTP API with --http-port and "
                                "Prometheus metrics with --metrics-port (every flag defaults to its KVSERVE_* variable)")
    serve.add_argument("--model", default=FromEnv("MODEL", None), required=_env("MODEL", None) is None, help="the artifact directory [KVSERVE_MODEL]")
    serve.add_argument("--host", default=FromEnv("HOST", "127.0.0.1"), help="address to bind [KVSERVE_HOST] (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=FromEnv("PORT", 50051, int), help="port, 0 picks a free one [KVSERVE_PORT] (default 50051)")
    serve.add_argument("--provider", choices=("auto", "cuda", "cpu"), default=FromEnv("PROVIDER", "auto"), help="[KVSERVE_PROVIDER] (default auto: CUDA if it works)")
    serve.add_argument("--cuda-graph", action="store_true", default=FromEnv("CUDA_GRAPH", False, bool),
                       help="capture decode steps as CUDA graphs, one per (rows, width) shape, at load (standard slots "
                       "graphs on the CUDA provider; elsewhere the server says why not and runs uncaptured) [KVSERVE_CUDA_GRAPH]")
    serve.add_argument("--split-steps", choices=tuple(SPLIT_STEPS), default=FromEnv("SPLIT_STEPS", "auto"),
                       help="run a fused float16 artifact's steps through its chunk graph (a prompt chunk beside decoding rows) and its "
                       "decode graph (every other step) instead of its step graph, whose If a layer CUDA pays for; auto: on the "
                       "CUDA provider [KVSERVE_SPLIT_STEPS] (default auto)")
    serve.add_argument("--drain-seconds", type=float, default=FromEnv("DRAIN_SECONDS", 30.0, float), help="grace period for in-flight streams on SIGTERM, 0 to 86400 [KVSERVE_DRAIN_SECONDS] (default 30)")
    serve.add_argument("--allow-parity-failure", action="store_true", default=FromEnv("ALLOW_PARITY_FAILURE", False, bool), help="serve even if the load-time parity gate fails (loudly) [KVSERVE_ALLOW_PARITY_FAILURE]")
    serve.add_argument("--metrics-port", type=int, default=FromEnv("METRICS_PORT", None, int), help="serve Prometheus metrics on HOST:PORT/metrics [KVSERVE_METRICS_PORT] (default off)")
    serve.add_argument("--gateway-metrics-port", type=int, default=FromEnv("GATEWAY_METRICS_PORT", None, int),
                       help="serve the inference gateway's three gauges alone on HOST:PORT/metrics, plaintext, from a process of "
                       "their own: the port for its endpoint picker's --model-server-metrics-port [KVSERVE_GATEWAY_METRICS_PORT] (default off)")
    for limit in declarations():  # every limit, declared once in service/core/limits.py
        bounds = f"[{limit.low}, {limit.high}]"
        kind = _on_off if limit.is_switch else _bounded(int, limit.low, limit.high, bounds)
        default = FromEnv(limit.name.upper(), limit.default, bool if limit.is_switch else int)
        shown = ("on" if limit.default else "off") if limit.is_switch else f"{limit.default}, in {bounds}"
        serve.add_argument(limit.flag, type=kind, default=default, metavar="on|off" if limit.is_switch else "N",
                           help=f"{limit.help} [{limit.variable}] (default {shown})")
    positive = _bounded(int, 1, 2**31 - 1)
    serve.add_argument("--max-context", type=positive, default=FromEnv("MAX_CONTEXT", None, int),
                       help="prompt + generated tokens one sequence may hold, at most the model's context; sizes every row's "
                       "KV cache [KVSERVE_MAX_CONTEXT] (default: the model's context)")
    serve.add_argument("--kv-cache-memory", type=size, default=FromEnv("KV_CACHE_MEMORY", None, size), metavar="BYTES",
                       help="what the K/V of running sequences and of the prompt cache may take, in bytes or with K, M, G (powers of "
                       "1000) or Ki, Mi, Gi (of 1024), at most 2^63 - 1 bytes; a request waits until its prompt and max_new_tokens fit, and one that never "
                       "could is refused (CPU provider; under CUDA the pool is allocated whole) [KVSERVE_KV_CACHE_MEMORY] "
                       "(default: half the memory the server may use, its container's limit or the machine's)")
    serve.add_argument("--tls-cert", default=FromEnv("TLS_CERT", None), help="PEM certificate chain: TLS on the gRPC port [KVSERVE_TLS_CERT]")
    serve.add_argument("--tls-key", default=FromEnv("TLS_KEY", None), help="its PEM private key [KVSERVE_TLS_KEY]")
    serve.add_argument("--tls-client-ca", default=FromEnv("TLS_CLIENT_CA", None),
                       help="PEM CA bundle: require client certificates it signed (mTLS) [KVSERVE_TLS_CLIENT_CA]")
    serve.add_argument("--auth-tokens", default=FromEnv("AUTH_TOKENS", None),
                       help="file of bearer tokens, one per line, reloaded on SIGHUP: every RPC but health needs one [KVSERVE_AUTH_TOKENS]")
    serve.add_argument("--health-port", type=int, default=FromEnv("HEALTH_PORT", None, int),
                       help="also serve the health service alone, plaintext, on HOST:PORT: for probes that cannot speak TLS "
                       "(Kubernetes' gRPC probes) [KVSERVE_HEALTH_PORT] (default off)")
    serve.add_argument("--http-port", type=int, default=FromEnv("HTTP_PORT", None, int),
                       help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models) on "
                       "HOST:PORT, with the same tokens, TLS and limits [KVSERVE_HTTP_PORT] (default off)")
    serve.add_argument("--no-reflection", action="store_true", default=FromEnv("NO_REFLECTION", False, bool),
                       help="do not serve gRPC reflection [KVSERVE_NO_REFLECTION]")
    serve.add_argument("--otlp-traces-endpoint", default=FromEnv("OTLP_TRACES_ENDPOINT", None), metavar="URL",
                       help="export a trace per request (queue, prefill, decode) to this OpenTelemetry collector: "
                       "http://HOST:4318/v1/traces, or with --otlp-traces-protocol grpc http://HOST:4317 [KVSERVE_OTLP_TRACES_ENDPOINT] "
                       "(default off)")
    serve.add_argument("--otlp-traces-protocol", choices=TRACE_PROTOCOLS, default=FromEnv("OTLP_TRACES_PROTOCOL", "http/protobuf"),
                       help="OTLP's transport for --otlp-traces-endpoint [KVSERVE_OTLP_TRACES_PROTOCOL] (default http/protobuf)")
    serve.add_argument("--kv-events", default=FromEnv("KV_EVENTS", None), metavar="ENDPOINT",
                       help="publish the prompt cache's blocks as KV events for llm-d's precise prefix-cache router on this "
                       "ZeroMQ endpoint, e.g. tcp://*:5557 [KVSERVE_KV_EVENTS] (default off)")
    serve.add_argument("--kv-events-replay", default=FromEnv("KV_EVENTS_REPLAY", None), metavar="ENDPOINT",
                       help="answer subscribers that join late with the last events, on this ZeroMQ endpoint, e.g. tcp://*:5558 "
                       "[KVSERVE_KV_EVENTS_REPLAY] (default off)")
    serve.add_argument("--kv-events-topic", default=FromEnv("KV_EVENTS_TOPIC", None), metavar="TOPIC",
                       help="the events' topic [KVSERVE_KV_EVENTS_TOPIC] (default kv@HOSTNAME@MODEL, the router's)")
    serve.set_defaults(run=_serve)

    generate = commands.add_parser("generate", help="stream a generation from a running server")
    generate.add_argument("prompt", help="the text to continue (with --chat: the user's message)")
    generate.add_argument("--target", type=_target, default="127.0.0.1:50051", help="HOST:PORT of the server (default 127.0.0.1:50051)")
    generate.add_argument("--max-new-tokens", type=_bounded(int, 0, 2**32 - 1), default=64, help="0 = as many as fit (default 64)")
    generate.add_argument("--temperature", type=_bounded(float, 0.0, 1e6), default=0.0, help="0 = greedy (default)")
    generate.add_argument("--seed", type=_bounded(int, 0, 2**64 - 1), default=0, help="0 = chosen by the server")
    generate.add_argument("--chat", action="store_true",
                          help="send the prompt as a user's message in a conversation, rendered by the model's chat template")
    generate.add_argument("--system", help="with --chat: a system message before it")
    structure = generate.add_mutually_exclusive_group()
    structure.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON schema (a .json file)")
    structure.add_argument("--json", action="store_true", help="constrain the output to a JSON object")
    structure.add_argument("--regex", metavar="PATTERN", help="constrain the output to this regular expression")
    structure.add_argument("--grammar", metavar="FILE", help="constrain the output to this Lark grammar (llguidance's syntax)")
    generate.add_argument("--timeout", type=_bounded(float, 0.001, 1e6), default=120.0, help="deadline in seconds (default 120)")
    _client_security_flags(generate)
    generate.set_defaults(run=_generate)

    health = commands.add_parser("health", help="gRPC health check: prints the status, exit 0 only when SERVING")
    health.add_argument("--target", type=_target, default="127.0.0.1:50051", help="HOST:PORT of the server (default 127.0.0.1:50051)")
    health.add_argument("--wait", type=_bounded(float, 0.0, 1e6), default=0.0, help="poll up to this many seconds for SERVING (default 0)")
    _client_security_flags(health)
    health.set_defaults(run=_health)
    return parser


_interrupted = False  # Ctrl-C arrived: whatever a library made of its KeyboardInterrupt, the command ends with 130


def _on_interrupt(signum, frame):
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, and serve's KVSERVE_* variables read for the flags not given, now that serve is the command."""
    args = build_parser().parse_args(argv)
    for name, value in vars(args).items():
        if isinstance(value, FromEnv):
            setattr(args, name, value.resolve())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, _on_interrupt)  # serve's event loop installs its own
    # Our own loggers speak at INFO; libraries (the exporter's passes, grpc) only when something is wrong.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvserve").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if _interrupted:  # torch's exporter once turned Ctrl-C into an AttributeError with a 108-line traceback
            return 130
        if not isinstance(exc, (UserError, OSError)):  # a bug: its traceback
            raise
        print(f"kvserve {args.command}: error: {exc}", file=sys.stderr)  # an OSError's message names the file
        return exc.exit_code if isinstance(exc, UserError) else UserError.exit_code


if __name__ == "__main__":
    sys.exit(main())
