"""The OpenAI sampling options in the engine, each held to its definition applied to the eager model's logits step by
step (as the repetition penalty's test does): logit bias, presence and frequency penalties, the top alternatives'
log-probabilities; min_p's distribution; and their limits refused naming the field."""

import grpc
import numpy as np
import pytest
import torch

from kvserve.service.core.sampling import SamplingParams, choose
from kvserve.v1 import generation_pb2 as pb

from ..conftest import collect

PROMPT, STEPS = [40, 41, 42], 12


def eager_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        batch = torch.tensor([ids])
        return model(batch, torch.ones_like(batch), torch.arange(len(ids))[None], model.empty_cache(1))[0][0, -1].double()


def eager_greedy(model, change) -> list[int]:
    """Greedy tokens when change(logits, generated) rewrites each step's logits first."""
    tokens = list(PROMPT)
    for _ in range(STEPS):
        logits = change(eager_logits(model, tokens), tokens[len(PROMPT):])
        tokens.append(int(logits.argmax()))
    return tokens[len(PROMPT):]


def sampled_ids(stub, **sampling) -> list[int]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=STEPS, ignore_eos=True, sampling=pb.SamplingParams(**sampling))
    return collect(stub, request)[0]


def test_logit_bias_is_added_before_the_argmax(stub, tiny_model):
    plain = eager_greedy(tiny_model, lambda logits, _: logits)
    bias = {plain[0]: -100.0, 7: 3.5, 200: 8.0}

    def biased(logits, _):
        for token, value in bias.items():
            logits[token] += value
        return logits

    expected = eager_greedy(tiny_model, biased)
    assert expected != plain
    assert sampled_ids(stub, logit_bias=bias) == expected


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.2), (0.8, 0.6), (-1.0, 0.0)])
def test_presence_and_frequency_penalties_follow_openais_definition(stub, tiny_model, presence, frequency):
    def penalized(logits, generated):
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        for token, count in zip(ids.tolist(), counts.tolist()):
            logits[token] -= count * frequency + presence
        return logits

    assert sampled_ids(stub, presence_penalty=presence, frequency_penalty=frequency) == eager_greedy(tiny_model, penalized)


def test_top_alternatives_are_the_models_likeliest_tokens_with_their_log_probabilities(stub, tiny_model):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=STEPS, ignore_eos=True, return_logprobs=True, top_logprobs=5)
    responses = list(stub.Generate(request, timeout=60))
    tokens = list(PROMPT)
    for response in responses:
        log_probs = torch.log_softmax(eager_logits(tiny_model, tokens), -1)
        top = torch.topk(log_probs, 5)
        assert [t.id for t in response.token.top_logprobs] == top.indices.tolist()
        assert [t.logprob for t in response.token.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert response.token.top_logprobs[0].id == response.token.id and response.token.logprob == pytest.approx(top.values[0].item(), abs=1e-4)
        assert [t.text for t in response.token.top_logprobs] == [bytes([i]).decode("utf-8", "replace") if i < 256 else "" for i in top.indices.tolist()]
        tokens.append(response.token.id)


def test_min_p_keeps_the_tokens_at_least_that_fraction_as_likely_as_the_best():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, min_p=0.4)  # keeps p >= 0.2: tokens 0 and 1, renormalized 0.625 / 0.375
    draws = [choose(logits, params, np.random.default_rng(s), None) for s in range(4000)]
    assert np.bincount(draws, minlength=4) / 4000 == pytest.approx([0.625, 0.375, 0, 0], abs=0.03)


def test_min_p_of_one_at_the_server_is_greedy(stub, tiny_model):
    assert sampled_ids(stub, temperature=1.0, min_p=1.0, seed=3) == eager_greedy(tiny_model, lambda logits, _: logits)


@pytest.mark.parametrize("fields, message", [
    (dict(sampling=pb.SamplingParams(presence_penalty=2.5)), "sampling.presence_penalty: must be in [-2, 2], got 2.5"),
    (dict(sampling=pb.SamplingParams(frequency_penalty=-3)), "sampling.frequency_penalty: must be in [-2, 2], got -3.0"),
    (dict(sampling=pb.SamplingParams(min_p=1.5)), "sampling.min_p: must be in [0, 1], got 1.5"),
    (dict(sampling=pb.SamplingParams(logit_bias={100000: 1.0})), "sampling.logit_bias: token id 100000 is outside the vocabulary"),
    (dict(sampling=pb.SamplingParams(logit_bias={5: 101.0})), "sampling.logit_bias: the bias of token 5 must be in [-100, 100], got 101.0"),
    (dict(sampling=pb.SamplingParams(logit_bias={i: 1.0 for i in range(301)})), "sampling.logit_bias: 301 entries; at most 300"),
    (dict(return_logprobs=True, top_logprobs=21), "top_logprobs: must be in [0, 20], got 21"),
    (dict(top_logprobs=3), "top_logprobs: alternatives come with the log-probabilities: set return_logprobs too"),
])
def test_out_of_range_options_are_refused_naming_the_field(stub, fields, message):
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, pb.GenerateRequest(text="a", max_new_tokens=2, **fields))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details().startswith(message)


def test_n_completions_over_grpc_are_each_the_seeded_request_alone(stub):
    sampling = pb.SamplingParams(temperature=1.0, seed=41)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=6, ignore_eos=True, sampling=sampling, n=2)
    by_index = {0: [], 1: []}
    finishes = {}
    for response in stub.Generate(request, timeout=60):
        by_index[response.index].append(response.token.id)
        if response.HasField("finish"):
            finishes[response.index] = response.finish
    for index in (0, 1):
        alone = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=6, ignore_eos=True,
                                   sampling=pb.SamplingParams(temperature=1.0, seed=41 + index))
        assert by_index[index] == collect(stub, alone)[0] and finishes[index].generated_tokens == 6
    assert by_index[0] != by_index[1]
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, pb.GenerateRequest(text="a", max_new_tokens=2, n=9))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details() == "n: must be in [1, 8], got 9"


def test_n_completions_compute_their_prompt_once(stub):
    prompt = np.random.default_rng(2024).integers(1, 256, 40).tolist()  # a prompt no other test sends
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=3, ignore_eos=True, n=3,
                                 sampling=pb.SamplingParams(temperature=1.0, seed=9))
    finishes = {r.index: r.finish for r in stub.Generate(request, timeout=60) if r.HasField("finish")}
    # the first computes it; the others copy its K/V (all but the last prompt token, always computed)
    assert sorted(f.cached_prompt_tokens for f in finishes.values()) == [0, 39, 39]


def test_min_new_tokens_holds_the_stop_tokens_back_until_then(stub, tiny_model):
    """vLLM's min_tokens: before min_new_tokens tokens no stop token (stop_token_ids, end-of-sequence) is taken; the
    greedy choice is the eager model's with their logits at -inf until then, and a stop token ends it after."""
    plain = eager_greedy(tiny_model, lambda logits, _: logits)
    stop, least = plain[1], 6

    def held(logits, generated):
        if len(generated) < least:
            logits[[stop, 256]] = -float("inf")  # 256: the tiny preset's end-of-sequence
        return logits

    expected = eager_greedy(tiny_model, held)
    ends = [i for i, token in enumerate(expected) if token in (stop, 256) and i >= least]
    expected = expected[: ends[0] + 1] if ends else expected
    ids, _, finish = collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=STEPS, stop_token_ids=[stop],
                                                      min_new_tokens=least))
    assert ids == expected and len(ids) > least
    short, _, _ = collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=STEPS, stop_token_ids=[stop]))
    assert short == plain[:2]  # without it, the stop token ends it at once
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, pb.GenerateRequest(text="a", max_new_tokens=2, min_new_tokens=3))
    assert error.value.details() == "min_new_tokens: must be in [0, max_new_tokens = 2], got 3"


def test_a_stop_sequence_ends_the_text_when_asked_and_is_left_out_otherwise(stub):
    _, text, _ = collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=STEPS, ignore_eos=True))
    at = next(i for i in range(1, len(text)) if text.find(text[i]) == i)  # a character's first place, past the first
    stop = text[at]
    _, left_out, finish = collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=STEPS, ignore_eos=True,
                                                           stop_sequences=[stop]))
    _, included, _ = collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=STEPS, ignore_eos=True,
                                                      stop_sequences=[stop], include_stop_sequence=True))
    assert (left_out, included, finish.stop_sequence) == (text[:at], text[: at + 1], stop)


def test_special_tokens_are_written_only_when_asked():
    from kvserve.contract.tokenizer import HFTokenizer
    from kvserve.model.vocabulary import gpt2_tokenizer
    from kvserve.service.core.text import IncrementalDecoder

    tokenizer = HFTokenizer.__new__(HFTokenizer)
    tokenizer._tokenizer = gpt2_tokenizer()
    ids = tokenizer.encode("Hi") + [50256]  # <|endoftext|>
    for skip, expected in ((True, "Hi"), (False, "Hi<|endoftext|>")):
        decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip)
        assert "".join(decoder.push(i) for i in ids) + decoder.flush() == expected
