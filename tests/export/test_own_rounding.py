"""A float16 artifact held to what float16 itself costs its model: the eager model's own float16 error, measured where a
check falls outside the fixed bounds, raises them to a multiple of it; a graph that computes something else still fails."""

import json

import numpy as np
import pytest
import torch

from kvserve.contract.artifact import OWN_ROUNDING_KEY, open_artifact
from kvserve.contract.tolerances import TOLERANCES
from kvserve.export.own_rounding import own_rounding
from kvserve.export.parity import format_report, verify

from ..conftest import LLAMA_CONFIGS, PROVIDER

# Weights drawn at 0.3 (the suite's Llama-family models): float16 itself moves this one's logits by ~5% of the largest
# and its K/V by ~2% on verify's prompts (the eager model's own float16 forward), past the fixed 1% bounds.
WIDE = "llama gqa 4:1 head_dim 24 untied"


def prompts(vocab: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def test_the_own_error_is_float16s_not_the_measurements(tiny_llama_model):
    batches = [prompts(tiny_llama_model.config.vocab_size, (7, 13))]
    same = own_rounding(tiny_llama_model, batches, 4, torch.float32)
    assert same.logits < 1e-5 and same.kv < 1e-5  # float32 again: only the chunked prefill's order of arithmetic
    half = own_rounding(tiny_llama_model, batches, 4)
    assert 100 * same.logits < half.logits < 1e-2 and 100 * same.kv < half.kv < 1e-2
    assert next(tiny_llama_model.parameters()).dtype == torch.float32  # a copy ran in float16, not the model


@pytest.fixture(scope="module")
def wide_float16(make_hf_llama, tmp_path_factory):
    """WIDE exported in float16 (verified on the tests' provider): (checkpoint, artifact, report)."""
    from kvserve.export.pipeline import export_artifact
    from kvserve.model.checkpoint import load_checkpoint

    model_type, config = LLAMA_CONFIGS[WIDE]
    _, checkpoint = make_hf_llama(model_type, seed=0, **config)
    out = tmp_path_factory.mktemp("own-rounding") / "wide-float16"
    report = export_artifact(load_checkpoint(checkpoint), {"kind": "checkpoint", "path": str(checkpoint)}, out, dtype="float16",
                             provider=PROVIDER)
    return checkpoint, out, report


def test_a_float16_model_past_the_fixed_bounds_passes_within_a_multiple_of_its_own_float16_error(wide_float16):
    _, out, report = wide_float16
    fixed = TOLERANCES["float16"]
    worst = max(c.max_abs_logits / c.max_abs_eager_logit for c in report.checks)
    assert worst > fixed.logits_max_abs  # the fixed bound alone refuses this artifact
    own = report.own_rounding
    assert report.passed and own is not None
    multiple = fixed.own_rounding_multiple
    assert report.tolerance.logits_max_abs == pytest.approx(max(fixed.logits_max_abs, multiple * own["logits"]))
    assert report.tolerance.kv_max_abs == pytest.approx(max(fixed.kv_max_abs, multiple * own["kv"]))
    assert report.tolerance.kl_mean_max == fixed.kl_mean_max  # mean KL is held whatever the floor
    assert "the eager model itself in float16" in format_report(report)
    artifact = open_artifact(out)
    assert artifact.manifest[OWN_ROUNDING_KEY] == own  # what the load gate holds the served graph to
    assert artifact.tolerance == report.tolerance
    assert json.loads((out / "parity.json").read_text())["own_rounding"] == own


def test_a_float16_graph_of_other_weights_fails_whatever_the_floor(wide_float16):
    """Layer 1's K projection 25% larger in the reference: its K are off by a fifth of themselves (the graph's are
    0.8x the reference's), over twice the bound this model's own float16 error raises K/V to (~9%), and verify names
    layer 1."""
    from kvserve.model.checkpoint import load_checkpoint

    checkpoint, out, _ = wide_float16
    other = load_checkpoint(checkpoint)
    attention, config = other.model.layers[1].self_attn, other.config
    q_width, kv_width = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    with torch.no_grad():
        attention.qkv_proj.weight[q_width : q_width + kv_width].mul_(1.25)  # the fused projection's K rows
    report = verify(out, other, provider=PROVIDER)
    assert not report.passed
    assert report.first_failing_layer_head is not None and report.first_failing_layer_head.layer == 1


def test_a_streamed_reference_has_no_own_error_to_measure(tiny_llama_model):
    """A reference over 0.5 GB of float32 weights reads its matrices from the checkpoint in float32 as it runs: no copy
    of it computes in float16, so none is measured and its artifact keeps the fixed bounds."""
    from kvserve.model.weights import ModelWeights, streamed_reference

    streamed = streamed_reference(ModelWeights(tiny_llama_model))
    assert own_rounding(streamed, [prompts(tiny_llama_model.config.vocab_size, (7,))], 2) is None
