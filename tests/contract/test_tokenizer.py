"""The artifact's tokenizer (contract/tokenizer.py): one token per byte when an artifact ships no tokenizer.json, and
each id's own text as streaming reads it."""

import pytest

from kvserve.contract.tokenizer import ByteTokenizer, HFTokenizer, TokenizerFileError, load_tokenizer

from ..conftest import DEFAULT_CHECKPOINT


def test_bytes_round_trip_and_ids_past_the_bytes_have_no_text():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("né")
    assert ids == [110, 195, 169] and tokenizer.decode(ids + [256]) == "né"
    assert tokenizer.pieces([110, 195, 256]) == ["n", "\ufffd", ""]  # half a character alone is U+FFFD


def test_an_artifact_tokenizer_json_is_loaded_and_none_means_bytes():
    shipped = load_tokenizer(DEFAULT_CHECKPOINT / "tokenizer.json")
    assert isinstance(shipped, HFTokenizer) and shipped.name == "tokenizer.json"
    ids = shipped.encode("In the beginning")
    assert shipped.decode(ids) == "In the beginning" and "".join(shipped.pieces(ids)) == "In the beginning"
    assert isinstance(load_tokenizer(None), ByteTokenizer)  # Artifact.tokenizer_path is None when it ships none


@pytest.mark.parametrize("text", [b"{not json", b"[]", b"{}", b"\xff\xfe"], ids=["not json", "a list", "no model", "not utf-8"])
def test_a_tokenizer_json_that_does_not_load_is_named(tmp_path, text):
    """The library's own error names no file (the server printed its traceback)."""
    path = tmp_path / "tokenizer.json"
    path.write_bytes(text)
    with pytest.raises(TokenizerFileError, match=f"^{path}: not a tokenizer.json the tokenizers library reads"):
        load_tokenizer(path)
