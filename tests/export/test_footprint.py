"""The decode floor's byte accounting (export/footprint.py) against the graph's own initializers, data loaded."""

import onnx
import pytest
from onnx import numpy_helper

from kvserve.contract.artifact import open_artifact
from kvserve.export.footprint import step_footprint
from kvserve.export.quantize import BLOCKS


@pytest.mark.parametrize("fixture", ["tiny_artifact", "trained_int8_artifact"])
def test_every_initializer_byte_is_read_whole_or_looked_up_by_row(fixture, request):
    artifact = open_artifact(request.getfixturevalue(fixture))
    config = artifact.config
    column = 2 * config.n_layer * config.n_kv_head * config.head_dim * 4
    footprint = step_footprint(artifact.model_path, column)
    graph = onnx.load(str(artifact.model_path)).graph
    assert footprint.whole_bytes + footprint.lookup_table_bytes == sum(numpy_helper.to_array(t).nbytes for t in graph.initializer)
    # The position table is only gathered, a row a token; the token table is tied to the LM head and read whole, in a
    # float32 graph as the head's matrix, in a quantized one as the head's 8-bit blocks, which the lookup shares (its
    # copy of their scales, a float per block, is gathered a row a token too).
    lookup_scales = 0 if artifact.quantization is None else config.vocab_size * -(-config.d_model // BLOCKS["int8"][1]) * 4
    assert footprint.lookup_table_bytes == config.n_ctx * config.d_model * 4 + lookup_scales
    assert footprint.lookup_row_bytes == config.d_model * 4 + lookup_scales // config.vocab_size
    assert footprint.decode_bytes(3, 10) == footprint.whole_bytes + 3 * (footprint.lookup_row_bytes + 10 * column)
