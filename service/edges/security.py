"""Who may talk to the server: TLS (or mutual TLS) on the gRPC port, and bearer tokens checked on every RPC.

Credentials live at the edge, the handlers never see them (gRPC's examples/python/auth). Tokens come from a
file, one per line (blank lines and # comments ignored), reloaded on SIGHUP; each call's
`authorization: Bearer TOKEN` is compared with every token in constant time, so neither a token nor how
much of one matched shows in the timing. The health service stays open for probes. No token reaches a log.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path

import grpc

from kvserve.errors import UserError

from ..core.limits import MAX_METADATA_BYTES

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class SecurityConfigError(UserError):
    """A TLS or token file that cannot be used; the message names the file and the flag."""


def _read(path: str, flag: str) -> bytes:
    if not path.strip():  # an empty KVSERVE_ variable, say: refused, never read as "off" (a server open to anyone)
        raise SecurityConfigError(f"{flag} is empty: give a file's path, or leave out the flag and its KVSERVE_ variable")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{flag} {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise SecurityConfigError(f"{flag} {path}: the file is empty")
    return data


def server_credentials(cert: str | None, key: str | None, client_ca: str | None) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port, or None for plaintext. client_ca requires client certificates."""
    if cert is None and key is None:
        if client_ca is not None:
            raise SecurityConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise SecurityConfigError("--tls-cert and --tls-key go together")
    pair = (_read(key, "--tls-key"), _read(cert, "--tls-cert"))
    ca = _read(client_ca, "--tls-client-ca") if client_ca is not None else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


class TokenFile:
    """The accepted tokens, read from a file; reload() swaps them in place (SIGHUP)."""

    def __init__(self, path: str):
        self.path = path
        self._tokens: tuple[bytes, ...] = ()
        self.reload()

    def reload(self) -> None:
        lines = _read(self.path, "--auth-tokens").decode("utf-8", errors="replace").splitlines()
        tokens: list[bytes] = []
        for number, line in enumerate(lines, 1):
            token = line.strip().encode()
            if not token or token.startswith(b"#"):
                continue
            # gRPC metadata and HTTP headers carry printable ASCII alone: any other token could never be presented
            if not all(0x21 <= byte <= 0x7E for byte in token):
                raise SecurityConfigError(f"--auth-tokens {self.path}: line {number} holds a space or a character that is not "
                                          "printable ASCII, which no client can send as a bearer token")
            tokens.append(token)
        if not tokens:
            raise SecurityConfigError(f"--auth-tokens {self.path}: no tokens in the file")
        self._tokens = tuple(tokens)
        log.info("auth tokens loaded from %s: %d", self.path, len(tokens))  # how many, never which

    def refusal(self, authorization: str) -> str | None:
        """Why a call whose authorization header (gRPC metadata or HTTP) is this is refused; None when its bearer token
        is accepted. The one check both transports make."""
        scheme, _, presented = authorization.partition(" ")
        if not authorization:
            return "no authorization metadata or header: send 'authorization: Bearer TOKEN'"
        if scheme.lower() != "bearer" or not presented.strip():
            return "the authorization is not 'Bearer TOKEN'"
        if not self.accepts(presented.strip().encode()):
            return "the bearer token is not valid"
        return None

    def accepts(self, presented: bytes) -> bool:
        matched = False
        for token in self._tokens:  # every token compared, always: the time says nothing about which matched
            matched |= hmac.compare_digest(token, presented)
        return matched


def _refusing(handler, code: grpc.StatusCode, message: str):
    """A handler of the same kind as handler that only ends the call with code."""

    async def refuse_unary(request, context):
        await context.abort(code, message)

    async def refuse_stream(request, context):
        await context.abort(code, message)
        yield  # an async generator, as the streaming handler it replaces

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse_unary, **kwargs)


def metadata_bytes(metadata) -> int:
    """A call's metadata size as HTTP/2 (and gRPC's limit) counts it: name + value + 32 bytes an entry."""
    return sum(len(key) + len(value) + 32 for key, value in metadata or ())


class MetadataLimitInterceptor(grpc.aio.ServerInterceptor):
    """RESOURCE_EXHAUSTED, with the size and the limit, for a call whose metadata exceeds limits.MAX_METADATA_BYTES;
    first, so auth never parses an oversized header list."""

    def __init__(self, metrics=None):
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        size = metadata_bytes(details.invocation_metadata)
        if handler is None or size <= MAX_METADATA_BYTES:
            return handler
        reason = (f"the call's metadata is {size} bytes in {len(details.invocation_metadata)} entries "
                  f"(name + value + 32 an entry); at most {MAX_METADATA_BYTES}")
        if self.metrics is not None:
            self.metrics.on_request(details.method, "RESOURCE_EXHAUSTED")
        log.info("%s refused: RESOURCE_EXHAUSTED: %s", details.method, reason)
        return _refusing(handler, grpc.StatusCode.RESOURCE_EXHAUSTED, reason)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED, with a one-line reason and counted in the metrics, for any call but a health check
    that lacks an accepted bearer token (reflection included, when it is served)."""

    def __init__(self, tokens: TokenFile | None, metrics=None):
        self.tokens, self.metrics = tokens, metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or self.tokens is None or method.startswith(HEALTH_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        header = metadata.get("authorization", "")
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        reason = self.tokens.refusal(header)
        if reason is None:
            return handler
        if self.metrics is not None:
            self.metrics.on_request(method, "UNAUTHENTICATED")
        log.info("%s refused: UNAUTHENTICATED: %s", method, reason)
        return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, reason)
