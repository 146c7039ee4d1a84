"""The chunk backward on saved features: the features op (phi(q), phi(k) as contiguous rows) and
chunk_bwd's phi_given (q and k are those rows; phi' is taken from them). Where the CUDA chunk
forward and backward would each run a feature pass (chunk_saves_features), autograd writes the
rows once, runs the forward on them with the identity map and saves them in place of q and k.
test_cuda.py checks that this path gives the same bits as the two passes."""
import pytest
import torch

from cases import Case, make_inputs
from conftest import HAS_CUDA

ops = torch.ops.attnrnn


def _phi64(x, feature_map):
    x = x.double()
    if feature_map == "elu1":
        return torch.where(x > 0, x + 1, torch.exp(x))
    return torch.relu(x) if feature_map == "relu" else x


def _kink_and_tail(shape, dtype, device, seed):
    """Normal values, values near elu1's kink (|x| ~ 1e-3) and in exp's tail (down to -120)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    x.view(-1)[::7] *= 1e-3
    x.view(-1)[::11] = -torch.rand(x.view(-1)[::11].shape, generator=g, dtype=torch.float64) * 120
    return x.to(device=device, dtype=dtype)


@pytest.mark.parametrize("feature_map", ["elu1", "relu", "identity"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_features_are_the_feature_map_rounded_once(ar, device, feature_map, dtype):
    q = _kink_and_tail((2, 37, 4, 24), dtype, device, 0)
    k = _kink_and_tail((2, 37, 4, 24), dtype, device, 1)[:, :, ::2]  # two kv heads, strided
    phi_q, phi_k = ops.features(q, k, feature_map)
    for x, phi in ((q, phi_q), (k, phi_k)):
        assert phi.shape == x.shape and phi.dtype == dtype and phi.is_contiguous()
        # phi in float32 of each element, then one rounding to the dtype: within a unit of it of the
        # float64 value (two roundings apart at most), and 0 where that underflows.
        # (fp32: CUDA's expf is within 2 units of the last place.)
        torch.testing.assert_close(phi.double(), _phi64(x, feature_map), rtol=2 * torch.finfo(dtype).eps,
                                   atol=torch.finfo(dtype).tiny)


@pytest.mark.parametrize("feature_map", ["elu1", "relu"])
def test_features_keep_nan(ar, device, feature_map):
    q = torch.tensor([float("nan"), -1.0, 2.0], device=device).view(1, 1, 1, 3)
    phi_q, _ = ops.features(q, q.clone(), feature_map)
    assert torch.isnan(phi_q[0, 0, 0, 0]) and not torch.isnan(phi_q[0, 0, 0, 1:]).any()


# chunk_bwd on features(q, k) with phi_given against chunk_bwd on q and k: the same gradients of
# the raw inputs (float64 and float32: phi' from phi is phi'(x) up to the rounding of phi).
GIVEN_CASES = [
    Case(2, 37, 4, 16, torch.float64, Hkv=2, V=8, initial_state=True, final_state=True),
    Case(1, 45, 2, 16, torch.float64, feature_map="relu", seqlens=(5, 0, 40), final_state=True),
    Case(2, 70, 2, 8, torch.float32, normalize=False, initial_state=True),
    Case(1, 33, 2, 8, torch.float32, feature_map="relu", normalize=False),
]


def _gradients(case, inp, q, k, phi_given):
    """(dq, dk, dv, dS0, dz0) of chunk_bwd after chunk_fwd on the raw inputs."""
    scale, eps = case.K ** -0.5, 1e-6
    S0, z0, cu = inp.get("S0"), inp.get("z0"), inp.get("cu_seqlens")
    o = ops.chunk_fwd(inp["q"], inp["k"], inp["v"], S0, z0, cu, scale, eps, case.feature_map, case.normalize,
                      case.final_state, 0)[0]
    return ops.chunk_bwd(inp["do"], o, inp.get("dS"), inp.get("dz"), q, k, inp["v"], S0, z0, cu, scale, eps,
                         case.feature_map, case.normalize, 0, None, None, phi_given)


@pytest.mark.parametrize("case", GIVEN_CASES, ids=[c.id for c in GIVEN_CASES])
def test_backward_on_given_features_equals_the_backward_on_the_inputs(ar, device, case):
    inp = make_inputs(case, device)
    from_inputs = _gradients(case, inp, inp["q"], inp["k"], False)
    phi_q, phi_k = ops.features(inp["q"], inp["k"], case.feature_map)
    from_features = _gradients(case, inp, phi_q, phi_k, True)
    rtol = 1e-12 if case.dtype == torch.float64 else 1e-5
    for name, a, b in zip(("dq", "dk", "dv", "dS0", "dz0"), from_features, from_inputs):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol, msg=name)


def test_phi_given_changes_the_gradients(ar, device):
    """The comparison above would pass if phi_given were ignored and phi applied twice did no harm;
    it does harm: elu1 of elu1's rows is another map."""
    case = GIVEN_CASES[0]
    inp = make_inputs(case, device)
    phi_q, phi_k = ops.features(inp["q"], inp["k"], case.feature_map)
    given = _gradients(case, inp, phi_q, phi_k, True)
    ignored = _gradients(case, inp, phi_q, phi_k, False)
    assert not torch.allclose(given[0], ignored[0])


@pytest.mark.parametrize("feature_map,dtype,saved", [
    ("elu1", torch.bfloat16, True), ("elu1", torch.float16, True), ("relu", torch.bfloat16, False),
    ("identity", torch.bfloat16, False), ("elu1", torch.float32, False)],
    ids=["elu1-bf16", "elu1-fp16", "relu-bf16", "identity-bf16", "elu1-fp32"])
def test_autograd_saves_features_where_both_passes_would_run(ar, device, feature_map, dtype, saved):
    """On the H200 (sm_90a build, the default wgmma sweeps): elu1 always takes a pass on the
    tensor-core sweeps, relu only where the wgmma sweeps do not apply it themselves, fp32 none (its
    kernels apply phi inline). Never on the CPU."""
    if device == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the expectations are the H200's (other GPUs run the mma.sync sweeps, relu's pass too)")
    q, k, v = (torch.randn(1, 256, 2, 128, device=device, dtype=dtype) for _ in range(3))
    assert ar._C.chunk_saves_features(q, k, v, None, feature_map, False, 0) == (saved and device == "cuda")


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma sweeps need sm_90a")
def test_elu1_forward_and_backward_on_cuda_run_one_feature_pass(ar):
    q, k, v = (torch.randn(1, 4096, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def passes(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = fn()
            torch.cuda.synchronize()
        return out, sum("feature_map_kernel" in e.name for e in prof.events())

    (o, _), forward_passes = passes(lambda: ar.chunk_linear_attn(q, k, v, feature_map="elu1"))
    _, backward_passes = passes(lambda: o.backward(torch.randn_like(o)))
    assert (forward_passes, backward_passes) == (2, 0)  # phi(q) and phi(k), once


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("build,regex", [
    (lambda d: (torch.randn(2, 8, 16, device=d), torch.randn(2, 8, 2, 16, device=d)), r"\bq must be a 4-D tensor"),
    (lambda d: (torch.randn(2, 8, 4, 16, device=d), torch.randn(2, 8, 2, 16, device=d, dtype=torch.float64)),
     r"k must have the dtype of q"),
    (lambda d: (torch.randn(2, 8, 4, 16, device=d), torch.randn(2, 8, 2, 8, device=d)),
     r"k must have the batch, length and head dim of q"),
    (lambda d: (torch.randn(2, 8, 4, 16, device=d)[..., ::2], torch.randn(2, 8, 2, 8, device=d)),
     r"q must have unit stride"),
], ids=["q-3d", "k-dtype", "k-head-dim", "q-strided-last-dim"])
def test_features_reject_bad_input_naming_the_argument(ar, device, build, regex):
    with pytest.raises(ValueError, match=regex):
        ops.features(*build(device), "elu1")


def test_features_reject_an_unknown_feature_map(ar, device):
    q = torch.randn(1, 4, 2, 8, device=device)
    with pytest.raises(ValueError, match="feature_map"):
        ops.features(q, q, "softplus")


def test_features_refuse_to_record_a_gradient(ar, device):
    q = torch.randn(1, 4, 2, 8, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        ops.features(q, q.detach(), "elu1")
    with torch.no_grad():
        phi_q, _ = ops.features(q, q.detach(), "elu1")
    assert not phi_q.requires_grad


def test_opcheck_features_and_the_backward_reading_them(ar, device):
    case = GIVEN_CASES[0].replace(dtype=torch.float32)
    inp = make_inputs(case, device)
    torch.library.opcheck(ops.features.default, (inp["q"], inp["k"], "elu1"))
    phi_q, phi_k = ops.features(inp["q"], inp["k"], "elu1")
    o = ops.chunk_fwd(phi_q, phi_k, inp["v"], None, None, None, 0.25, 1e-6, "identity", True, False, 0)[0]
    torch.library.opcheck(ops.chunk_bwd.default, (inp["do"], o, None, None, phi_q, phi_k, inp["v"], None, None,
                                                  None, 0.25, 1e-6, "elu1", True, 0), {"phi_given": True})
