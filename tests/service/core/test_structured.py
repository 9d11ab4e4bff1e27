"""Structured output (service/core/structured.py) against real servers: JSON schemas, regular expressions and grammars
with the byte tokenizer (the tiny model) and byte-level BPE (the trained default model); outputs validated with
jsonschema; refusals named and bounded in time; a constrained row beside an unconstrained one; sampling under a mask."""

import json
import re
import subprocess
import sys
import threading
import time

import grpc
import jsonschema
import numpy as np
import openai
import pytest

from kvserve.contract.tokenizer import ByteTokenizer
from kvserve.service.core.limits import EngineLimits
from kvserve.service.core.structured import FormatCompiler, FormatError, FormatKind, ResponseFormat, TokenMasks, schema_depth
from kvserve.v1 import generation_pb2 as pb

from ...conftest import REPO
from ..conftest import collect, sequence, serving, stub_of

SCHEMAS = json.loads((REPO / "bench" / "structured_schemas.json").read_text())
SAMPLINGS = [pb.SamplingParams(), pb.SamplingParams(temperature=1.0, seed=7), pb.SamplingParams(temperature=0.7, top_k=20, seed=8)]


@pytest.fixture(scope="module")
def trained_server(trained_int8_artifact):
    """The default model (byte-level BPE, 4,096 tokens), with the HTTP API."""
    with serving(trained_int8_artifact, http_port=0, max_batch_size=4) as server:
        yield server


@pytest.fixture(scope="module")
def trained_stub(trained_server):
    with stub_of(trained_server) as stub:
        yield stub


def generate(stub, fmt: pb.ResponseFormat, max_new_tokens: int = 200, prompt: str = "Answer: ", **fields):
    _, text, finish = collect(stub, pb.GenerateRequest(text=prompt, max_new_tokens=max_new_tokens, response_format=fmt, **fields))
    return text, finish


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("model", ["tiny", "trained"])
def test_every_output_validates_against_its_schema_greedy_and_sampled(name, model, stub, trained_stub):
    schema = SCHEMAS[name]
    for sampling in SAMPLINGS:
        text, finish = generate(stub if model == "tiny" else trained_stub, pb.ResponseFormat(json_schema=json.dumps(schema)), sampling=sampling)
        assert finish.reason == pb.FINISH_REASON_END_OF_SEQUENCE, (text, finish)
        jsonschema.validate(json.loads(text), schema)


def test_any_json_object_regex_and_grammar(stub, trained_stub):
    for target in (stub, trained_stub):
        text, finish = generate(target, pb.ResponseFormat(json_object=pb.JsonObject()), max_new_tokens=150,
                                sampling=pb.SamplingParams(temperature=1.0, seed=3))
        if finish.reason == pb.FINISH_REASON_END_OF_SEQUENCE:
            assert isinstance(json.loads(text), dict)
        else:  # a random model may write one endless string: the finish says the object never closed
            assert finish.reason == pb.FINISH_REASON_LENGTH and text.startswith("{")
        pattern = r"[A-Z]{2}-[0-9]{3}( ok| no)?"
        for sampling in SAMPLINGS:
            text, finish = generate(target, pb.ResponseFormat(regex=pattern), sampling=sampling)
            assert re.fullmatch(pattern, text) and finish.reason == pb.FINISH_REASON_END_OF_SEQUENCE, text
        grammar = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[1-9][0-9]?/\n'
        for sampling in SAMPLINGS:
            text, finish = generate(target, pb.ResponseFormat(lark_grammar=grammar), max_new_tokens=60, sampling=sampling)
            assert re.fullmatch(r"[0-9+\-()]+", text), text
            if finish.reason == pb.FINISH_REASON_END_OF_SEQUENCE:
                assert isinstance(eval(text, {"__builtins__": {}}), int), text  # digits, + - and parentheses only


def test_the_schema_true_takes_any_json_value(stub):
    text, finish = generate(stub, pb.ResponseFormat(json_schema="true"), max_new_tokens=100, sampling=pb.SamplingParams(temperature=1.0, seed=5))
    if finish.reason == pb.FINISH_REASON_END_OF_SEQUENCE:
        json.loads(text)
    else:
        assert finish.reason == pb.FINISH_REASON_LENGTH


def test_a_generation_cut_by_length_says_so(stub):
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40}}, "required": ["text"]}
    text, finish = generate(stub, pb.ResponseFormat(json_schema=json.dumps(schema)), max_new_tokens=10)
    assert finish.reason == pb.FINISH_REASON_LENGTH and finish.generated_tokens == 10
    with pytest.raises(ValueError):
        json.loads(text)


def test_ignore_eos_keeps_an_open_pattern_going_and_a_closed_one_still_ends(stub):
    text, finish = generate(stub, pb.ResponseFormat(regex="[0-9]+"), max_new_tokens=30, ignore_eos=True,
                            sampling=pb.SamplingParams(temperature=1.0, seed=1))
    assert re.fullmatch("[0-9]{30}", text) and finish.reason == pb.FINISH_REASON_LENGTH
    text, finish = generate(stub, pb.ResponseFormat(regex="[A-Z]{2}"), max_new_tokens=30, ignore_eos=True)
    assert re.fullmatch("[A-Z]{2}", text) and finish.reason == pb.FINISH_REASON_END_OF_SEQUENCE and finish.generated_tokens == 2


DEEP: dict = {"type": "integer"}
for _ in range(41):
    DEEP = {"type": "array", "items": DEEP}  # 42 objects, one inside the next
REFUSALS = [
    (pb.ResponseFormat(json_schema='{"type": "integer", "minimum": 5, "maximum": 1}'), "response_format.json_schema: Unsatisfiable"),
    (pb.ResponseFormat(json_schema='{"allOf": [{"type": "string"}, {"type": "integer"}]}'), "Unsatisfiable schema"),
    (pb.ResponseFormat(json_schema='{"type": "strin"}'), "Invalid type"),
    (pb.ResponseFormat(json_schema="{"), "response_format.json_schema: not JSON"),
    (pb.ResponseFormat(json_schema="[1, 2]"), "a schema is a JSON object"),
    (pb.ResponseFormat(json_schema="false"), "response_format.json_schema: false: no output satisfies it"),
    (pb.ResponseFormat(json_schema="{}" + " " * 70_000), "bytes; at most 65536"),
    (pb.ResponseFormat(json_schema=json.dumps(DEEP)), f"nested 42 deep; at most {EngineLimits().max_schema_depth}"),
    (pb.ResponseFormat(regex="[0-9"), "response_format.regex: "),
    (pb.ResponseFormat(regex=""), "response_format.regex: empty"),
    (pb.ResponseFormat(lark_grammar="start: missing_rule"), "response_format.grammar: "),
    (pb.ResponseFormat(regex="a{1000}{1000}"), "too many expressions"),  # builds quickly, then outgrows the lexer's limits
    (pb.ResponseFormat(), "set one of json_schema"),
]


@pytest.mark.parametrize("fmt, reason", REFUSALS, ids=[str(i) for i in range(len(REFUSALS))])
def test_bad_formats_are_refused_in_bounded_time_naming_why(stub, fmt, reason):
    request = pb.GenerateRequest(text="x", max_new_tokens=200, response_format=fmt, sampling=pb.SamplingParams(temperature=1.0, seed=2))
    start = time.perf_counter()
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, request)
    assert time.perf_counter() - start < 5
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in error.value.details(), error.value.details()


def test_pathological_formats_do_not_stall_a_running_stream(stub):
    """A stream runs while 24 pathological patterns are compiled and refused beside it: its longest gap between two
    tokens stays under 0.5 s (a step waits for the masks of its constrained rows only, each bounded by llguidance's
    fuel), and it ends as it would alone."""
    alone, _, _ = collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), max_new_tokens=150, ignore_eos=True))
    gaps, tokens = [], []

    def run():
        last = time.perf_counter()
        for response in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), max_new_tokens=150, ignore_eos=True), timeout=60):
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            tokens.append(response.token.id)

    stream = threading.Thread(target=run)
    stream.start()
    for i in range(24):
        with pytest.raises(grpc.RpcError):
            collect(stub, pb.GenerateRequest(text="x", max_new_tokens=50, response_format=pb.ResponseFormat(regex=f"a{{{1000 + i}}}{{1000}}")))
    stream.join()
    assert tokens == alone
    assert max(gaps[1:]) < 0.5, f"longest gap {max(gaps[1:]) * 1e3:.0f} ms"


def test_constrained_and_unconstrained_rows_in_one_batch_equal_each_alone(stub):
    schema = json.dumps(SCHEMAS["array_of_objects"])
    constrained = pb.GenerateRequest(text="List: ", max_new_tokens=120, response_format=pb.ResponseFormat(json_schema=schema),
                                     sampling=pb.SamplingParams(temperature=0.9, seed=11))
    free = pb.GenerateRequest(text="And it came to pass", max_new_tokens=120, ignore_eos=True, sampling=pb.SamplingParams(temperature=0.9, seed=12))
    greedy = pb.GenerateRequest(text="In the beginning", max_new_tokens=120, ignore_eos=True)
    alone = [collect(stub, request)[0] for request in (constrained, free, greedy)]
    together: list = [None] * 3

    def run(i, request):
        together[i] = collect(stub, request)[0]

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate((constrained, free, greedy))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone


def test_n_completions_each_follow_the_format(stub):
    request = pb.GenerateRequest(text="x", n=3, max_new_tokens=200, response_format=pb.ResponseFormat(json_schema=json.dumps(SCHEMAS["enums"])),
                                 sampling=pb.SamplingParams(temperature=1.0, seed=4))
    responses = list(stub.Generate(request, timeout=60))
    for index in range(3):
        text = "".join(r.token.text_delta for r in responses if r.index == index)
        jsonschema.validate(json.loads(text), SCHEMAS["enums"])


def test_the_http_api_takes_openai_response_formats(trained_server):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{trained_server.app.http_port}/v1", api_key="unused", max_retries=0, timeout=60)
    model = trained_server.app.http.model_name
    schema = SCHEMAS["nested_object"]
    json_schema = {"type": "json_schema", "json_schema": {"name": "user", "schema": schema, "strict": True}}
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Who?"}], max_tokens=150, response_format=json_schema,
                                          temperature=0)
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    assert chat.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Who?"}], max_tokens=150,
                                            response_format=json_schema, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == chat.choices[0].message.content
    completion = client.completions.create(model=model, prompt="{", max_tokens=150, extra_body={"response_format": {"type": "json_object"}},
                                           temperature=0)
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].text), dict)
    else:
        assert completion.choices[0].finish_reason == "length" and completion.choices[0].text.startswith("{")
    for bad, param in [({"type": "xml"}, "response_format"), ({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}, "response_format.json_schema.extra"),
                       ({"type": "json_object", "json_schema": {}}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 2, "maximum": 1}}}, "response_format")]:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], response_format=bad)
        assert error.value.body["param"] == param, error.value.body


def test_the_cli_constrains_from_a_schema_file_or_a_pattern_and_refuses_bad_ones_in_one_line(server, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS["enums"]))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "--target", server.target, "x", "--max-new-tokens", "200", *args],
                              capture_output=True, text=True, cwd=REPO, timeout=60)

    result = cli("--json-schema", str(schema))
    assert result.returncode == 0 and "finished: end_of_sequence" in result.stdout, result.stderr
    jsonschema.validate(json.loads(result.stdout.split("\n-- ")[0]), SCHEMAS["enums"])
    result = cli("--regex", "[a-c]{4}")
    assert result.returncode == 0 and re.match(r"[a-c]{4}\n-- 4 tokens", result.stdout), result.stdout
    for args, message in [(("--json-schema", str(tmp_path / "missing.json")), "--json-schema"),
                          (("--regex", "[0-9"), "INVALID_ARGUMENT: response_format.regex"), (("--json", "--regex", "a"), "not allowed with")]:
        result = cli(*args)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


# --- the pieces, in-process ------------------------------------------------------------------------------------


def compiler(max_bytes: int = 1024) -> FormatCompiler:
    return FormatCompiler(ByteTokenizer(), 257, (256,), max_bytes)


def test_compiled_formats_are_cached_and_each_sequence_gets_its_own_state():
    formats = compiler()
    first = formats.compile(ResponseFormat(FormatKind.REGEX, "[ab]c"))
    second = formats.compile(ResponseFormat(FormatKind.REGEX, "[ab]c"))
    assert (formats.compiles, formats.cache_hits) == (1, 1)
    first.accept(ord("a"))
    second.accept(ord("b"))  # the second did not see the first's token
    first.accept(ord("c"))
    assert first.finished and not second.finished
    with pytest.raises(FormatError, match="failed during generation"):
        second.accept(ord("x"))


def test_limits_are_checked_before_compiling():
    with pytest.raises(FormatError, match="1025 bytes; at most 1024"):
        compiler().compile(ResponseFormat(FormatKind.GRAMMAR, "s" * 1025))
    assert schema_depth({"a": [{"b": []}]}) == 4 and schema_depth(3) == 0


def masked_draws(pattern: str, logits: np.ndarray, draws: int, **sampling) -> np.ndarray:
    """How often each byte is the first token of a sequence constrained to pattern, over draws seeds."""
    formats, masks = compiler(), TokenMasks(257)
    counts = np.zeros(257)
    try:
        for seed in range(draws):
            seq = sequence(seed, [1, 2], 1, seed=seed + 1, **sampling)
            seq.constraint = formats.compile(ResponseFormat(FormatKind.REGEX, pattern))
            allowed = masks.start([seq]).result()[seq]
            counts[seq.advance(logits, None, allowed).token_id] += 1
    finally:
        masks.close()
    return counts / draws


def test_sampling_under_a_mask_follows_the_masked_distribution():
    logits = np.random.default_rng(0).normal(0, 1.5, 257).astype(np.float32)
    allowed = [ord(c) for c in "abcdef"]
    expected = np.zeros(257)
    expected[allowed] = np.exp(logits[allowed] - logits[allowed].max())
    expected /= expected.sum()
    observed = masked_draws("[a-f]x", logits, 4000, temperature=1.0)
    assert observed[[i for i in range(257) if i not in allowed]].sum() == 0
    # 4,000 draws: each frequency within 4 standard errors of its probability
    assert np.all(np.abs(observed - expected) <= 4 * np.sqrt(expected * (1 - expected) / 4000) + 1e-12), (observed[allowed], expected[allowed])
    top2 = masked_draws("[a-f]x", logits, 400, temperature=1.0, top_k=2)  # top_k counts the allowed tokens only
    likeliest = sorted(allowed, key=lambda i: -logits[i])[:2]
    assert set(np.flatnonzero(top2)) == set(likeliest)
    greedy = masked_draws("[a-f]x", logits, 3)
    assert np.flatnonzero(greedy).tolist() == [likeliest[0]]
