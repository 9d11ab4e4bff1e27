"""The OpenAI-compatible HTTP API against a real server, through the official `openai` client (and raw HTTP where the
client hides what is tested): chat and completions, streamed and whole, usage, log-probabilities, stop, seeds, the
same tokens as gRPC, refusals with the right status naming the parameter, tokens, and a disconnect freeing its row."""

import httpx2 as httpx  # openai 3 brings it (the httpx API under another name)
import openai
import pytest

from kvserve.v1 import generation_pb2 as pb

from ..conftest import collect, live, serving, slow_down, stub_of, wait_for


@pytest.fixture(scope="module")
def chat_artifact(tiny_chat_artifact):
    return tiny_chat_artifact


@pytest.fixture(scope="module")
def running(chat_artifact):
    with serving(chat_artifact, http_port=0, max_batch_size=2, max_queue=0, max_message_bytes=4096) as server:
        yield server


@pytest.fixture(scope="module")
def client(running):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{running.app.http_port}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def stub(running):
    with stub_of(running) as client:
        yield client


MODEL = "tiny-chat"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who was Moses?"}]


def grpc_chat(stub, max_new_tokens: int, **fields):
    conversation = pb.Conversation(messages=[pb.ChatMessage(**m) for m in MESSAGES])
    return collect(stub, pb.GenerateRequest(messages=conversation, max_new_tokens=max_new_tokens, **fields))


def test_models_and_health(client, running):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"http://127.0.0.1:{running.app.http_port}/health").json() == {"status": "serving"}


def test_chat_whole_and_streamed_equal_grpc_with_usage(client, stub):
    ids, text, finish = grpc_chat(stub, 12)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == {pb.FINISH_REASON_LENGTH: "length"}.get(finish.reason, "stop")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (finish.prompt_tokens, len(ids))
    assert whole.usage.total_tokens == finish.prompt_tokens + len(ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
                                                  stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(ids) and not chunks[-1].choices


def test_completions_text_and_token_ids_whole_and_streamed(client, stub):
    ids, text, finish = collect(stub, pb.GenerateRequest(text="In the beginning", max_new_tokens=10))
    whole = client.completions.create(model=MODEL, prompt="In the beginning", max_tokens=10, temperature=0)
    assert whole.choices[0].text == text and whole.usage.completion_tokens == len(ids)
    streamed = client.completions.create(model=MODEL, prompt="In the beginning", max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text
    by_ids = client.completions.create(model=MODEL, prompt=list(b"In the beginning"), max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == text


def test_log_probabilities_equal_grpcs(client, stub):
    ids, _, _ = grpc_chat(stub, 6, return_logprobs=True)
    wanted = [r.token.logprob for r in stub.Generate(pb.GenerateRequest(
        messages=pb.Conversation(messages=[pb.ChatMessage(**m) for m in MESSAGES]), max_new_tokens=6, return_logprobs=True))]
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True)
    # the later request may take the earlier one's prompt from the prompt cache and compute only its last token: the
    # same numbers within float32 rounding (the parity bound), not necessarily to the bit on every CPU
    assert [entry.logprob for entry in got.choices[0].logprobs.content] == pytest.approx(wanted, abs=1e-4)
    completion = client.completions.create(model=MODEL, prompt="Moses", max_tokens=4, temperature=0, logprobs=1)
    assert len(completion.choices[0].logprobs.token_logprobs) == 4


def test_n_completions_of_one_prompt_each_with_its_own_seed(client, stub):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11, n=2)
    assert [c.index for c in whole.choices] == [0, 1]
    texts = [c.message.content for c in whole.choices]
    assert texts[0] != texts[1]  # two seeds, two samples (the batch has 2 rows: n=3 would be 429 here)
    assert whole.usage.completion_tokens == 16 and whole.usage.prompt_tokens == grpc_chat(stub, 1)[2].prompt_tokens
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11, n=2)
    assert [c.message.content for c in again.choices] == texts
    streamed = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11, n=2, stream=True))
    assert ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i) for i in range(3 - 1)] == texts
    assert sorted(c.choices[0].index for c in streamed if c.choices and c.choices[0].finish_reason) == [0, 1]


def test_penalties_bias_and_alternatives_equal_grpcs(client, stub):
    options = dict(presence_penalty=0.7, frequency_penalty=0.4, logit_bias={"101": 5.0})
    ids, text, _ = collect(stub, pb.GenerateRequest(text="In the beginning", max_new_tokens=10, sampling=pb.SamplingParams(
        presence_penalty=0.7, frequency_penalty=0.4, logit_bias={101: 5.0})))
    assert client.completions.create(model=MODEL, prompt="In the beginning", max_tokens=10, temperature=0, **options).choices[0].text == text
    wanted = [list(r.token.top_logprobs) for r in stub.Generate(pb.GenerateRequest(
        messages=pb.Conversation(messages=[pb.ChatMessage(**m) for m in MESSAGES]), max_new_tokens=4, return_logprobs=True, top_logprobs=3))]
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    for entry, alternatives in zip(got.choices[0].logprobs.content, wanted):
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [(a.text, pytest.approx(a.logprob, abs=1e-4)) for a in alternatives]
    completion = client.completions.create(model=MODEL, prompt="Moses", max_tokens=3, temperature=0, logprobs=2)
    assert all(len(top) <= 2 for top in completion.choices[0].logprobs.top_logprobs)


def test_a_seed_repeats_its_tokens_and_stop_ends_the_text(client):
    def sampled(seed):
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=seed).choices[0].message.content

    assert sampled(5) == sampled(5)
    assert len({sampled(seed) for seed in (1, 2, 3, 4)}) > 1
    greedy = client.completions.create(model=MODEL, prompt="And", max_tokens=12, temperature=0).choices[0].text
    stop = greedy[3:5]
    stopped = client.completions.create(model=MODEL, prompt="And", max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].text == greedy[: greedy.index(stop)] and stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("options, param", [
    ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"n": 9}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"), ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"extra_body": {"mirostat": 1}}, "mirostat"), ({"stop": [""]}, "stop"), ({"response_format": {"type": "xml"}}, "response_format"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ({"max_tokens": 10**6}, "max_tokens"), ({"messages": [{"role": "", "content": "x"}]}, "messages"),
])
def test_each_bad_or_unsupported_option_is_a_400_naming_it(client, options, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, **{"messages": MESSAGES, **options})
    assert error.value.status_code == 400 and error.value.body["param"] == param, error.value.body


def test_another_model_is_404_and_a_model_without_a_template_refuses_chat(client, tiny_artifact):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    with serving(tiny_artifact, http_port=0) as plain:
        other = openai.OpenAI(base_url=f"http://127.0.0.1:{plain.app.http_port}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            other.chat.completions.create(model="tiny", messages=MESSAGES)


def test_a_body_over_the_message_limit_is_413(running):
    response = httpx.post(f"http://127.0.0.1:{running.app.http_port}/v1/completions", json={"model": MODEL, "prompt": "x" * 5000})
    assert response.status_code == 413 and "at most 4096" in response.json()["error"]["message"]


def test_a_full_queue_is_429_and_a_client_that_leaves_frees_its_row(client, running, stub, monkeypatch):
    slow_down(monkeypatch, running.app, 0.05)  # 200 tokens take 10 s: the streams are surely mid-generation
    url = f"http://127.0.0.1:{running.app.http_port}/v1/completions"
    eos = {str(token): -100 for token in running.app.artifact.config.eos_token_ids}  # 200 tokens, never an early end
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "temperature": 0, "stream": True, "logit_bias": eos}
    assert wait_for(lambda: live(stub).active_sequences == 0)  # the earlier tests' rows are free (max_queue is 0)
    with httpx.Client(timeout=60) as one, httpx.Client(timeout=60) as two:
        with one.stream("POST", url, json=body) as first, two.stream("POST", url, json=body) as second:
            assert (first.status_code, second.status_code) == (200, 200)
            readers = [first.iter_lines(), second.iter_lines()]  # kept: a dropped reader closes its response
            next(readers[0]), next(readers[1])  # both rows busy
            assert live(stub).active_sequences == 2
            with pytest.raises(openai.RateLimitError):  # max_queue 0: nobody waits
                client.completions.create(model=MODEL, prompt="y", max_tokens=2)
        # both streams closed mid-generation
    assert wait_for(lambda: live(stub).active_sequences == 0, timeout=5)  # well before the 10 s they would have run
    with pytest.raises(httpx.ReadTimeout):  # a whole (not streamed) answer the client stops waiting for
        httpx.post(url, json={**body, "stream": False}, timeout=1.0)
    assert wait_for(lambda: live(stub).active_sequences == 0, timeout=5)


def test_tokens_are_required_when_the_server_has_them(chat_artifact, tmp_path):
    (tmp_path / "tokens").write_text("s3cret\n")
    with serving(chat_artifact, http_port=0, auth_tokens=str(tmp_path / "tokens")) as server:
        base = f"http://127.0.0.1:{server.app.http_port}"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
        assert [m.id for m in openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0).models.list()] == [MODEL]
        assert httpx.get(base + "/health").status_code == 200  # probes need no token


def test_the_http_port_serves_the_grpc_ports_tls_certificate(chat_artifact, pki):
    with serving(chat_artifact, http_port=0, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key")) as server:
        base = f"https://127.0.0.1:{server.app.http_port}"
        import ssl

        trusted = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, http_client=httpx.Client(verify=trusted))
        assert client.completions.create(model=MODEL, prompt="a", max_tokens=2, temperature=0).usage.completion_tokens == 2
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.get(base + "/health")
        with pytest.raises(httpx.HTTPError):  # plaintext on the TLS port
            httpx.get(f"http://127.0.0.1:{server.app.http_port}/health", timeout=5)


def test_while_loading_the_api_answers_503_and_health_says_not_serving(chat_artifact):
    with serving(chat_artifact, load=False, http_port=0) as server:
        base = f"http://127.0.0.1:{server.app.http_port}"
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and health.json()["status"] == "not serving"
        with pytest.raises(openai.InternalServerError) as error:
            openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0).completions.create(model=MODEL, prompt="a")
        assert error.value.status_code == 503 and "still loading" in error.value.body["message"]


def test_what_vllms_bench_serve_sends_is_served(client):
    """vLLM's `bench serve` on random data: completions streamed with usage, ignore_eos so every request runs to
    max_tokens; genai-perf adds min_tokens the same way."""
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0.0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "min_tokens": 12, "top_k": -1, "repetition_penalty": 1.0,
                                                   "skip_special_tokens": True, "include_stop_str_in_output": False})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


# The bodies genai-perf and its successor aiperf build with their OpenAI backends' defaults, as their converters write them
# (genai-perf: inputs/converters/openai_{chat_completions,completions}_converter.py, `--streaming`, `--output-tokens-mean`
# and `--extra-inputs`; aiperf: src/aiperf/endpoints/openai_{chat,completions}.py, which sends "stream" either way,
# max_completion_tokens for chat, text parts, and stream_options.include_usage with a stream).
BENCHMARK_TOOL_BODIES = {
    "genai-perf chat": {"model": MODEL, "messages": [{"role": "user", "content": "In the beginning"}], "stream": True,
                        "max_tokens": 5, "ignore_eos": True, "min_tokens": 5},
    "genai-perf completions": {"model": MODEL, "prompt": ["In the beginning"], "stream": True, "max_tokens": 5, "ignore_eos": True},
    "aiperf chat": {"messages": [{"role": "user", "content": [{"type": "text", "text": "In the beginning"}]}], "model": MODEL,
                    "stream": False, "max_completion_tokens": 5, "ignore_eos": True},
    "aiperf chat streamed": {"messages": [{"role": "system", "content": "Answer."}, {"role": "user", "content": "In the beginning"}],
                             "model": MODEL, "stream": True, "max_completion_tokens": 5, "stream_options": {"include_usage": True},
                             "ignore_eos": True},
    "aiperf completions": {"prompt": ["In the beginning"], "model": MODEL, "stream": True, "max_tokens": 5,
                           "stream_options": {"include_usage": True}, "ignore_eos": True},
}


@pytest.mark.parametrize("tool", sorted(BENCHMARK_TOOL_BODIES))
def test_what_genai_perf_and_aiperf_send_is_served(running, tool):
    import json as json_module

    body = BENCHMARK_TOOL_BODIES[tool]
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    reply = httpx.post(f"http://127.0.0.1:{running.app.http_port}{path}", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    if not body["stream"]:
        assert reply.json()["usage"]["completion_tokens"] == 5
        return
    chunks = [json_module.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    assert reply.text.rstrip().endswith("data: [DONE]")
    pieces = [c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or "" for c in chunks if c["choices"]]
    assert len([p for p in pieces if p]) >= 1
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert finishes == ["length"]  # ignore_eos: every request runs to its max tokens
    if "stream_options" in body:
        assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_tokens_ready_together_stream_in_one_chunk_with_the_same_text(client):
    """A schema that leaves the model no choice: its drafts are taken in a step or two, and their tokens go out in one
    chunk; the text and usage are the whole answer's."""
    forced = {"type": "json_schema", "json_schema": {"name": "forced", "schema": {"const": "kvserve sends what it has"}}}
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0, response_format=forced)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0, stream=True,
                                                  response_format=forced, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole.choices[0].message.content == '"kvserve sends what it has"'
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens > len(pieces)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(running):
    import json as json_module

    body = {"model": MODEL, "prompt": "In the beginning", "max_tokens": 6, "temperature": 0, "stream": True, "logprobs": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    lines = httpx.post(f"http://127.0.0.1:{running.app.http_port}/v1/completions", json=body, timeout=60).text.splitlines()
    chunks = [json_module.loads(line[6:]) for line in lines if line.startswith("data: {")]
    counted = [c["usage"]["completion_tokens"] for c in chunks]
    # the tokens so far in each chunk (vLLM's continuous_usage_stats: a chunk carries the tokens ready together, a token
    # mostly), then the usage chunk
    assert counted[-2:] == [6, 6] and counted[0] >= 1
    assert [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks[:-1]] == [b - a for a, b in zip([0] + counted, counted[:-1])]
    assert all(c["usage"]["prompt_tokens"] == len("In the beginning") for c in chunks)
    assert chunks[-1]["usage"]["total_tokens"] == len("In the beginning") + 6
    body["stream_options"] = {"continuous_usage_stats": True}  # without include_usage: no usage, as vLLM
    lines = httpx.post(f"http://127.0.0.1:{running.app.http_port}/v1/completions", json=body, timeout=60).text.splitlines()
    assert all("usage" not in json_module.loads(line[6:]) for line in lines if line.startswith("data: {"))
