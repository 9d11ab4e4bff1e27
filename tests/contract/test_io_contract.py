"""The graph's I/O contract (contract/io_contract.py): the names and symbolic axes each layout and attention declares,
which export writes and the runtime binds."""

import pytest

from kvserve.contract import io_contract as io


def test_names_follow_the_layer_and_each_layout_declares_its_inputs_and_outputs():
    assert io.past_names(3) == ("past_key_values.3.key", "past_key_values.3.value")
    assert io.present_names(0) == ("present.0.key", "present.0.value")
    concat = io.io_spec(2, 2, 8, 100, "float32")
    assert list(concat["inputs"]) == io.input_names(2) and list(concat["outputs"]) == io.output_names(2)
    assert concat["inputs"]["past_key_values.1.value"] == {"shape": [io.BATCH, 2, io.PAST, 8], "dtype": "float32"}
    for attention in io.ATTENTIONS:
        slots = io.io_spec(2, 2, 8, 100, "float16", io.SLOTS, attention)
        assert list(slots["inputs"]) == io.input_names(2, io.SLOTS, attention)
        assert list(slots["outputs"]) == io.output_names(2, io.SLOTS, attention)
        assert slots["outputs"][io.GREEDY_TOKENS]["dtype"] == "int64" and slots["outputs"][io.LOGITS]["dtype"] == "float32"
        assert (io.CHUNK_SLOT in slots["inputs"]) == (attention == io.STANDARD)  # a fused graph's chunk row is bound apart
        assert (io.chunk_past_names(0)[0] in slots["inputs"]) == (attention == io.FUSED)


def test_a_longrope_models_slots_graphs_take_each_rows_and_the_chunks_choice_of_factors_after_the_kv():
    for attention in io.ATTENTIONS:
        spec = io.io_spec(2, 2, 8, 100, "float32", io.SLOTS, attention, long_rope=True)
        names = io.input_names(2, io.SLOTS, attention, long_rope=True)
        assert list(spec["inputs"]) == names and names[-2:] == [io.LONG_ROPE, io.CHUNK_LONG_ROPE]
        assert spec["inputs"][io.LONG_ROPE] == {"shape": [io.BATCH], "dtype": "int64"}
        assert io.LONG_ROPE not in io.io_spec(2, 2, 8, 100, "float32", io.SLOTS, attention)["inputs"]
    # a concat graph turns each row by its own length, as transformers does: nothing more to feed
    assert io.input_names(2, io.CONCAT, long_rope=True) == io.input_names(2) == list(io.io_spec(2, 2, 8, 100, "float32", long_rope=True)["inputs"])


@pytest.mark.parametrize("args, message", [
    (dict(dtype="bfloat16"), "unsupported dtype 'bfloat16'"),
    (dict(dtype="float32", kv_cache="paged"), "unsupported KV cache 'paged'"),
    (dict(dtype="float32", kv_cache=io.CONCAT, attention=io.FUSED), "unsupported attention 'fused' for the concat KV cache"),
])
def test_a_layout_the_contract_does_not_declare_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        io.io_spec(1, 1, 8, 10, **args)
