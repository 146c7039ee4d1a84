"""R6 and the decode step: prefill + step-by-step decode and split/resume through (S, z) equal
one long call; linear_attn_step against the reference; state pools and state_indices."""
import pytest
import torch

from cases import Case, make_inputs, run
from numerics import R2_TOL, relative_rms

from conftest import HAS_CUDA

DT = [torch.float32, torch.bfloat16]


def _inputs(B, T, H, Hkv, K, V, dtype, device):
    g = torch.Generator().manual_seed(3)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(B, T, H, K), mk(B, T, Hkv, K), mk(B, T, Hkv, V)


@pytest.mark.parametrize("dtype", DT, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "unnorm"])
def test_prefill_then_decode_equals_one_call(ar, device, dtype, normalize):
    B, T, T0, H, Hkv, K, V = 2, 90, 67, 4, 2, 32, 48
    q, k, v = _inputs(B, T, H, Hkv, K, V, dtype, device)
    kw = dict(feature_map="elu1", normalize=normalize)
    o_all, st_all = ar.chunk_linear_attn(q, k, v, output_final_state=True, **kw)
    o_pre, st = ar.chunk_linear_attn(q[:, :T0], k[:, :T0], v[:, :T0], output_final_state=True, **kw)
    assert st.S.dtype == torch.float32 and (st.z is None) == (not normalize)
    S = st.S.clone()
    z = st.z.clone() if normalize else None
    outs = [ar.linear_attn_step(q[:, t], k[:, t], v[:, t], (S, z), **kw) for t in range(T0, T)]
    o_dec = torch.stack(outs, 1)
    # The decode sums q'.S through the state, the chunk op partly inside the chunk: different
    # summation orders, so judge by the R2 relative RMS of the dtype (unnormalized outputs are
    # sums of large terms that cancel, elementwise relative tolerances do not apply). The states
    # too: both are fp32 sums, but the chunk op's tensor-core sweeps (bf16 here) multiply phi(k)
    # rounded to the input dtype, as a bf16 matmul would, where the step keeps phi(k) in fp32.
    tol = R2_TOL[dtype]
    assert relative_rms(o_pre, o_all[:, :T0]) <= tol
    assert relative_rms(o_dec, o_all[:, T0:]) <= tol
    assert relative_rms(S, st_all.S) <= tol
    if normalize:
        assert relative_rms(z, st_all.z) <= tol


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_split_and_resume_equals_one_call_forward_and_backward(ar, device, op):
    """Gradients flow through the state handed from the first call to the second."""
    case = Case(2, 100, 2, 16, torch.float32, V=24, initial_state=True, final_state=True)
    inp = make_inputs(case, device)
    fn = getattr(ar, f"{op}_linear_attn")
    whole = run(fn, case, inp)
    split = 37

    def two_calls(q, k, v, initial_state=None, **kw):
        o1, st1 = fn(q[:, :split], k[:, :split], v[:, :split], initial_state=initial_state, **kw)
        o2, st2 = fn(q[:, split:], k[:, split:], v[:, split:], initial_state=st1, **kw)
        return torch.cat([o1, o2], 1), st2

    parts = run(two_calls, case, inp)
    for name in whole:
        torch.testing.assert_close(parts[name], whole[name], msg=lambda m: f"{name}: {m}")


# (H, Hkv, K, V). The 12:1 query group puts 600 elements of q in a CUDA block (more than one per
# thread of 256) and takes two register passes over the heads (8, then 4).
STEP_HEADS = [(4, 2, 60, 20), (12, 1, 50, 24)]


@pytest.mark.parametrize("dtype", DT + [torch.float16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("feature_map", [None, "elu1", "relu"])
@pytest.mark.parametrize("heads", STEP_HEADS, ids=[f"H{h}-Hkv{g}-K{k}-V{v}" for h, g, k, v in STEP_HEADS])
def test_step_matches_reference(ar, ref, device, dtype, rank, feature_map, heads):
    B, (H, Hkv, K, V) = 3, heads
    normalize = feature_map is not None
    q, k, v = (x[:, 0] for x in _inputs(B, 1, H, Hkv, K, V, dtype, device))
    if rank == 4:
        q, k, v = q[:, None], k[:, None], v[:, None]
    S = torch.randn(B, Hkv, K, V, device=device)
    z = torch.rand(B, Hkv, K, device=device) * 5 + 1 if normalize else None
    S_ref = S.double()
    z_ref = z.double() if normalize else None
    kw = dict(feature_map=feature_map, normalize=normalize, scale=0.3)
    o = ar.linear_attn_step(q, k, v, (S, z), **kw)
    o_ref = ref.linear_attn_step(q.double(), k.double(), v.double(), (S_ref, z_ref), **kw)
    assert o.shape == (B, 1, H, V) if rank == 4 else (B, H, V)
    assert o.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(o, o_ref.to(dtype), **tol)
    torch.testing.assert_close(S, S_ref.float(), rtol=1e-5, atol=1e-5)
    if normalize:
        torch.testing.assert_close(z, z_ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_step_state_indices_address_pool_rows_and_skip_negative(ar, ref, device, index_dtype):
    P, B, H, K, V = 6, 4, 2, 16, 8
    q, k, v = (x[:, 0] for x in _inputs(B, 1, H, H, K, V, torch.float32, device))
    S = torch.randn(P, H, K, V, device=device)
    z = torch.rand(P, H, K, device=device) + 1
    idx = torch.tensor([5, -1, 0, 2], dtype=index_dtype, device=device)
    S_ref, z_ref = S.clone().double(), z.clone().double()
    before_S, before_z = S.clone(), z.clone()
    o = ar.linear_attn_step(q, k, v, (S, z), feature_map="elu1", state_indices=idx)
    o_ref = ref.linear_attn_step(q.double(), k.double(), v.double(), (S_ref, z_ref),
                                 feature_map="elu1", state_indices=idx)
    torch.testing.assert_close(o, o_ref.float())
    assert torch.equal(o[1], torch.zeros_like(o[1])), "skipped row must output zeros"
    for row in (1, 3, 4):  # rows nobody addressed: bitwise untouched
        assert torch.equal(S[row], before_S[row]) and torch.equal(z[row], before_z[row])
    for row in (5, 0, 2):
        torch.testing.assert_close(S[row], S_ref[row].float())
        torch.testing.assert_close(z[row], z_ref[row].float())
        assert not torch.equal(S[row], before_S[row])


# Rows 3 and 1 are named twice, padding (-1) may repeat, rows 2 and 4-7 of the pool of 8 are named
# by nobody. As the kernel defines it, the batch is the one where the later entries of a shared row
# are padding.
DUP_INDICES = [3, 1, 3, 0, 1, -1, -1]
DUP_AS_UPDATED = [3, 1, -1, 0, -1, -1, -1]
DUP_SHAPES = [(4, 2, 64, 64)]


@pytest.mark.requires_cuda
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "unnorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads", DUP_SHAPES,
                         ids=[f"B{len(DUP_INDICES)}-H{h}-Hkv{g}-K{k}-V{v}" for h, g, k, v in DUP_SHAPES])
def test_cuda_step_duplicate_indices_poison_their_rows_and_update_the_row_once(ar, ref, heads, dtype, normalize,
                                                                               index_dtype):
    """CUDA cannot reject a duplicate state index without a host sync (the CPU raises ValueError):
    every entry whose pool row another entry names too outputs NaN, for every head; the row is
    updated once, by the first entry naming it; unique entries and other rows are bitwise unaffected."""
    (H, Hkv, K, V), B, P = heads, len(DUP_INDICES), 8
    gen = torch.Generator().manual_seed(11)
    mk = lambda *s: torch.randn(*s, generator=gen).cuda()  # noqa: E731
    q, k, v = mk(B, H, K).to(dtype), mk(B, Hkv, K).to(dtype), mk(B, Hkv, V).to(dtype)
    S0 = mk(P, Hkv, K, V)
    z0 = (torch.rand(P, Hkv, K, generator=gen) + 1).cuda() if normalize else None
    kw = dict(feature_map="elu1" if normalize else None, normalize=normalize)

    def step(indices):
        S, z = S0.clone(), z0.clone() if normalize else None
        idx = torch.tensor(indices, dtype=index_dtype, device="cuda")
        return ar.linear_attn_step(q, k, v, (S, z), state_indices=idx, **kw), S, z

    o, S, z = step(DUP_INDICES)
    # The same kernel on the same grid (same B): bitwise comparable.
    o_one, S_one, z_one = step(DUP_AS_UPDATED)
    shared, unique, padding, untouched = [0, 1, 2, 4], [3], [5, 6], [2, 4, 5, 6, 7]
    assert torch.isnan(o[shared]).all(), "every entry of a shared row outputs NaN"
    assert torch.equal(o[unique], o_one[unique]) and not o_one[unique].isnan().any()
    assert torch.equal(o[padding], torch.zeros_like(o[padding]))
    assert torch.equal(S, S_one), "rows 3 and 1 updated by their first entries only, once"
    assert torch.equal(S[untouched], S0[untouched])
    assert all(not torch.equal(S[r], S0[r]) for r in (3, 1, 0))
    if normalize:
        assert torch.equal(z, z_one) and torch.equal(z[untouched], z0[untouched])

    # ... and that batch is stepped right: against the reference, first entries only.
    S_ref, z_ref = S0.double(), z0.double() if normalize else None
    o_ref = ref.linear_attn_step(q.double(), k.double(), v.double(), (S_ref, z_ref),
                                 state_indices=torch.tensor(DUP_AS_UPDATED), **kw)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(o[unique], o_ref[unique].to(dtype), **tol)
    torch.testing.assert_close(S, S_ref.float(), rtol=1e-5, atol=1e-5)
    if normalize:
        torch.testing.assert_close(z, z_ref.float(), rtol=1e-5, atol=1e-5)


def test_step_skips_padding_rows_over_poisoned_output_memory(ar, device):
    """The zero rows of skipped entries are written, not left as whatever memory held."""
    B, H, K, V = 64, 2, 16, 16
    held = [torch.full((B * H * V,), float("nan"), device=device) for _ in range(4)]
    del held
    q, k, v = (torch.randn(B, H, d, device=device) for d in (K, K, V))
    S = torch.zeros(B, H, K, V, device=device)
    z = torch.ones(B, H, K, device=device)
    idx = torch.full((B,), -1, dtype=torch.int64, device=device)
    o = ar.linear_attn_step(q, k, v, (S, z), state_indices=idx)
    assert torch.equal(o, torch.zeros_like(o))
    assert torch.equal(S, torch.zeros_like(S)) and torch.equal(z, torch.ones_like(z))


def test_step_unnormalized_state_without_z(ar, device):
    B, H, K, V = 2, 2, 8, 8
    q, k, v = (torch.randn(B, H, d, device=device) for d in (K, K, V))
    S = torch.zeros(B, H, K, V, device=device)
    o = ar.linear_attn_step(q, k, v, ar.LinearAttnState(S, None), normalize=False, scale=1.0)
    S_expect = k.unsqueeze(-1) * v.unsqueeze(-2)
    torch.testing.assert_close(S, S_expect)
    torch.testing.assert_close(o, torch.einsum("bhk,bhkv->bhv", q, S_expect))


def test_step_bumps_the_version_of_the_state_it_overwrites(ar, device):
    """Like PyTorch's in-place ops: a backward that saved the old state must refuse, not use the
    overwritten values silently."""
    q, k, v = (torch.randn(2, 2, 8, device=device) for _ in range(3))
    w = torch.randn(2, 2, 8, 8, device=device, requires_grad=True)
    S = w * 1.0
    loss = (S * S).sum()  # saves S for its backward
    z = torch.rand(2, 2, 8, device=device) + 1
    before = (S._version, z._version)
    ar.linear_attn_step(q, k, v, (S.detach(), z))  # detach() shares S's storage and version
    assert (S._version, z._version) == (before[0] + 1, before[1] + 1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_softmax_step_bumps_the_version_of_the_caches_it_writes(ar):
    device = "cpu"  # the softmax ops have CPU kernels only so far
    k_cache = torch.randn(2, 16, 2, 8, device=device)
    v_cache = torch.randn(2, 16, 2, 8, device=device)
    lengths = torch.tensor([3, 5], dtype=torch.int32, device=device)
    q = torch.randn(2, 4, 8, device=device)
    k_new, v_new = torch.randn(2, 2, 8, device=device), torch.randn(2, 2, 8, device=device)
    before = (k_cache._version, v_cache._version)
    ar.softmax.softmax_attn_step(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new)
    assert (k_cache._version, v_cache._version) == (before[0] + 1, before[1] + 1)
