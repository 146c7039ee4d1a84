"""The R1/R2/R3 checker itself can fail: it accepts a correctly rounded result and rejects a
result with an error larger than the baseline's, a biased result, and a non-finite one."""
import pytest
import torch

from numerics import assert_close_by_rules, rounding_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ref_and_baseline(dtype):
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(2, 64, 3, 8, generator=g, dtype=torch.float64)
    # A baseline a few ulps off: the error of computing in the test dtype.
    ulp = torch.finfo(dtype).eps
    noise = torch.randn(ref.shape, generator=g, dtype=torch.float64) * 4 * ulp
    return ref, (ref * (1 + noise)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_accepts_reference_rounded_to_the_test_dtype(dtype):
    ref, base = _ref_and_baseline(dtype)
    m = assert_close_by_rules(ref.to(dtype), base, ref, kind="fwd", dtype=dtype)
    assert m["max_err"] <= m["rounding"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rejects_error_beyond_c_times_baseline(dtype):
    ref, base = _ref_and_baseline(dtype)
    bad = ref.clone()
    bad[0, 5, 1, 2] += 4 * (base.double() - ref).abs().max() + 0.1  # one large outlier
    with pytest.raises(AssertionError, match="R1 max"):
        assert_close_by_rules(bad.to(dtype), base, ref, kind="bwd", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rejects_mean_error_beyond_baseline(dtype):
    ref, base = _ref_and_baseline(dtype)
    # Every element off by 1.9x the baseline's error, same sign: max within 2x, mean not.
    bad = ref + 1.9 * (base.double() - ref)
    with pytest.raises(AssertionError, match="R1 mean"):
        assert_close_by_rules(bad.to(torch.float64), base, ref, kind="fwd", dtype=dtype)


def test_rejects_fp32_mean_error_beyond_c_times_baseline():
    """In fp32 the mean factor is c (= 2 forward): a baseline whose error sits in one element and
    a result off everywhere by most of that maximum pass the max rule and fail the mean rule."""
    ref, base = _ref_and_baseline(torch.float32)
    base = ref.clone()
    base[0, 0, 0, 0] += 1e-5
    bad = ref + 1.5e-5
    with pytest.raises(AssertionError, match="R1 mean"):
        assert_close_by_rules(bad, base.float(), ref, kind="fwd", dtype=torch.float32)


def test_rejects_relative_rms_error_in_the_last_quarter_only():
    ref = torch.randn(1, 100, 2, 4, dtype=torch.float64)
    ref[:, :75] *= 100  # the early positions dominate the norm of the whole tensor
    # A loose baseline (so R1 passes) and an output 3e-5 off, only in the last quarter.
    base = (ref + 1e-2 * torch.randn_like(ref)).float()
    out = ref.clone()
    out[:, 75:] *= 1 + 3e-5
    m = assert_close_by_rules(out, base, ref, kind="fwd", dtype=torch.float32, t_dim=None)
    assert m["rel_rms"] <= 1e-5  # invisible on the whole tensor
    with pytest.raises(AssertionError, match="last quarter"):
        assert_close_by_rules(out, base, ref, kind="fwd", dtype=torch.float32, t_dim=1)


def test_rejects_non_finite():
    ref = torch.randn(1, 8, 1, 4, dtype=torch.float64)
    out = ref.float()
    out[0, 3, 0, 1] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_by_rules(out, ref.float(), ref, kind="fwd", dtype=torch.float32)


def test_rounding_term_is_computed_in_the_test_dtype():
    ref = torch.full((4,), 1.0 / 3.0, dtype=torch.float64)
    # In float64 the term would be ~1e-17; in bf16 it is a bf16 ulp-sized quantity.
    assert rounding_error(ref, torch.float64).max() < 1e-15
    assert rounding_error(ref, torch.bfloat16).max() > 1e-4
