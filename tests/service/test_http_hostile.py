"""The HTTP edge against a hostile or careless client: every malformed body a 4xx OpenAI error naming what is wrong
(never a traceback or a 500), fields kvserve does not implement refused by name, only JSON read, and every wait on a
client bounded: idle connections, stalled headers and stalled bodies closed within the declared timeouts, connections
beyond the limit refused, file descriptors back where they were, and no traceback logged."""

import json
import os
import socket
import time

import httpx2 as httpx
import pytest

from .conftest import serving, wait_for

MODEL = "tiny-chat"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TIMEOUTS = dict(header_timeout_seconds=1, body_timeout_seconds=1, idle_timeout_seconds=2, max_connections=64)


@pytest.fixture(scope="module")
def hostile(tiny_chat_artifact):
    with serving(tiny_chat_artifact, http_port=0, **TIMEOUTS) as server:
        yield server


def post(server, body: bytes | str, content_type: str = "application/json", path: str = "/v1/chat/completions") -> httpx.Response:
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    return httpx.post(f"http://127.0.0.1:{server.app.http_port}{path}", content=data, headers={"content-type": content_type},
                      timeout=30)


def refused(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"], error
    return error


def with_fields(**fields) -> str:
    return json.dumps({**CHAT, **fields})


@pytest.mark.parametrize("body, param, words", [
    ("[" * 100_000 + "]" * 100_000, None, "nests deeper than 64"),
    (with_fields(response_format="SCHEMA").replace('"SCHEMA"', '{"type": "json_schema", "json_schema": {"name": "x", "schema": '
                                                    + "[" * 990 + "]" * 990 + "}}"), None, "nests deeper than 64"),  # deeper than the parser goes: the body's
    (with_fields(messages=[{"role": "user", "content": "a\\ud800b"}]).replace("\\\\ud800", "\\ud800"), "messages", "lone surrogate"),
    ('{"model": "tiny-chat", "\\ud800": 1}', None, "not valid Unicode"),
    ('{"model": "tiny-chat", "messages": [{"role": "user", "content": "' + "\ud83d\ude00".encode("utf-16", "surrogatepass").decode(
        "utf-16").encode("utf-8").decode() + '"}], "max_tokens": 2}', None, None),  # a real emoji: served (checked below)
    (with_fields(max_tokens=int("9" * 400)), "max_tokens", "max_tokens must be in"),
    (with_fields(n=int("9" * 400)), "n", "n must be in"),
    (with_fields(seed=int("9" * 400)), "seed", "seed must be in"),
    (with_fields(logprobs=True, top_logprobs=int("9" * 400)), "top_logprobs", "top_logprobs must be in"),
    (with_fields(logit_bias={"9" * 400: 1}), "logit_bias", "token ids"),
    (with_fields(logit_bias={"²": 1}), "logit_bias", "token ids"),
    (with_fields(logit_bias={"①": 1}), "logit_bias", "token ids"),
    (with_fields(logit_bias={"11": 500}), "logit_bias", "logit_bias must be in [-100, 100]"),
    (with_fields(messages=[{"role": "assistant", "content": None, "tool_calls": []}]), "messages[0].tool_calls", "not supported"),
    (with_fields(messages=[{"role": "assistant", "content": "x", "function_call": {}}]), "messages[0].function_call", "not supported"),
    (with_fields(messages=[{"role": "user", "content": "x", "frobnicate": 1}]), "messages[0].frobnicate", "not supported"),
    (with_fields(stream=True, stream_options={"include_usage": "false"}), "stream_options.include_usage", "true or false"),
    (with_fields(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage", "true or false"),
    (with_fields(logprobs=1), "logprobs", "true or false"),
    (with_fields(max_tokens=10**6), "max_tokens", "max_tokens: "),  # the engine's refusal, in the OpenAI parameter's name
], ids=["deep body", "deep schema", "escaped surrogate", "surrogate key", "emoji", "huge max_tokens", "huge n", "huge seed",
        "huge top_logprobs", "huge bias key", "superscript key", "circled key", "bias value", "tool_calls", "function_call",
        "unknown message field", "include_usage string", "include_usage 1", "logprobs 1", "max_tokens too large"])
def test_a_malformed_body_is_a_400_naming_what_is_wrong(hostile, body, param, words):
    response = post(hostile, body)
    if words is None:
        assert response.status_code == 200, response.text
        return
    error = refused(response)
    assert error["param"] == param and words in error["message"], error
    assert "max_new_tokens" not in error["message"]


def test_cesu8_surrogates_and_invalid_utf8_are_refused(hostile):
    cesu = b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "\xed\xa0\xbd\xed\xb8\x80"}], "max_tokens": 2}'
    assert "not valid Unicode" in refused(post(hostile, cesu))["message"]
    assert "not JSON" in refused(post(hostile, b'{"model": "\xff"}'))["message"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""])
def test_only_json_is_read(hostile, content_type):
    """A browser sends these cross-origin without asking first; application/json needs a preflight this API never answers."""
    error = refused(post(hostile, with_fields(), content_type), 415)
    assert error["code"] == "unsupported_media_type"
    assert post(hostile, with_fields(), "application/json; charset=utf-8").status_code == 200


def test_unrouted_paths_and_wrong_methods_are_openai_errors(hostile):
    base = f"http://127.0.0.1:{hostile.app.http_port}"
    assert refused(httpx.get(f"{base}/v1/nowhere"), 404)["code"] == "not_found"
    assert refused(httpx.get(f"{base}/v1/chat/completions"), 405)["code"] == "method_not_allowed"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_idle_stalled_and_surplus_connections_are_closed_within_the_timeouts(hostile, caplog):
    port, before = hostile.app.http_port, open_fds()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]  # send nothing
    stalled_headers = []
    for _ in range(10):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # the headers never end
        stalled_headers.append(sock)
    stalled_bodies = []
    for _ in range(10):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100000\r\n\r\n{\"model\": ")  # the body stops here
        stalled_bodies.append(sock)
    surplus = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]  # 70 open: 6 over the limit of 64
    refusals = 0
    for sock in surplus:
        sock.settimeout(5)
        reply = sock.recv(4096)
        refusals += reply.startswith(b"HTTP/1.1 503") and b"too_many_connections" in reply
    assert refusals >= 6

    def closed(sock) -> bool:
        sock.settimeout(5)
        try:
            return sock.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            return False

    start = time.monotonic()
    assert all(closed(sock) for sock in idle + stalled_headers + stalled_bodies)
    assert time.monotonic() - start < 4  # each within its 1 s deadline (and the slack of the loop)
    for sock in idle + stalled_headers + stalled_bodies + surplus:
        sock.close()
    assert wait_for(lambda: open_fds() <= before + 2, timeout=10), (open_fds(), before)
    assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200  # still serving
    assert "Traceback" not in caplog.text and "Exception in ASGI application" not in caplog.text


def test_a_client_leaving_mid_body_is_one_log_line(hostile, caplog):
    sock = socket.create_connection(("127.0.0.1", hostile.app.http_port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 5000\r\n\r\n{")
    time.sleep(0.2)
    sock.close()
    assert wait_for(lambda: "left before its answer started" in caplog.text, timeout=5)
    assert "Traceback" not in caplog.text and "ClientDisconnect" not in caplog.text
