"""Serving an artifact whose K/V pool holds float16 or int8 (export --kv-dtype): the load gate passes, GetModelInfo says
what the cache holds, a sequence's K/V bytes are its tokens' at that dtype (a quarter of float32's for int8), and a
greedy stream is the artifact's own greedy continuation. The batch's own tests run such pools too (conftest.slots_graph)."""

import numpy as np
import pytest

from kvserve.contract.artifact import open_artifact
from kvserve.export.parity import artifact_greedy
from kvserve.v1 import generation_pb2 as pb

from ...conftest import PROVIDER
from ..conftest import collect, serving, slow_down, stub_of


@pytest.mark.parametrize("attention, kv_dtype", [("fused", "int8"), ("standard", "float16")])
def test_a_kv_dtype_artifact_serves_its_own_greedy_tokens_holding_its_tokens_bytes(kv_dtype_artifacts, attention, kv_dtype, monkeypatch):
    directory = kv_dtype_artifacts("tiny", attention, kv_dtype)
    config = open_artifact(directory).config
    token = 2 * config.n_layer * config.n_kv_head * config.head_dim * np.dtype(kv_dtype).itemsize  # K and V of one token, every layer
    prompt = [5, 17, 99, 3, 42, 8]
    with serving(directory, max_batch_size=4) as running, stub_of(running) as stub:
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert (info.kv_dtype, info.dtype, info.attention) == (kv_dtype, "float32", attention)
        assert info.parity_gate.passed and f"{kv_dtype} K/V" in info.parity_gate.summary
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=12, ignore_eos=True)
        ids, _, _ = collect(stub, request)
        assert ids == artifact_greedy(directory, [prompt], 12, PROVIDER)[0].tolist()
        slow_down(monkeypatch, running.app, 0.05)  # 200 steps take 10 s: the stream is still running when it is looked at
        stream = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=200, ignore_eos=True), timeout=60)
        next(stream)
        (seq,) = stub.GetModelInfo(pb.GetModelInfoRequest()).live.sequences
        assert seq.kv_cache_bytes % token == 0 and seq.tokens - 1 <= seq.kv_cache_bytes // token <= seq.tokens
        stream.cancel()
