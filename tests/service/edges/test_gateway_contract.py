"""The Kubernetes inference gateway's model-server protocol (gateway-api-inference-extension, proposal 003): the
OpenAI completions and chat endpoints with `usage` (streamed through stream_options.include_usage), GET /v1/models,
and on the API port's /metrics (and on the gauges' own process's, --gateway-metrics-port) the gauges its endpoint
picker reads by default: waiting and running requests and the K/V cache's use as a fraction. The exposition is read
by a parser written here from the Prometheus text format the picker consumes (not prometheus_client's), as the picker
reads a metric: its family's TYPE and the sample's value."""

import re
import urllib.request

import openai
import pytest

from ..conftest import live, long_request, slowed_server, wait_for

PICKER_DEFAULTS = {  # the endpoint picker's --total-queued-requests-metric, --total-running-requests-metric, --kv-cache-usage-percentage-metric
    "waiting": "vllm:num_requests_waiting", "running": "vllm:num_requests_running", "kv_usage": "vllm:kv_cache_usage_perc"}
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)(\s+\d+)?$")


def read_exposition(text: str) -> dict[str, tuple[str, float]]:
    """{metric name: (its TYPE, the value of its unlabelled sample)} from Prometheus' text exposition format."""
    types, values = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            match = SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            if match.group(2) is None:
                values[match.group(1)] = float(match.group(3))
    return {name: (types.get(name, "untyped"), value) for name, value in values.items()}


def scrape_gauges(port: int) -> dict[str, tuple[str, float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        return read_exposition(response.read().decode())


@pytest.mark.parametrize("where", ["the API port", "the gateway metrics port"])
def test_the_picker_reads_waiting_running_and_kv_use(where, tiny_artifact, monkeypatch):
    # Steps of 50 ms: the two running streams (200 tokens each) hold their rows for 10 s while three wait.
    with slowed_server(tiny_artifact, monkeypatch, seconds=0.05, http_port=0, gateway_metrics_port=0, max_batch_size=2,
                       max_queue=8) as (running, stub, _):
        port = running.app.http_port if where == "the API port" else running.app.gateway_metrics_port
        idle = scrape_gauges(port)
        assert all(idle[name] == ("gauge", 0.0) for name in PICKER_DEFAULTS.values()), idle
        streams = [stub.Generate(long_request(200), timeout=60) for _ in range(2)]
        for stream in streams:
            next(stream)  # two are running ...
        streams += [stub.Generate(long_request(200), timeout=60) for _ in range(3)]  # ... and three wait
        assert wait_for(lambda: (live(stub).active_sequences, live(stub).queued_sequences) == (2, 3))
        assert wait_for(lambda: scrape_gauges(port)[PICKER_DEFAULTS["waiting"]][1] == 3)
        busy = scrape_gauges(port)
        assert busy[PICKER_DEFAULTS["waiting"]] == ("gauge", 3.0)
        assert busy[PICKER_DEFAULTS["running"]] == ("gauge", 2.0)
        assert busy[PICKER_DEFAULTS["kv_usage"]] == ("gauge", 1.0)  # both rows hold a sequence: a fraction, never a percent
        for stream in streams:
            stream.cancel()
        assert wait_for(lambda: scrape_gauges(port)[PICKER_DEFAULTS["running"]][1] == 0)
        after = scrape_gauges(port)
        assert after[PICKER_DEFAULTS["waiting"]][1] == 0 and 0.0 <= after[PICKER_DEFAULTS["kv_usage"]][1] <= 1.0


def test_usage_everywhere_and_the_model_list(tiny_artifact, monkeypatch):
    with slowed_server(tiny_artifact, monkeypatch, seconds=0.0, http_port=0, max_batch_size=2) as (running, _, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{running.app.http_port}/v1", api_key="unused", max_retries=0, timeout=60)
        model = running.app.http.model_name
        assert [m.id for m in client.models.list()] == [model]
        # greedy: a sampled token of the tiny random model is its end-of-text now and then (2 runs in 9 here), ending it short
        whole = client.completions.create(model=model, prompt="In the beginning", max_tokens=4, temperature=0)
        assert whole.usage.completion_tokens == 4 and whole.usage.prompt_tokens == len("In the beginning")
        chunks = list(client.completions.create(model=model, prompt="In the beginning", max_tokens=4, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.total_tokens == whole.usage.total_tokens and not chunks[-1].choices
        assert all(chunk.usage is None for chunk in chunks[:-1])


def test_the_scrape_needs_no_token_where_the_api_does(tiny_artifact, monkeypatch, tmp_path):
    """The picker scrapes without credentials: /metrics answers on an API that wants a bearer token."""
    tokens = tmp_path / "tokens"
    tokens.write_text("secret-token-for-tests\n")
    with slowed_server(tiny_artifact, monkeypatch, seconds=0.0, http_port=0, max_batch_size=1, auth_tokens=str(tokens)) as (running, _, _):
        assert PICKER_DEFAULTS["waiting"] in scrape_gauges(running.app.http_port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{running.app.http_port}/v1", api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def cache_config(port: int) -> dict[str, str]:
    """The labels of vllm:cache_config_info's one sample (value 1), as a scraper reads them from the text format."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    (line,) = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    match = SAMPLE.match(line)
    assert match and float(match.group(3)) == 1.0
    return dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))


def test_the_cache_configuration_gives_the_prefix_scorer_its_block_size(tiny_artifact, monkeypatch):
    with slowed_server(tiny_artifact, monkeypatch, seconds=0.0, http_port=0, gateway_metrics_port=0, max_batch_size=2) as (running, _, _):
        for port in (running.app.http_port, running.app.gateway_metrics_port):
            assert cache_config(port) == {"block_size": "16", "num_gpu_blocks": str(2 * 256 // 16)}  # 2 rows of 256 tokens
