"""The artifact's tokenizer (contract/tokenizer.py): one token per byte when an artifact ships no tokenizer.json, and
each id's own text as streaming reads it."""

from kvserve.contract.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

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
