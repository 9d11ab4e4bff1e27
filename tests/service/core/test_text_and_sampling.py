"""Streaming text rules and sampling, on their own."""

import numpy as np
import pytest

from kvserve.contract.tokenizer import ByteTokenizer
from kvserve.service.core.sampling import DRAW_BLOCK, SamplingParams, _draw, _nucleus, _nucleus_of, choose, log_probability
from kvserve.service.core.text import IncrementalDecoder, StopSequences


def test_deltas_hold_back_split_characters_and_are_always_valid_utf8():
    text = "héllo wörld — 日本語 🙂!"
    decoder = IncrementalDecoder(ByteTokenizer())
    deltas = [decoder.push(b) for b in text.encode("utf-8")] + [decoder.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    emoji = "🙂".encode("utf-8")
    decoder = IncrementalDecoder(ByteTokenizer())
    assert [decoder.push(b) for b in emoji] == ["", "", "", "🙂"]


def test_an_incomplete_character_at_the_end_becomes_a_replacement_character():
    decoder = IncrementalDecoder(ByteTokenizer())
    assert decoder.push("é".encode()[0]) == ""
    assert decoder.flush() == "\ufffd"


def test_stop_sequences_are_held_back_and_cut():
    stops = StopSequences(("END", "\n\n"))
    assert stops.push("abc E") == ("abc ", None)  # "E" may begin "END"
    assert stops.push("x") == ("Ex", None)
    assert stops.push("yE") == ("y", None)
    assert stops.push("ND tail") == ("", "END")
    stops = StopSequences(("\n\n",))
    assert stops.push("line\n") == ("line", None)
    assert stops.push("\nmore") == ("", "\n\n")
    assert StopSequences(("END",)).push("abc END tail") == ("abc ", "END")  # text before the stop, same push


def test_overlapping_stop_sequences_end_at_the_first_to_complete():
    stops = StopSequences(("abcd", "bc"))
    assert stops.push("xa") == ("x", None)  # "a" may begin "abcd"
    assert stops.push("b") == ("", None)
    assert stops.push("c") == ("a", "bc")  # "bc" completes before "abcd" could
    assert StopSequences(("xab", "ab")).push("-xab") == ("-", "xab")  # both complete: the earlier start wins


def test_a_stop_sequence_completed_only_at_the_final_flush():
    from kvserve.service.core.sequence import FinishReason, Sequence

    seq = Sequence(id=1, prompt_ids=[1], max_new_tokens=2, params=SamplingParams(), stop_ids=frozenset(), return_logprobs=False,
                   decoder=IncrementalDecoder(ByteTokenizer()), stops=StopSequences(("a\ufffd",)))

    def forced(token):  # one-hot logits: greedy picks token
        logits = np.zeros(257, dtype=np.float32)
        logits[token] = 1.0
        return logits

    first = seq.advance(forced(ord("a")))
    assert (first.text, first.finish) == ("", None)  # "a" may begin the stop
    last = seq.advance(forced(0xC3))  # half of a two-byte character, then the length limit: the flush makes it U+FFFD
    assert last.finish.reason == FinishReason.STOP_SEQUENCE and last.finish.stop_sequence == "a\ufffd" and last.text == ""


def test_greedy_repetition_penalty_top_k_and_top_p():
    logits = np.array([1.0, 3.0, 2.0, -1.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert choose(logits, SamplingParams(), rng, None) == 1
    assert choose(logits, SamplingParams(repetition_penalty=2.0), rng, np.array([1])) == 2  # 3/2 < 2
    negative = np.array([-1.0, -0.9, -3.0], dtype=np.float32)
    assert choose(negative, SamplingParams(repetition_penalty=2.0), rng, np.array([1])) == 0  # -0.9 * 2 < -1
    top1 = SamplingParams(temperature=1.0, top_k=1, seed=1)
    assert {choose(logits, top1, rng, None) for _ in range(50)} == {1}
    nucleus = SamplingParams(temperature=1.0, top_p=0.5, seed=1)  # token 1 alone holds ~66%
    assert {choose(logits, nucleus, rng, None) for _ in range(50)} == {1}
    wide = SamplingParams(temperature=5.0)
    assert len({choose(logits, wide, rng, None) for _ in range(200)}) == 4


@pytest.mark.parametrize("spread", ["peaked", "flat", "ties"])
def test_top_p_keeps_what_a_stable_sort_of_the_whole_vocabulary_keeps(spread):
    """sampling._nucleus sorts only the likeliest tokens, _nucleus_of not even those (the likeliest few, else levels of
    probability): the cut must be the whole sort's, ties (lower id first) and nuclei larger than their first looks
    included, from float32 probabilities (the model's) as from float64 ones."""
    rng = np.random.default_rng(7)
    for trial in range(60):
        size = int(rng.choice([3, 300, 5000, 20000]))
        logits = {"peaked": rng.normal(size=size) * 6, "flat": rng.normal(size=size) * 0.01,
                  "ties": np.round(rng.normal(size=size))}[spread]
        unnormalized = np.exp(logits - logits.max())
        probs = unnormalized / unnormalized.sum()
        for top_p in (0.05, 0.5, 0.9, 0.999):
            order = np.argsort(-probs, kind="stable")
            whole = order[: int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1]
            assert np.array_equal(_nucleus(probs, top_p), whole), (spread, size, top_p)
            for dtype in (np.float64, np.float32):
                kept = unnormalized.astype(dtype)
                normalized = kept.astype(np.float64) / kept.sum(dtype=np.float64)
                order = np.argsort(-normalized, kind="stable")
                whole = np.sort(order[: int(np.searchsorted(np.cumsum(normalized[order]), top_p)) + 1])
                assert np.array_equal(_nucleus_of(kept, top_p), whole), (spread, size, top_p, dtype)


@pytest.mark.parametrize("options", [dict(temperature=0.8), dict(temperature=1.2, top_k=50), dict(temperature=1.0, min_p=0.02),
                                     dict(temperature=0.9, top_p=0.9), dict(temperature=0.7, top_k=300, top_p=0.95, min_p=0.001)])
def test_a_draw_is_where_its_uniform_falls_in_the_whole_vocabularys_cumulative_probabilities(options):
    """choose draws in float32 and scans the vocabulary a block at a time: the token must be the one a float64 sum over
    the whole vocabulary gives for the same uniform (the kept tokens' cumulative probabilities in id order, the first to
    pass uniform times their total), vocabularies of one block and of many, up to rounding at a token's edge."""
    params = SamplingParams(**options)
    rng = np.random.default_rng(3)
    for size in (300, 5000, 3 * DRAW_BLOCK * 5 + 17):
        logits = (rng.normal(size=size) * 4).astype(np.float32)
        scaled = logits.astype(np.float64) / params.temperature
        weights = np.exp(scaled - scaled.max())
        if params.top_k:
            weights[scaled < np.sort(scaled)[-params.top_k]] = 0.0
        if params.min_p:
            weights[weights < params.min_p * weights.max()] = 0.0
        if params.top_p < 1.0:
            normalized = weights / weights.sum()
            order = np.argsort(-normalized, kind="stable")
            outside = order[int(np.searchsorted(np.cumsum(normalized[order]), params.top_p)) + 1:]
            weights[outside] = 0.0
        cumulative = np.cumsum(weights)
        for seed in range(40):
            target = np.random.default_rng(seed).random() * cumulative[-1]
            token = choose(logits, params, np.random.default_rng(seed), None)
            assert weights[token] > 0, (size, seed)
            slack = 1e-5 * cumulative[-1]
            assert (cumulative[token - 1] if token else 0.0) - slack <= target < cumulative[token] + slack, (size, seed, token)


def test_a_draw_at_either_end_takes_the_first_or_the_last_token_with_weight():
    """_draw over blocks: a uniform of 0 takes the first token with weight, one just under 1 (or at 1, where a sum's
    rounding can put a target) the last, whichever block holds them and however many blocks around them hold none."""
    probs = np.zeros(5 * DRAW_BLOCK + 100, np.float32)
    probs[[DRAW_BLOCK + 3, 2 * DRAW_BLOCK + 10, 4 * DRAW_BLOCK + 999]] = [0.25, 0.5, 0.25]  # blocks 0, 3 and the tail empty
    assert _draw(probs, 0.0) == DRAW_BLOCK + 3
    assert _draw(probs, np.nextafter(1.0, 0.0)) == 4 * DRAW_BLOCK + 999
    assert _draw(probs, 0.5) == 2 * DRAW_BLOCK + 10  # 0.25 .. 0.75 is its share
    assert _draw(probs, 1.0) == 4 * DRAW_BLOCK + 999  # a target at the whole (rounding can put it there): not past the end
    assert _draw(probs[:300] + np.float32(1.0), np.nextafter(1.0, 0.0)) == 299  # one block alone


def test_sampling_follows_the_distribution_and_the_seed():
    logits = np.log(np.array([0.7, 0.2, 0.1], dtype=np.float32))
    params = SamplingParams(temperature=1.0)
    draws = [choose(logits, params, np.random.default_rng(s), None) for s in range(3000)]
    assert np.bincount(draws, minlength=3) / 3000 == pytest.approx([0.7, 0.2, 0.1], abs=0.03)
    a = [choose(logits, params, rng, None) for rng in [np.random.default_rng(5)] for _ in range(30)]
    b = [choose(logits, params, rng, None) for rng in [np.random.default_rng(5)] for _ in range(30)]
    assert a == b


def test_log_probability_is_log_softmax():
    logits = np.array([0.5, 1.5, -2.0], dtype=np.float32)
    expected = logits[1] - np.log(np.exp(logits).sum())
    assert log_probability(logits, 1) == pytest.approx(float(expected), abs=1e-6)


def test_the_extreme_allowed_temperature_and_penalty_keep_every_logit_finite():
    from kvserve.service.core.limits import MAX_SCALE, MIN_SCALE

    logits = np.array([30.0, -30.0, 29.0, 0.5], dtype=np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):  # inf or NaN anywhere fails
        for penalty in (MIN_SCALE, MAX_SCALE):
            for temperature in (MIN_SCALE, 1.0, MAX_SCALE):
                params = SamplingParams(temperature=temperature, repetition_penalty=penalty)
                token = choose(logits, params, np.random.default_rng(0), np.array([0, 1]))
                assert 0 <= token < 4
        assert choose(logits, SamplingParams(temperature=MIN_SCALE, repetition_penalty=MIN_SCALE), np.random.default_rng(0), np.array([2])) == 2


def test_stop_matching_equals_a_brute_force_reference_however_the_text_is_chunked():
    rng = np.random.default_rng(0)
    for _ in range(300):
        stops = tuple("".join(rng.choice(list("abc"), rng.integers(1, 5))) for _ in range(rng.integers(1, 6)))
        text = "".join(rng.choice(list("abcd"), 40))
        ends = [(end, -len(s), s) for s in stops for end in range(len(s), len(text) + 1) if text[end - len(s) : end] == s]
        expected = (text[: min(ends)[0] + min(ends)[1]], min(ends)[2]) if ends else (text, None)  # first to end, then longest
        matcher, emitted, found, start = StopSequences(stops), "", None, 0
        while start < len(text) and found is None:
            size = int(rng.integers(1, 6))
            piece, found = matcher.push(text[start : start + size])
            emitted, start = emitted + piece, start + size
        if found is None:
            emitted += matcher.flush()
        assert (emitted, found) == expected, (stops, text)
