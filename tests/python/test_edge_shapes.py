"""Degenerate shapes: B = 0, T = 0, all-empty varlen; shapes and dtypes of what comes back."""
import pytest
import torch

from cases import Case, make_inputs, run

OPS = ["chunk", "recurrent"]


@pytest.mark.parametrize("op", OPS)
def test_batch_zero(ar, op, device):
    case = Case(0, 10, 2, 16, torch.float32, initial_state=True, final_state=True)
    inp = make_inputs(case, device)
    out = run(getattr(ar, f"{op}_linear_attn"), case, inp)
    assert out["o"].shape == (0, 10, 2, 16) and out["S"].shape == (0, 2, 16, 16)
    assert out["z"].shape == (0, 2, 16)
    for g, leaf in [("dq", "q"), ("dk", "k"), ("dv", "v"), ("dS0", "S0"), ("dz0", "z0")]:
        assert out[g].shape == inp[leaf].shape


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_time_zero_passes_state_through(ar, op, device, dtype):
    case = Case(3, 0, 4, 16, dtype, Hkv=2, V=8, initial_state=True, final_state=True)
    inp = make_inputs(case, device)
    out = run(getattr(ar, f"{op}_linear_attn"), case, inp)
    assert out["o"].shape == (3, 0, 4, 8) and out["o"].dtype == dtype
    assert torch.equal(out["S"], inp["S0"]) and torch.equal(out["z"], inp["z0"])
    # d(final)/d(initial) is the identity when no token is seen.
    assert torch.equal(out["dS0"], inp["dS"]) and torch.equal(out["dz0"], inp["dz"])


@pytest.mark.parametrize("op", OPS)
def test_time_zero_without_initial_state_gives_zero_state(ar, op, device):
    case = Case(2, 0, 2, 8, torch.float32, final_state=True)
    inp = make_inputs(case, device)
    o, st = getattr(ar, f"{op}_linear_attn")(inp["q"], inp["k"], inp["v"], output_final_state=True)
    assert torch.equal(st.S, torch.zeros(2, 2, 8, 8, device=device))
    assert torch.equal(st.z, torch.zeros(2, 2, 8, device=device))


@pytest.mark.parametrize("op", OPS)
def test_varlen_all_sequences_empty(ar, op, device):
    case = Case(1, 0, 2, 8, torch.float32, initial_state=True, final_state=True, seqlens=(0, 0, 0))
    inp = make_inputs(case, device)
    out = run(getattr(ar, f"{op}_linear_attn"), case, inp)
    assert torch.equal(out["S"], inp["S0"]) and torch.equal(out["z"], inp["z0"])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=lambda d: str(d).split(".")[-1])
def test_output_and_state_dtypes(ar, op, device, dtype):
    case = Case(1, 5, 2, 8, dtype, final_state=True)
    inp = make_inputs(case, device)
    o, st = getattr(ar, f"{op}_linear_attn")(inp["q"], inp["k"], inp["v"], output_final_state=True)
    want = torch.float64 if dtype == torch.float64 else torch.float32
    assert o.dtype == dtype and st.S.dtype == want and st.z.dtype == want
    assert isinstance(st, ar.LinearAttnState)
    o, st = getattr(ar, f"{op}_linear_attn")(inp["q"], inp["k"], inp["v"], normalize=False,
                                            output_final_state=True)
    assert st.z is None
    o, st = getattr(ar, f"{op}_linear_attn")(inp["q"], inp["k"], inp["v"])
    assert st is None


@pytest.mark.parametrize("op", OPS + ["streaming"])
@pytest.mark.parametrize("B,T", [(2, 0), (0, 5)], ids=["T0", "B0"])
def test_backward_of_an_empty_output_through_sum(ar, op, device, B, T):
    """o.sum().backward() hands the backward an empty gradient with all strides 0."""
    q = torch.randn(B, T, 2, 8, device=device, requires_grad=True)
    k, v = torch.randn(B, T, 2, 8, device=device), torch.randn(B, T, 2, 8, device=device)
    o = ar.softmax.streaming_attn(q, k, v) if op == "streaming" else getattr(ar, f"{op}_linear_attn")(q, k, v)[0]
    o.sum().backward()
    assert q.grad.shape == q.shape


def test_step_over_an_empty_pool_skips_every_row(ar, device):
    q, k, v = torch.randn(2, 2, 8, device=device), torch.randn(2, 2, 8, device=device), torch.randn(2, 2, 8, device=device)
    S, z = torch.zeros(0, 2, 8, 8, device=device), torch.zeros(0, 2, 8, device=device)
    o = ar.linear_attn_step(q, k, v, (S, z), state_indices=torch.tensor([-1, -1], device=device))
    assert torch.equal(o, torch.zeros_like(o))


def test_step_batch_zero(ar, device):
    q, k, v = (torch.randn(0, 2, 8, device=device) for _ in range(3))
    S, z = torch.zeros(4, 2, 8, 8, device=device), torch.ones(4, 2, 8, device=device)
    o = ar.linear_attn_step(q, k, v, (S, z))
    assert o.shape == (0, 2, 8)
    assert torch.equal(S, torch.zeros_like(S))


@pytest.mark.parametrize("op", OPS + ["step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_relu_feature_map_keeps_nan(ar, op, device, dtype):
    """relu(NaN) is NaN, as torch.relu and the reference have it: a NaN in q reaches the output
    instead of reading as 0 (bf16 at K = 64 runs the CUDA tensor-core sweeps)."""
    q, k, v = (torch.randn(1, 70, 2, 64, device=device, dtype=dtype) for _ in range(3))
    q[0, 3, 1, 2] = float("nan")
    if op == "step":
        S, z = torch.zeros(1, 2, 64, 64, device=device), torch.ones(1, 2, 64, device=device)
        o = ar.linear_attn_step(q[:, 3], k[:, 3], v[:, 3], (S, z), feature_map="relu")[:, None]
        t = 0
    else:
        o = getattr(ar, f"{op}_linear_attn")(q, k, v, feature_map="relu")[0]
        t = 3
        assert torch.isfinite(o[0, :t]).all() and torch.isfinite(o[0, t + 1:]).all()
    assert torch.isnan(o[0, t, 1]).all() and torch.isfinite(o[0, t, 0]).all()
