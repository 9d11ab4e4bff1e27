"""Parity tolerances (contract/tolerances.py): KL between two sets of logits, and bounds that scale with the numbers
they judge where they are relative."""

import numpy as np
import pytest

from kvserve.contract.tolerances import TOLERANCES, kl_divergence, log_softmax, logits_bound


def test_kl_is_zero_for_equal_logits_and_positive_otherwise_whatever_the_offset():
    logits = np.random.default_rng(0).normal(size=(3, 20))
    assert np.allclose(kl_divergence(logits, logits + 7.0), 0.0, atol=1e-12)  # a constant shift is the same distribution
    assert np.all(kl_divergence(logits, logits[::-1]) >= 0) and kl_divergence(logits, logits * 2).sum() > 0
    assert np.allclose(np.exp(log_softmax(logits)).sum(-1), 1.0)


def test_relative_bounds_scale_with_the_largest_eager_logit_and_absolute_ones_do_not():
    eager = np.array([[1.0, -50.0, 3.0]])
    assert logits_bound(TOLERANCES["float32"], eager) == TOLERANCES["float32"].logits_max_abs * 50
    assert logits_bound(TOLERANCES["int8"], eager) == TOLERANCES["int8"].logits_max_abs
    assert set(TOLERANCES) == {"float32", "float16", "int8", "int4"}
    assert all(TOLERANCES[p].text is not None for p in ("int8", "int4"))  # quantized artifacts are held on real text


def test_a_floor_raises_only_float16s_bounds_and_only_above_them():
    from kvserve.contract.tolerances import with_own_rounding

    half = TOLERANCES["float16"]
    raised = with_own_rounding(half, 0.02, 0.001)
    assert half.own_rounding_multiple == 4.0
    assert (raised.logits_max_abs, raised.kv_max_abs) == (pytest.approx(0.08), half.kv_max_abs)  # 4x where above, else fixed
    assert raised.kl_mean_max == half.kl_mean_max
    assert with_own_rounding(half, float("inf"), 0.02) == half  # float16 overflowing the model: no floor, the bounds refuse it
    assert with_own_rounding(half, float("nan"), 0.02) == half
    assert with_own_rounding(TOLERANCES["float32"], 0.02, 0.02) == TOLERANCES["float32"]  # fixed bounds
