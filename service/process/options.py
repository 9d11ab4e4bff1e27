"""How `kvserve serve` is configured: one dataclass for the server (transport, security, model loading), which
carries the engine's limits (limits.EngineLimits) whole. The command line and KVSERVE_* variables fill it
(kvserve/cli.py); tests build it directly."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.limits import EngineLimits

TRACE_PROTOCOLS = ("http/protobuf", "grpc")  # OTLP's transports, as OTEL_EXPORTER_OTLP_PROTOCOL names them


@dataclass(frozen=True)
class TraceExport:
    """Where request traces go (tracing.py): an OTLP collector (http/protobuf: its URL, .../v1/traces; grpc: its
    host:port, with http:// for plaintext)."""

    endpoint: str
    protocol: str = "http/protobuf"
    service_name: str = "kvserve"


MAX_DRAIN_SECONDS = 86_400.0  # a day: past that a drain is a server that will not stop (Kubernetes kills it first anyway)


@dataclass(frozen=True)
class ServerOptions:
    artifact: str
    host: str = "127.0.0.1"
    port: int = 50051
    provider: str = "auto"
    drain_seconds: float = 30.0
    allow_parity_failure: bool = False
    metrics_port: int | None = None  # Prometheus endpoint on host:metrics_port; None: off, 0: any free port
    # The inference gateway's three gauges alone, answered by a process of their own (gateway_gauges.py); None: off.
    gateway_metrics_port: int | None = None
    limits: EngineLimits = EngineLimits()  # what requests may ask and how the batch runs (limits.py)
    tls_cert: str | None = None  # PEM certificate chain: TLS on the gRPC port
    tls_key: str | None = None  # its PEM private key
    tls_client_ca: str | None = None  # PEM CA bundle: clients must present a certificate it signed (mTLS)
    auth_tokens: str | None = None  # a file of bearer tokens, one per line: every RPC but health needs one
    reflection: bool = True  # server reflection (behind the tokens when they are on)
    # A second, plaintext port that serves only the health service: for probes that cannot speak TLS
    # (Kubernetes' native gRPC probes). None: off.
    health_port: int | None = None
    # Prompt + generated tokens one sequence may hold, at most the model's context; it sizes every row's KV cache.
    # None: the model's whole context (a Llama 3.2's 131,072 columns a row would not fit in memory).
    max_context: int | None = None
    # Capture decode steps as CUDA graphs (standard slots graphs on the CUDA provider); where they cannot run, the
    # server says why (log, GetModelInfo's provider_note) and serves uncaptured.
    cuda_graph: bool = False
    # A fused float16 artifact's steps through its chunk graph and decode graph instead of its step graph (runtime/step.py
    # splits_steps); None: on the CUDA provider, where the artifact has both.
    split_steps: bool | None = None
    # The OpenAI-compatible HTTP API (http_api.py) on host:http_port, beside gRPC; None: off, 0: any free port.
    http_port: int | None = None
    traces: TraceExport | None = None  # a span per request over OTLP; None: off
    # Bytes the K/V of running sequences and of the prompt cache may take (kv_budget.py); None: kv_budget.DEFAULT_SHARE
    # of the memory the server may use. The CPU provider only: under CUDA the pool is allocated whole.
    kv_cache_memory: int | None = None
    # The prompt cache's changes as KV events for llm-d's router (kv_events.py): a ZeroMQ endpoint to publish on
    # (tcp://*:5557), the replay endpoint late subscribers ask (None: no replay), the topic (None: kv@HOST@MODEL).
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str | None = None
