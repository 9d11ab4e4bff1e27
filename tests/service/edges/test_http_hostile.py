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

from kvserve.service.edges import http_connections

from ..conftest import serving, slow_down, wait_for

MODEL = "tiny-chat"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TIMEOUTS = dict(header_timeout_seconds=1, body_timeout_seconds=1, idle_timeout_seconds=2, max_connections=1000)


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
    (with_fields(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": 1, "function": "f"}]}]), "messages[0].tool_calls",
     "must be {\"id\""),
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
    # a slash too many: no redirect (a 307 is no OpenAI error, and its Location comes from the Host header) but the path meant
    slashed = refused(httpx.post(f"{base}/v1/chat/completions/", json=CHAT), 404)
    assert slashed["code"] == "not_found" and slashed["message"].endswith("without the trailing slash, /v1/chat/completions")
    assert "/v1/responses" in refused(httpx.get(f"{base}/v1/nowhere"), 404)["message"]  # every route named


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def enough_descriptors(count: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(count, hard), hard))


def closed_within(sockets: list, seconds: float) -> bool:
    """Every socket sees the server close it (EOF or reset) before the time is up."""
    deadline = time.monotonic() + seconds
    for sock in sockets:
        while True:  # what the server says first (gRPC's HTTP/2 settings) is read past
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                if sock.recv(4096) == b"":
                    break
            except ConnectionResetError:
                break
            except (TimeoutError, socket.timeout):
                return False
    return True


def test_idle_connections_and_stalled_uploads_are_closed_within_the_timeouts(hostile, caplog):
    """500 idle connections and 200 stalled uploads on the HTTP port (headers that never end, bodies that stop), and 200
    idle connections on the gRPC port (no handshake), all held by the clients: each is closed by the server within its
    declared timeout, the descriptors go back to where they were, the server still serves, and nothing is a traceback."""
    enough_descriptors(4096)
    port, grpc_port, before = hostile.app.http_port, hostile.port, open_fds()
    start = time.monotonic()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(500)]  # send nothing
    stalled = []
    for index in range(200):
        sock = socket.create_connection(("127.0.0.1", port))
        if index % 2:  # the headers never end
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        else:  # the body stops early
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100000\r\n\r\n{\"model\": ")
        stalled.append(sock)
    silent_grpc = [socket.create_connection(("127.0.0.1", grpc_port)) for _ in range(200)]
    opened = time.monotonic() - start
    # header and body timeouts 1 s, from when each opened or sent its headers; the slack is the loop's and the test's
    assert closed_within(idle + stalled + silent_grpc, opened + 1 + 3)
    for sock in idle + stalled + silent_grpc:
        sock.close()
    assert wait_for(lambda: open_fds() <= before + 2, timeout=10), (open_fds(), before)
    assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200  # still serving
    assert "Traceback" not in caplog.text and "Exception in ASGI application" not in caplog.text
    assert "no whole request headers within 1s" in caplog.text and "no whole request body within 1s" in caplog.text


def test_connections_beyond_the_limit_are_refused_as_openai_errors(tiny_chat_artifact, monkeypatch):
    """Eight connections that are not stalled yet (a stall is an hour here): a ninth is refused 503."""
    monkeypatch.setattr(http_connections, "STALLED_SECONDS", 3600.0)
    with serving(tiny_chat_artifact, http_port=0, max_connections=8) as server:
        held = [socket.create_connection(("127.0.0.1", server.app.http_port)) for _ in range(8)]
        surplus = socket.create_connection(("127.0.0.1", server.app.http_port))
        surplus.settimeout(5)
        reply = surplus.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503") and b"too_many_connections" in reply and b"--max-connections" in reply
        for sock in held + [surplus]:
            sock.close()
        # the held ones gone, a client is served again
        assert wait_for(lambda: httpx.post(f"http://127.0.0.1:{server.app.http_port}/v1/chat/completions", json=CHAT,
                                           timeout=30).status_code == 200, timeout=10)


def test_a_client_leaving_mid_body_is_one_log_line(hostile, caplog):
    sock = socket.create_connection(("127.0.0.1", hostile.app.http_port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 5000\r\n\r\n{")
    time.sleep(0.2)
    sock.close()
    assert wait_for(lambda: "left before its answer started" in caplog.text, timeout=5)
    assert "Traceback" not in caplog.text and "ClientDisconnect" not in caplog.text


def chat_seconds(port: int) -> float:
    started = time.monotonic()
    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 200, response.text
    return time.monotonic() - started


def test_one_address_holding_the_cap_with_stalled_uploads_and_idle_connections_locks_no_one_out(tiny_chat_artifact, caplog, monkeypatch):
    """20 stalled uploads and 44 idle connections from one address fill the cap (timeouts far off, so only shedding
    frees a slot): a chat completion is admitted by closing the longest-waiting of them and served; a stream in flight
    is never the one closed. (Its time beside them against alone, at the default cap with 200 stalled uploads and 500
    idle connections, is measured by hand, not asserted: a timing assertion fails beside other work.)"""
    slow = dict(header_timeout_seconds=60, body_timeout_seconds=60, idle_timeout_seconds=60)
    with serving(tiny_chat_artifact, http_port=0, max_connections=65, **slow) as server:
        port = server.app.http_port
        slow_down(monkeypatch, server.app, 0.05)  # 200 tokens take 10 s at least: the stream is running throughout
        monkeypatch.setattr(http_connections, "STALLED_SECONDS", 0.0)  # every held one stalled or idle at once: no wait
        stream = httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                              json={**CHAT, "max_tokens": 200, "stream": True, "ignore_eos": True})
        response = stream.__enter__()
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # streaming: a request being answered
        held = []
        for index in range(64):
            sock = socket.create_connection(("127.0.0.1", port))
            if index < 20:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"content-length: 100000\r\n\r\n{\"model\": ")
            held.append(sock)
        for _ in range(3):
            chat_seconds(port)  # admitted and answered
        assert sum(closed_within([sock], 0.05) for sock in held) == 1  # one shed: the first chat's slot, freed for the rest
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"  # the stream ran on to its end
        stream.__exit__(None, None, None)
        for sock in held:
            sock.close()
    assert "to admit a new one at the connection limit" in caplog.text


def test_one_address_past_its_own_limit_sheds_its_own_connections(tiny_chat_artifact, monkeypatch):
    monkeypatch.setattr(http_connections, "STALLED_SECONDS", 3600.0)
    with serving(tiny_chat_artifact, http_port=0, max_connections=100, max_connections_per_address=4) as server:
        port = server.app.http_port
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        surplus = socket.create_connection(("127.0.0.1", port))  # none of the four stalled yet: refused
        surplus.settimeout(5)
        assert surplus.recv(4096).startswith(b"HTTP/1.1 503")
        surplus.close()
        monkeypatch.setattr(http_connections, "STALLED_SECONDS", 0.0)  # now all four are
        chat_seconds(port)  # admitted: the oldest of the four closed for it
        assert closed_within(held[:1], 1) and not closed_within(held[1:], 0.2)
        for sock in held:
            sock.close()
