"""The render endpoints llm-d's router tokenizes through (vLLM's `/v1/completions/render` and
`/v1/chat/completions/render`): a request's prompt token ids and text exactly as generating it sees them (the tiny
model reads one token a byte, so the expected ids are the rendered text's bytes, computed here from the artifact's own
template), the same refusals as generation, and nothing run on the model."""

import httpx2 as httpx  # openai 3 brings it (the httpx API under another name)
import openai
import pytest

from kvserve.contract.chat import ChatMessage, load_chat_template

from ..conftest import serving

MODEL = "tiny-chat"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who was Moses?"}]


@pytest.fixture(scope="module")
def running(tiny_chat_artifact):
    with serving(tiny_chat_artifact, http_port=0, max_batch_size=2, max_chat_messages=4, max_message_bytes=4096) as server:
        yield server


def post(running, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{running.app.http_port}{path}", json=body, timeout=30)


def test_chat_render_is_the_templates_text_and_its_tokens_and_generation_reads_as_many(running, tiny_chat_artifact):
    rendered = load_chat_template(tiny_chat_artifact).render([ChatMessage(m["role"], m["content"]) for m in MESSAGES])
    answer = post(running, "/v1/chat/completions/render", {"model": MODEL, "messages": MESSAGES})
    assert answer.status_code == 200
    body = answer.json()
    assert body["token_ids"] == list(rendered.encode()) and body["prompt"] == rendered and body["model"] == MODEL
    assert body["request_id"].startswith("render-")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{running.app.http_port}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens == len(body["token_ids"])


def test_completions_render_is_a_list_of_one_prompt(running):
    answer = post(running, "/v1/completions/render", {"model": MODEL, "prompt": "In the beginning", "max_tokens": 4})
    assert answer.status_code == 200
    (item,) = answer.json()
    assert item["token_ids"] == list(b"In the beginning") and item["prompt"] == "In the beginning"
    ids = post(running, "/v1/completions/render", {"model": MODEL, "prompt": [73, 110]}).json()
    assert ids[0]["token_ids"] == [73, 110] and ids[0]["prompt"] is None  # token ids as sent: no text to show


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions/render", {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 5}, 400, "messages"),
    ("/v1/chat/completions/render", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/completions/render", {"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions/render", {"model": "another", "prompt": "x"}, 404, "model"),
])
def test_a_request_generation_refuses_render_refuses_alike(running, path, body, status, param):
    generated = post(running, path.removesuffix("/render"), body)
    rendered = post(running, path, body)
    assert rendered.status_code == generated.status_code == status
    assert rendered.json()["error"] == generated.json()["error"] and rendered.json()["error"]["param"] == param


def test_render_reads_only_json_and_says_so(running):
    answer = httpx.post(f"http://127.0.0.1:{running.app.http_port}/v1/chat/completions/render", content=b"{}", timeout=30,
                        headers={"Content-Type": "text/plain"})
    assert answer.status_code == 415 and answer.json()["error"]["code"] == "unsupported_media_type"
