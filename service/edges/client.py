"""`kvserve generate`: a small streaming client, and the request builder the README's snippet mirrors."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvserve.errors import UserError
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class ClientSecurity:
    """How the client proves itself and checks the server: TLS trust, an optional client certificate (mTLS),
    an optional bearer token. All None: plaintext, no token."""

    tls_ca: str | None = None  # PEM CA bundle to trust (the system's when only a client certificate is given)
    tls_cert: str | None = None
    tls_key: str | None = None
    token_file: str | None = None  # its first non-empty line is the token

    def __post_init__(self):
        # An empty path (a script's unset variable, say) is refused: read as "not given", --tls-ca '' would talk
        # plaintext and send the token in the clear.
        paths = {"--tls-ca": self.tls_ca, "--tls-cert": self.tls_cert, "--tls-key": self.tls_key, "--token-file": self.token_file}
        for flag, path in paths.items():
            if path is not None and not path.strip():
                raise UserError(f"{flag} is empty: give a file's path, or leave the flag out")

    @property
    def tls(self) -> bool:
        return any((self.tls_ca, self.tls_cert, self.tls_key))


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UserError(f"{flag} {path}: {exc.strerror or exc}") from None


def open_channel(target: str, security: ClientSecurity = ClientSecurity()) -> grpc.Channel:
    if not security.tls:
        return grpc.insecure_channel(target)
    if (security.tls_cert is None) != (security.tls_key is None):
        raise UserError("--tls-cert and --tls-key go together")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(security.tls_ca, "--tls-ca") if security.tls_ca else None,
        private_key=_read(security.tls_key, "--tls-key") if security.tls_key else None,
        certificate_chain=_read(security.tls_cert, "--tls-cert") if security.tls_cert else None,
    )
    return grpc.secure_channel(target, credentials)


def call_metadata(security: ClientSecurity) -> tuple[tuple[str, str], ...]:
    if security.token_file is None:
        return ()
    lines = [line.strip() for line in _read(security.token_file, "--token-file").decode().splitlines() if line.strip()]
    if not lines:
        raise UserError(f"--token-file {security.token_file}: no token in the file")
    return (("authorization", f"Bearer {lines[0]}"),)


class RequestFailed(UserError):
    """The server refused or failed the request, or nothing answered: the message says which, with the status code.
    Exit 2 where the user can fix it (a bad request, a wrong or silent target), 1 where the server failed."""

    def __init__(self, error: grpc.RpcError, target: str = ""):
        code, details = error.code(), error.details() or ""
        message = f"{code.name}: {details}"
        self.exit_code = 2 if code == grpc.StatusCode.INVALID_ARGUMENT else 1
        if code == grpc.StatusCode.UNAVAILABLE and "HTTP/2" in details:
            message = (f"{target} does not speak gRPC (is it the HTTP API's port? `generate` and `health` use the gRPC port, "
                       f"--port of kvserve serve, 50051 by default)")
            self.exit_code = 2
        elif code == grpc.StatusCode.UNAVAILABLE and ("resolv" in details or "DNS" in details):  # a name DNS does not know
            message = f"{target}: its host name does not resolve ({details})"
            self.exit_code = 2
        elif code == grpc.StatusCode.UNAVAILABLE and any(word in details for word in ("connect", "Connection refused")):
            message = f"nothing answers at {target} (is kvserve serve running there? `kvserve health --target {target} --wait 60` waits for it)"
            self.exit_code = 2
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:  # gRPC says only "Deadline Exceeded"
            message = f"{target} did not answer in time (DEADLINE_EXCEEDED: it accepted the connection and stayed silent, or the " \
                      "request outlasted its deadline, `generate --timeout`)"
        super().__init__(message)
        self.code = code


def stream_generation(
    target: str, prompt: str, max_new_tokens: int, temperature: float, seed: int, timeout: float, out=sys.stdout,
    security: ClientSecurity = ClientSecurity(), chat: bool = False, system: str | None = None,
    response_format: tuple[str, str | bool] | None = None,
) -> dict:
    """Print the text as it streams, then one summary line; return the summary. chat: the prompt is a user's message
    (after a system message, if given), and the reply the assistant's. response_format: (kind, value) with kind a
    ResponseFormat field: json_schema and lark_grammar name a file, regex is the pattern, json_object any value."""
    # batch_tokens: the text is written as it comes either way, in fewer messages when the server has several tokens
    request = pb.GenerateRequest(max_new_tokens=max_new_tokens, sampling=pb.SamplingParams(temperature=temperature, seed=seed),
                                 batch_tokens=True)
    if response_format is not None:
        kind, value = response_format
        if kind == "json_object":
            request.response_format.json_object.SetInParent()
        elif kind == "regex":
            request.response_format.regex = value
        else:
            flag = "--json-schema" if kind == "json_schema" else "--grammar"
            try:
                setattr(request.response_format, kind, _read(value, flag).decode("utf-8"))
            except UnicodeDecodeError:
                raise UserError(f"{flag} {value}: not UTF-8 text") from None
    if chat:
        turns = ([pb.ChatMessage(role="system", content=system)] if system else []) + [pb.ChatMessage(role="user", content=prompt)]
        request.messages.messages.extend(turns)
    else:
        request.text = prompt
    start = time.perf_counter()
    first = None
    tokens = 0
    finish = None
    metadata = call_metadata(security)
    with open_channel(target, security) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        try:
            for response in stub.Generate(request, timeout=timeout, wait_for_ready=False, metadata=metadata):
                # a server older than batch_tokens ignores it: one token a message, in token
                pieces = response.tokens or ([response.token] if response.HasField("token") else [])
                if pieces:
                    tokens += len(pieces)
                    first = first or time.perf_counter()
                    out.write("".join(token.text_delta for token in pieces))
                    out.flush()
                if response.HasField("finish"):
                    finish = response.finish
        except grpc.RpcError as error:
            if tokens:
                out.write("\n")  # end the text streamed so far before the error's line
            raise RequestFailed(error, target) from None
    elapsed = time.perf_counter() - start
    decode = elapsed - (first - start) if first else 0.0
    summary = {
        "tokens": tokens,
        "time_to_first_token_ms": (first - start) * 1e3 if first else None,
        "tokens_per_second": (tokens - 1) / decode if tokens > 1 and decode > 0 else None,
        "finish_reason": pb.FinishReason.Name(finish.reason) if finish else None,
    }
    ttft = f"{summary['time_to_first_token_ms']:.1f} ms" if first else "n/a"
    rate = f"{summary['tokens_per_second']:.1f} tokens/s" if summary["tokens_per_second"] else "n/a"
    reason = summary["finish_reason"].removeprefix("FINISH_REASON_").lower() if finish else "none"
    out.write(f"\n-- {tokens} tokens, time to first token {ttft}, {rate}, finished: {reason}\n")
    return summary


def check_health(
    target: str, wait_seconds: float = 0.0, service: str = "kvserve.v1.GenerationService", security: ClientSecurity = ClientSecurity()
) -> str:
    """Ask the gRPC health service; with wait_seconds, poll until SERVING or the time is up.
    Returns the last status name; raises RequestFailed if the server never answered."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + wait_seconds
    last_error = None
    status = "UNKNOWN"
    with open_channel(target, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
                last_error = None
            except grpc.RpcError as error:
                last_error = error
            if status == "SERVING" or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
    if last_error is not None and status == "UNKNOWN":
        raise RequestFailed(last_error, target)
    return status
