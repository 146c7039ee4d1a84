"""What only a GPU can show: CPU and CUDA agree, bitwise determinism over many runs, a problem past
2**31 elements (64-bit offsets), bad device-side values stay in bounds, and the current stream.
Skipped without CUDA (the rest of the suite runs on CUDA too through its `device` fixture)."""
import os
import re
import subprocess
import sys

import pytest
import torch

from cases import Case, make_inputs, run
from conftest import HAS_CUDA
from numerics import relative_rms
from test_numerics import baselines_and_reference, check_all, compute_all

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")


bf16, fp16 = torch.bfloat16, torch.float16

# Shapes the tensor-core kernels take (bf16/fp16, K and V in {64, 128}, chunk 64): one-pass and
# two-pass (segment split: few blocks, long sequences) sweeps, every option.
TENSOR_CORE_CASES = [
    Case(2, 300, 3, 64, bf16, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(2, 257, 2, 128, bf16, V=64, initial_state=True, final_state=True),
    Case(1, 190, 4, 64, fp16, Hkv=2, V=128, feature_map="relu", initial_state=True, final_state=True),
    Case(1, 333, 2, 128, bf16, feature_map=None, seqlens=(0, 64, 1, 200, 68)),
    Case(1, 5000, 2, 128, bf16, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 4100, 4, 64, bf16, Hkv=1, initial_state=True, final_state=True),
    Case(1, 3000, 1, 64, fp16, V=128, feature_map="relu"),
    # phi(q), phi(k) precomputed into the workspace: varlen rows and GQA heads
    Case(1, 333, 4, 128, bf16, Hkv=2, seqlens=(0, 64, 1, 200, 68), initial_state=True, final_state=True),
    # fp16 without normalize (the sweeps compiled without the normalizer), GQA, K != V
    Case(2, 300, 2, 128, fp16, Hkv=1, V=64, normalize=False, initial_state=True, final_state=True),
]


@pytest.mark.parametrize("case", TENSOR_CORE_CASES, ids=lambda c: c.id)
def test_tensor_core_path_meets_rules(ar, ref, case):
    ours, base, ref64 = compute_all(ar, ref, "chunk", case, "cuda")
    check_all(ours, base, ref64, case.dtype)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "unnorm"])
def test_zero_scale_gives_zero_outputs_and_gradients_on_the_tensor_cores(ar, normalize):
    """scale = 0 makes w = 0: dq scales its rows by w in the epilogue and takes dd as dd / w."""
    case = Case(2, 200, 2, 128, bf16, normalize=normalize)
    inp = make_inputs(case, "cuda")
    q, k, v = (inp[name].detach().requires_grad_() for name in ("q", "k", "v"))
    o, _ = ar.chunk_linear_attn(q, k, v, scale=0.0, normalize=normalize, feature_map="elu1")
    o.backward(inp["do"])
    for name, x in (("o", o), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.equal(x, torch.zeros_like(x)), name


# The forward's saved denominators (chunk_fwd save_den, which autograd asks for) against a float64
# oracle, and the backward reading them against the backward's own den sweep (den=None). The
# generic-path case (K 48, V 40) saves them too, and its backward ignores them.
SAVED_DEN_CASES = [c for c in TENSOR_CORE_CASES if c.normalize] + [
    Case(1, 150, 4, 48, bf16, Hkv=2, V=40, seqlens=(0, 70, 80), initial_state=True),
    # the dd pass takes 16 (V 64) or 8 (V 128) consecutive rows at a time: across heads and tokens,
    # and past a sequence's end into the next batch entry
    Case(2, 130, 20, 64, bf16, Hkv=4),
    Case(1, 70, 10, 128, bf16, Hkv=5, feature_map=None),
    Case(3, 5, 2, 64, bf16),
]


def _w_oracle(case, inp, scale, eps=1e-6):
    """w = scale / (scale * phi(q) . z_t + eps) in float64, z_t = z0 + the keys up to t of t's sequence.
    The tensor-core forwards round phi(q), phi(k) to the input dtype (their operands); so does this."""
    phi = {None: lambda x: x, "relu": torch.relu, "elu1": lambda x: torch.nn.functional.elu(x) + 1}[case.feature_map]
    tensor_core = case.K in (64, 128) and case.V % 64 == 0
    features = (lambda x: phi(x.float()).to(case.dtype).double()) if tensor_core else (lambda x: phi(x.double()))
    q, k = features(inp["q"]), features(inp["k"])
    k = k.repeat_interleave(case.H // case.Hkv, dim=2)
    bounds = inp["cu_seqlens"].tolist() if "cu_seqlens" in inp else None
    z = torch.zeros_like(k)
    for n in range(case.N):
        b, lo, hi = (0, bounds[n], bounds[n + 1]) if bounds else (n, 0, case.T)
        z[b, lo:hi] = k[b, lo:hi].cumsum(0)
        if "z0" in inp:
            z[b, lo:hi] += inp["z0"][n].double().repeat_interleave(case.H // case.Hkv, dim=0)
    return scale / (scale * (q * z).sum(-1) + eps)


@pytest.mark.parametrize("case", SAVED_DEN_CASES, ids=lambda c: c.id)
def test_saved_denominators_give_the_den_sweeps_gradients(ar, case):
    inp = make_inputs(case, "cuda", positive=case.feature_map is None)
    ops = torch.ops.attnrnn
    scale, fm = case.K ** -0.5, case.feature_map or "identity"
    S0, z0, cu = inp.get("S0"), inp.get("z0"), inp.get("cu_seqlens")
    o, _, _, den = ops.chunk_fwd(inp["q"], inp["k"], inp["v"], S0, z0, cu, scale, 1e-6, fm, True,
                                 case.final_state, 0, True)
    assert den.shape == (case.B, case.T, case.H)
    w_ref = _w_oracle(case, inp, scale)
    assert ((den.double() - w_ref).abs() / w_ref.abs()).max().item() < 1e-3
    args = (inp["do"], o, inp.get("dS"), inp.get("dz"), inp["q"], inp["k"], inp["v"], S0, z0, cu, scale, 1e-6, fm,
            True, 0)
    swept, saved = ops.chunk_bwd(*args), ops.chunk_bwd(*args, den)
    for name, a, b in zip(("dq", "dk", "dv", "dS0", "dz0"), saved, swept):
        assert torch.isfinite(a).all(), name
        if a.numel():
            assert relative_rms(a, b) < 2e-3, name


UNALIGNED_OUT_CASES = [Case(2, 300, 20, 64, bf16, Hkv=4), Case(1, 200, 10, 128, fp16, feature_map=None)]


@pytest.mark.parametrize("case", UNALIGNED_OUT_CASES, ids=lambda c: c.id)
def test_saved_denominators_with_an_output_view_aligned_to_4_bytes(case):
    # dd reads o in 16-byte pieces where o's rows allow it and in 4-byte ones otherwise: same sums.
    inp = make_inputs(case, "cuda", positive=case.feature_map is None)
    ops = torch.ops.attnrnn
    scale, fm = case.K ** -0.5, case.feature_map or "identity"
    o, _, _, den = ops.chunk_fwd(inp["q"], inp["k"], inp["v"], None, None, None, scale, 1e-6, fm, True, False, 0, True)
    padded = torch.full((*o.shape[:-1], case.V + 2), float("nan"), device="cuda", dtype=o.dtype)
    padded[..., 2:] = o
    o_view = padded[..., 2:]  # 4-byte-aligned rows (the first 4 bytes past a 16-byte boundary)
    assert o_view.data_ptr() % 16 == 4
    bwd = lambda out: ops.chunk_bwd(inp["do"], out, None, None, inp["q"], inp["k"], inp["v"], None, None, None,
                                    scale, 1e-6, fm, True, 0, den)
    for name, a, b in zip(("dq", "dk", "dv"), bwd(o_view), bwd(o)):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name


# ATTNRNN_TC_SEGMENTS (the tile sweep's knob, read once per process) forces the two-pass split.
_FORCED_SPLIT_RUN = """
import sys, torch
sys.path[:0] = sys.argv[2:]
import attnrnn
from cases import Case, make_inputs, run
case = Case(1, 3000, 2, 64, torch.bfloat16, initial_state=True, final_state=True)
torch.save({k: v.cpu() for k, v in run(attnrnn.chunk_linear_attn, case, make_inputs(case, "cuda")).items()},
           sys.argv[1])
"""


def test_forced_segment_split_meets_rules(ar, ref, tmp_path):
    case = Case(1, 3000, 2, 64, torch.bfloat16, initial_state=True, final_state=True)
    path = tmp_path / "forced.pt"
    env = dict(os.environ, ATTNRNN_TC_SEGMENTS="5")
    subprocess.run([sys.executable, "-c", _FORCED_SPLIT_RUN, str(path), *sys.path], env=env, check=True)
    forced = {k: v.cuda() for k, v in torch.load(path).items()}
    ours, base, ref64 = compute_all(ar, ref, "chunk", case, "cuda")
    check_all(forced, base, ref64, case.dtype)
    for name in ours:  # the library's own split (2 segments here) and the forced one
        assert relative_rms(forced[name], ours[name]) < 8e-3, name


def _qkv(B, T, H, K, V, dtype, Hkv=None, device="cuda", seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    Hkv = Hkv or H
    q = torch.randn(B, T, H, K, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(B, T, Hkv, K, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(B, T, Hkv, V, generator=gen).to(device=device, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_and_cuda_agree(ar, op, dtype):
    case = Case(2, 150, 4, 48, dtype, Hkv=2, V=40, initial_state=True, final_state=True)
    inp = make_inputs(case, "cuda")
    on_cuda = run(getattr(ar, f"{op}_linear_attn"), case, inp)
    on_cpu = run(getattr(ar, f"{op}_linear_attn"), case, {k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                           for k, v in inp.items()})
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    for name in on_cpu:
        assert relative_rms(on_cuda[name].cpu(), on_cpu[name]) <= tol, name


@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
def test_forward_and_backward_are_bitwise_deterministic_B64(ar, normalize):
    q, k, v = _qkv(64, 300, 2, 64, 64, torch.bfloat16)
    opts = dict(normalize=normalize, feature_map="elu1", output_final_state=True)
    o0, s0 = ar.chunk_linear_attn(q, k, v, **opts)
    for _ in range(100):
        o, s = ar.chunk_linear_attn(q, k, v, **opts)
        assert torch.equal(o, o0) and torch.equal(s.S, s0.S)
    do = torch.randn_like(o0)
    grads0 = None
    for _ in range(50):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        ar.chunk_linear_attn(*ins, **opts)[0].backward(do)
        grads = [t.grad for t in ins]
        if grads0 is None:
            grads0 = grads
        assert all(torch.equal(a, b) for a, b in zip(grads, grads0))


def test_past_2_pow_31_elements_uses_64_bit_offsets(ar, ref):
    """q, k, v, o of 2**31 + 16384*128 elements each, packed as 16513 sequences of 1024 tokens:
    the last sequences start past element 2**31 and must match the reference."""
    H, K, L = 1, 128, 1024
    N = (2**31) // (L * H * K) + 1
    T = N * L
    cu = torch.arange(0, T + 1, L, device="cuda", dtype=torch.int64)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, H, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, T, H, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, T, H, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    assert q.numel() > 2**31
    o, _ = ar.chunk_linear_attn(q, k, v, cu_seqlens=cu, feature_map="elu1")
    for n in (0, N - 2, N - 1):
        s = slice(n * L, (n + 1) * L)
        o_ref, _ = ref.parallel_linear_attn(q[:, s].double(), k[:, s].double(), v[:, s].double(),
                                            feature_map="elu1")
        assert relative_rms(o[:, s].double(), o_ref) <= 8e-3, n


def test_bad_cu_seqlens_values_stay_in_bounds(ar):
    """CUDA does not read cu_seqlens back (no sync): offsets past T are clamped, not followed."""
    q, k, v = _qkv(1, 64, 2, 16, 16, torch.float32)
    o, _ = ar.chunk_linear_attn(q, k, v, cu_seqlens=torch.tensor([0, 40, 10**9], device="cuda"))
    torch.cuda.synchronize()
    o_ok, _ = ar.chunk_linear_attn(q, k, v, cu_seqlens=torch.tensor([0, 40, 64], device="cuda"))
    assert torch.equal(o, o_ok)


def test_step_index_outside_the_pool_gives_nan_and_leaves_the_pool_alone(ar):
    q, k, v = (torch.randn(3, 2, 16, device="cuda") for _ in range(3))
    S, z = torch.randn(4, 2, 16, 16, device="cuda"), torch.rand(4, 2, 16, device="cuda") + 1
    S0, z0 = S.clone(), z.clone()
    o = ar.linear_attn_step(q, k, v, (S, z), state_indices=torch.tensor([1, 7, -1], device="cuda"))
    assert torch.isnan(o[1]).all() and torch.equal(o[2], torch.zeros_like(o[2]))
    assert torch.equal(S[[0, 2, 3]], S0[[0, 2, 3]]) and torch.equal(z[[0, 2, 3]], z0[[0, 2, 3]])
    assert not torch.equal(S[1], S0[1])


def test_ops_run_on_the_current_stream(ar):
    q, k, v = _qkv(4, 500, 4, 64, 64, torch.bfloat16)
    expected, _ = ar.chunk_linear_attn(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got, _ = ar.chunk_linear_attn(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, expected)


# ATTNRNN_BWD_CONCURRENT=0 (the default; read once per process) runs the backward's dq, dk and dv sweeps one
# after another on the call's stream instead of overlapping them on side streams; ATTNRNN_TC_WGMMA
# picks the wgmma sweeps with dk and dv fused at K = V = 64 (7), apart (3), or the mma.sync ones
# (1: the forward only on wgmma).
_SWEEPS_RUN = """
import sys, torch
sys.path[:0] = sys.argv[3:]
import attnrnn
from cases import Case, make_inputs, run
import test_cuda
torch.save([{k: v.cpu() for k, v in run(attnrnn.chunk_linear_attn, c, make_inputs(c, "cuda")).items()}
            for c in getattr(test_cuda, sys.argv[2])], sys.argv[1])
"""
OVERLAP_CASES = [
    Case(2, 300, 4, 64, bf16, Hkv=2, initial_state=True, final_state=True),
    Case(1, 3000, 2, 128, bf16, V=64, feature_map=None, normalize=False),  # two-pass sweeps
    Case(1, 3000, 2, 64, bf16, V=128, initial_state=True, final_state=True),  # two-pass 128-token dq
    Case(1, 3000, 2, 128, bf16, feature_map=None, normalize=False),  # dk and dv share a state pass
]


def _sweeps_in_subprocess(path, cases="OVERLAP_CASES", **env):
    subprocess.run([sys.executable, "-c", _SWEEPS_RUN, str(path), cases, *sys.path], env=dict(os.environ, **env),
                   check=True)
    return torch.load(path)


@pytest.mark.parametrize("wgmma", ["63", "127", "3", "1"],
                         ids=["wgmma-default", "wgmma-pair-everywhere", "wgmma-sweeps", "mma-sync-sweeps"])
def test_backward_sweeps_overlapped_or_in_one_stream_agree_bitwise(ar, tmp_path, wgmma):
    overlapped = _sweeps_in_subprocess(tmp_path / "overlapped.pt", ATTNRNN_BWD_CONCURRENT="1", ATTNRNN_TC_WGMMA=wgmma)
    one_stream = _sweeps_in_subprocess(tmp_path / "one.pt", ATTNRNN_BWD_CONCURRENT="0", ATTNRNN_TC_WGMMA=wgmma)
    for case, a, b in zip(OVERLAP_CASES, overlapped, one_stream):
        for name in a:
            assert torch.equal(a[name], b[name]), f"{case.id}: {name}"


# dk and dv from one sweep (K = V = 64, the default) against the two sweeps: GQA, states, two-pass
# sweeps, varlen, fp16, a feature map, both normalize modes. (Both also meet the rules against the
# float64 reference: the fused sweep is what the other K = V = 64 tests run.)
FUSED_DKV_CASES = [
    Case(2, 300, 4, 64, bf16, Hkv=2, initial_state=True, final_state=True),
    Case(1, 3000, 2, 64, bf16, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 3000, 2, 64, bf16, initial_state=True, final_state=True),  # two-pass with dz partials
    Case(1, 333, 4, 64, fp16, Hkv=1, feature_map="relu", seqlens=(0, 64, 1, 200, 68)),
]


def _assert_runs_agree(cases, runs, others):
    for case, a, b in zip(cases, runs, others):
        for name in a:
            assert torch.isfinite(a[name]).all(), f"{case.id}: {name}"
            if a[name].numel():
                assert relative_rms(a[name], b[name]) < 4e-3, f"{case.id}: {name}"


def _assert_agree_and_equal_in(names, cases, runs, others):
    """runs agree with others within the bound, and bit for bit in the outputs `names`."""
    _assert_runs_agree(cases, runs, others)
    for case, a, b in zip(cases, runs, others):
        for name in names:
            assert torch.equal(a[name], b[name]), f"{case.id}: {name} should be the same in both"


def _assert_bitwise_but(moved, cases, runs, others):
    """runs agree with others within the bound, and bit for bit in every output but `moved`."""
    _assert_runs_agree(cases, runs, others)
    for case, a, b in zip(cases, runs, others):
        for name in a:
            if name != moved:
                assert torch.equal(a[name], b[name]), f"{case.id}: {name}"


def test_fused_dk_dv_sweep_agrees_with_the_two_sweeps(ar, tmp_path):
    fused = _sweeps_in_subprocess(tmp_path / "fused.pt", "FUSED_DKV_CASES", ATTNRNN_TC_WGMMA="7")
    apart = _sweeps_in_subprocess(tmp_path / "apart.pt", "FUSED_DKV_CASES", ATTNRNN_TC_WGMMA="3")
    _assert_runs_agree(FUSED_DKV_CASES, fused, apart)


# Pass 1 of the split sweeps on chunk_wg_state_kernel (the default; the fused dk + dv sweep's with the
# normalizer excepted) against the sweeps' own kernels as pass 1 (ATTNRNN_WG_STATE_PASS=0), by the
# default shape rule and with every sweep on 128-token chunks (mask 127): the 64-token and the
# 128-token forward, dq, dk and dv and the fused dk + dv sweep, at inner dims 64 and 128, GQA (dk and
# dv sum over a group's heads), states, varlen, fp16 (dk weighs dout instead of phi(q)), a feature
# map, both normalize modes (dk's dz and the rows' w with it). Both sum the state's products in the
# same order and agree bitwise without the normalizer; with it the state pass sums z on m64n8 wgmmas
# with a tile of ones, which the 64-token sweeps' own pass 1 does on mma.sync, and everything
# downstream agrees within a bound. Each sweep runs its own state pass here
# (ATTNRNN_BWD_SHARED_STATE_PASS=0, ATTNRNN_FWD_STATES_FOR_DQ=0 and ATTNRNN_BWD_FUSED_DKV128=0; the
# shared ones for dk and dv and for the forward and dq, and the fused dk + dv sweep, are compared below).
STATE_PASS_CASES = [
    Case(1, 5000, 4, 128, bf16, Hkv=2, initial_state=True, final_state=True),
    Case(1, 5000, 2, 128, bf16, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 3000, 2, 128, bf16, V=64, initial_state=True, final_state=True),  # dq at inner dim 64
    Case(1, 3000, 2, 64, bf16, V=128, feature_map=None, normalize=False),
    Case(1, 3000, 2, 64, bf16, V=128, initial_state=True, final_state=True),
    Case(1, 4003, 2, 128, fp16, feature_map="relu", seqlens=(0, 64, 1, 3870, 68), initial_state=True, final_state=True),
    Case(1, 5000, 4, 128, bf16, Hkv=2, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 4003, 2, 128, fp16, feature_map="relu", normalize=False, seqlens=(0, 64, 1, 3870, 68)),
    Case(1, 3000, 4, 64, bf16, Hkv=2, feature_map=None, normalize=False),  # the fused dk + dv sweep
]


@pytest.mark.parametrize("wgmma", ["63", "127"], ids=["shape-rule", "pair-everywhere"])
def test_state_pass_agrees_with_the_sweeps_own_pass_1(ar, tmp_path, wgmma):
    separate = dict(ATTNRNN_TC_WGMMA=wgmma, ATTNRNN_BWD_SHARED_STATE_PASS="0", ATTNRNN_FWD_STATES_FOR_DQ="0",
                    ATTNRNN_BWD_FUSED_DKV128="0")
    state_pass = _sweeps_in_subprocess(tmp_path / "state.pt", "STATE_PASS_CASES", ATTNRNN_WG_STATE_PASS="1", **separate)
    own = _sweeps_in_subprocess(tmp_path / "own.pt", "STATE_PASS_CASES", ATTNRNN_WG_STATE_PASS="0", **separate)
    _assert_runs_agree(STATE_PASS_CASES, state_pass, own)
    for case, a, b in zip(STATE_PASS_CASES, state_pass, own):
        if not case.normalize:
            for name in a:
                assert torch.equal(a[name], b[name]), f"{case.id}: {name}"


# dk's partials from dv's state pass (unnormalized, K = V = 128: the second, seventh and eighth cases
# above) against dk's own. dv's pass and sweep are the same either way, so everything but dk is
# bitwise equal (dS0 comes from dv's sweep). dk's state is the transpose of dv's; in bf16 the two
# passes scale different operands (dk phi(q), dv dout) before rounding, so dk agrees within the
# bound; it also meets the float64 rules (test_tensor_core_path_meets_rules' split case at
# K = V = 128 runs the shared pass).
@pytest.mark.parametrize("wgmma", ["63", "127"], ids=["shape-rule", "pair-everywhere"])
def test_shared_dk_dv_state_pass_agrees_with_separate_passes(ar, tmp_path, wgmma):
    shared = _sweeps_in_subprocess(tmp_path / "shared.pt", "STATE_PASS_CASES", ATTNRNN_TC_WGMMA=wgmma,
                                   ATTNRNN_BWD_SHARED_STATE_PASS="1", ATTNRNN_BWD_FUSED_DKV128="0")
    apart = _sweeps_in_subprocess(tmp_path / "apart.pt", "STATE_PASS_CASES", ATTNRNN_TC_WGMMA=wgmma,
                                  ATTNRNN_BWD_SHARED_STATE_PASS="0", ATTNRNN_BWD_FUSED_DKV128="0")
    _assert_bitwise_but("dk", STATE_PASS_CASES, shared, apart)


# dk and dv from one sweep at K = V = 128 (unnormalized, where they would share dv's state pass: the
# second, seventh (GQA) and eighth (fp16, a feature map, varlen) cases above) against the two sweeps
# with the shared pass. dv's products, their order and its state are those of dv's own sweep, so dv
# and dS0 are bitwise equal, and so is everything else but dk, which sums the same terms in another
# order and agrees within the bound (it also meets the float64 rules: test_tensor_core_path_meets_rules'
# split case at K = V = 128 runs the fused sweep).
def test_fused_dk_dv_sweep_at_k128_agrees_with_the_two_sweeps(ar, tmp_path):
    fused = _sweeps_in_subprocess(tmp_path / "fused.pt", "STATE_PASS_CASES", ATTNRNN_BWD_FUSED_DKV128="1")
    apart = _sweeps_in_subprocess(tmp_path / "apart.pt", "STATE_PASS_CASES", ATTNRNN_BWD_FUSED_DKV128="0")
    _assert_bitwise_but("dk", STATE_PASS_CASES, fused, apart)


# The fused dk + dv sweep where dv alone would not split: its blocks (one per (sequence, kv head))
# fill at most half the SMs, dv's 64-token blocks more (on the H200: 64 and 128 of 132 SMs), so the
# two sweeps run paired on 128-token chunks and the fused one in two segments after dv's state
# pass. dk and dv (and dS0) round differently from the pairs' and agree within the bound; the
# forward and dq are the same kernels, bitwise equal.
UNSPLIT_DV_CASES = [
    Case(2, 2048, 32, 128, bf16, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 2100, 96, 128, fp16, Hkv=48, feature_map="relu", normalize=False),
]


def test_fused_dk_dv_sweep_at_k128_agrees_with_the_paired_sweeps(ar, tmp_path):
    fused = _sweeps_in_subprocess(tmp_path / "fused.pt", "UNSPLIT_DV_CASES", ATTNRNN_BWD_FUSED_DKV128="1")
    paired = _sweeps_in_subprocess(tmp_path / "paired.pt", "UNSPLIT_DV_CASES", ATTNRNN_BWD_FUSED_DKV128="0")
    _assert_agree_and_equal_in(("o", "dq"), UNSPLIT_DV_CASES, fused, paired)


# dq's partials from the forward's state pass, saved by the autograd kernel (unnormalized,
# K = V = 128, where the forward and dq split alike: the second, seventh (GQA) and eighth (fp16, a
# feature map, varlen) cases above; with every sweep paired the forward runs the 128-token pair and
# saves none) against dq's own state pass. The forward, dk and dv do not change, so everything but dq
# is bitwise equal; dq's state is the transpose of the forward's, summed over the same 64-token tiles
# with the operands' roles swapped, so dq agrees within the bound.
def test_forward_segment_states_for_dq_agree_with_dq_own_pass(ar, tmp_path):
    saved = _sweeps_in_subprocess(tmp_path / "saved.pt", "STATE_PASS_CASES", ATTNRNN_FWD_STATES_FOR_DQ="1")
    own = _sweeps_in_subprocess(tmp_path / "own.pt", "STATE_PASS_CASES", ATTNRNN_FWD_STATES_FOR_DQ="0")
    _assert_bitwise_but("dq", STATE_PASS_CASES, saved, own)


# The comparison above would pass without the state pass ever running (no split, or a launch that
# fell back to the sweeps' own pass 1): one forward+backward at a split shape runs it for the forward,
# dq, dk and dv (TcRole 0, 2, 3, 4 in the kernels' names) with normalize; without it dv's pass is
# dk's too (launch.cuh, shared_dkv_state_pass) and the forward's is dq's (fwd_states_for_dq_floats),
# so neither dk's nor dq's runs.
@pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma sweeps and their state pass need sm_90a")
@pytest.mark.parametrize("Hkv", [2, 1], ids=["H2-Hkv2", "H2-Hkv1"])
@pytest.mark.parametrize("normalize", [False, True], ids=["unnormalized", "normalize"])
def test_state_pass_runs_for_every_split_sweep(ar, normalize, Hkv):
    case = Case(1, 8192, 2, 128, bf16, Hkv=Hkv, feature_map=None, normalize=normalize)
    inp = make_inputs(case, "cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(ar.chunk_linear_attn, case, inp)
        torch.cuda.synchronize()
    roles = {int(m.group(1)) for e in prof.events() if "chunk_wg_state_kernel" in e.name
             for m in [re.search(r"TcRole\)(\d)", e.name)] if m}
    expected = {0, 2, 3, 4} if normalize else {0, 4}
    assert roles == expected, sorted(e.name for e in prof.events() if "chunk_wg" in e.name)
    fused = any("chunk_wg_dkv_kernel" in e.name for e in prof.events())
    assert fused == (not normalize), "dk and dv from one sweep at K = V = 128 exactly without the normalizer"


# relu applied by the wgmma sweeps to their own q and k tiles in shared memory (the default) against
# relu(q), relu(k) first written to the workspace by a pass (ATTNRNN_PHI_IN_SWEEP=0): the sweeps see
# the same tiles either way (x < 0 ? 0 : x of each element), so every output is bitwise equal. Both
# dtypes, inner dims 64 and 128, both normalize modes, GQA, varlen, split sweeps with their state
# passes (the fused dk + dv sweeps at K = V = 64 and 128), states; each wgmma mask's set of kernels.
PHI_CASES = [
    Case(2, 300, 4, 64, bf16, Hkv=2, feature_map="relu", initial_state=True, final_state=True),
    Case(1, 333, 4, 128, fp16, Hkv=1, feature_map="relu", seqlens=(0, 64, 1, 200, 68)),
    Case(1, 5000, 4, 128, bf16, Hkv=2, feature_map="relu", initial_state=True, final_state=True),  # split, normalize
    Case(1, 5000, 2, 128, bf16, feature_map="relu", normalize=False, initial_state=True,
         final_state=True),  # fused dk + dv at 128
    Case(1, 4003, 2, 128, fp16, feature_map="relu", normalize=False, seqlens=(0, 64, 1, 3870, 68)),
    Case(1, 3000, 4, 64, bf16, Hkv=2, feature_map="relu", normalize=False),  # the fused dk + dv sweep at 64
    Case(2, 2048, 32, 128, bf16, feature_map="relu", normalize=False),  # the fused sweep where dv alone would not split
    Case(1, 3000, 2, 64, bf16, V=128, feature_map="relu"),
]


@pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability() != (9, 0), reason="the wgmma sweeps need sm_90a")
@pytest.mark.parametrize("wgmma", ["63", "127", "3"], ids=["shape-rule", "pair-everywhere", "64-token-sweeps"])
def test_relu_in_the_sweeps_equals_the_feature_pass(ar, tmp_path, wgmma):
    in_sweep = _sweeps_in_subprocess(tmp_path / "in.pt", "PHI_CASES", ATTNRNN_TC_WGMMA=wgmma)
    pass_ = _sweeps_in_subprocess(tmp_path / "pass.pt", "PHI_CASES", ATTNRNN_TC_WGMMA=wgmma, ATTNRNN_PHI_IN_SWEEP="0")
    _assert_bitwise_but(None, PHI_CASES, in_sweep, pass_)


# Saved features (the default) against the feature pass in the forward and again in the backward
# (ATTNRNN_SAVE_FEATURES=0): autograd's forward writes phi(q), phi(k) with the pass's kernel, runs
# on them with the identity map and the backward reads them (phi_given), so the sweeps, wgmma
# (mask 63) or mma.sync (mask 0), see the same rows either way, phi' included, and every output is
# bitwise equal. GQA, varlen, states, split sweeps, the forward's segment states for dq (K = V = 128
# without normalize), both dtypes; relu, which is saved on the mma.sync sweeps only (the wgmma
# forward applies it itself).
SAVED_PHI_CASES = [
    Case(2, 300, 4, 64, bf16, Hkv=2, initial_state=True, final_state=True),
    Case(2, 300, 4, 64, bf16, V=128, noncontig=True),  # strided q, k, v: the features op reads them
    Case(1, 333, 4, 128, fp16, Hkv=1, seqlens=(0, 64, 1, 200, 68)),
    Case(1, 5000, 4, 128, bf16, Hkv=2, initial_state=True, final_state=True),  # split, normalize
    Case(1, 5000, 2, 128, bf16, normalize=False, initial_state=True, final_state=True),  # dq on the forward's states
    Case(1, 3000, 4, 64, bf16, Hkv=2, normalize=False),
    Case(2, 300, 4, 64, bf16, feature_map="relu"),
]


_SAVES_RUN = """
import sys, torch
sys.path[:0] = sys.argv[2:]
import attnrnn
from cases import make_inputs
import test_cuda
flags = []
for c in test_cuda.SAVED_PHI_CASES:
    inp = make_inputs(c, "cuda")
    flags.append(attnrnn._C.chunk_saves_features(inp["q"], inp["k"], inp["v"], inp.get("cu_seqlens"),
                                                 c.feature_map, c.normalize, 0))
torch.save(flags, sys.argv[1])
"""


@pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability() != (9, 0), reason="the wgmma sweeps need sm_90a")
@pytest.mark.parametrize("wgmma", ["63", "0"], ids=["wgmma-sweeps", "mma-sync-sweeps"])
def test_saved_features_equal_a_second_feature_pass(ar, tmp_path, wgmma):
    # Every elu1 case saves its features under both masks; relu only on the mma.sync sweeps.
    subprocess.run([sys.executable, "-c", _SAVES_RUN, str(tmp_path / "flags.pt"), *sys.path],
                   env=dict(os.environ, ATTNRNN_TC_WGMMA=wgmma), check=True)
    expected = [c.feature_map == "elu1" or wgmma == "0" for c in SAVED_PHI_CASES]
    assert torch.load(tmp_path / "flags.pt") == expected
    saved = _sweeps_in_subprocess(tmp_path / "saved.pt", "SAVED_PHI_CASES", ATTNRNN_TC_WGMMA=wgmma)
    two_passes = _sweeps_in_subprocess(tmp_path / "passes.pt", "SAVED_PHI_CASES", ATTNRNN_TC_WGMMA=wgmma,
                                       ATTNRNN_SAVE_FEATURES="0")
    _assert_bitwise_but(None, SAVED_PHI_CASES, saved, two_passes)


# The comparison above would pass if neither run applied relu in the sweeps: by default a
# forward+backward with relu at a wgmma shape runs no feature_map_kernel, and one with elu1 runs the
# pass (its exp in the sweeps measured slower than the pass: launch_plan.cuh).
@pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability() != (9, 0), reason="the wgmma sweeps need sm_90a")
@pytest.mark.parametrize("feature_map,feature_pass", [("relu", False), ("elu1", True)], ids=["relu", "elu1"])
def test_only_elu1_runs_a_feature_pass_on_the_wgmma_sweeps(ar, feature_map, feature_pass):
    case = Case(1, 8192, 2, 128, bf16, feature_map=feature_map, normalize=False)
    inp = make_inputs(case, "cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(ar.chunk_linear_attn, case, inp)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("chunk_wg" in n for n in names), "the wgmma sweeps did not run"
    assert any("feature_map_kernel" in n for n in names) == feature_pass


# The forward at K = 128 on 128-token chunks and two warpgroups (bit 3 of ATTNRNN_TC_WGMMA, with bit 6
# at every shape) against the 64-token forward: GQA, states, varlen (a 64-token sequence leaves the second
# warpgroup no rows; 200 tokens end in a 72-token chunk), two-pass with z partials, fp16 with a
# feature map, V = 64 and 128; the backward's gradients come through the saved denominators. (With
# normalize, identity features on signed inputs put q.z near zero, where the two chunkings' rounding
# differs by more than the bound: those cases run against the float64 reference elsewhere.)
PAIR_FORWARD_CASES = [
    Case(2, 300, 4, 128, bf16, Hkv=2, initial_state=True, final_state=True),
    Case(1, 333, 4, 128, bf16, Hkv=1, V=64, seqlens=(0, 64, 1, 200, 68), initial_state=True, final_state=True),
    Case(1, 5000, 4, 128, bf16, Hkv=2, initial_state=True, final_state=True),  # two-pass, GQA
    Case(1, 5000, 2, 128, bf16, feature_map=None, normalize=False),  # two-pass, no z
    Case(2, 190, 2, 128, fp16, feature_map="relu"),
    Case(1, 5000, 4, 128, fp16, Hkv=2, initial_state=True, final_state=True),  # fp16's z in fp32, two-pass
]


def test_pair_forward_agrees_with_the_64_token_forward(ar, tmp_path):
    pair = _sweeps_in_subprocess(tmp_path / "pair.pt", "PAIR_FORWARD_CASES", ATTNRNN_TC_WGMMA="79")
    single = _sweeps_in_subprocess(tmp_path / "single.pt", "PAIR_FORWARD_CASES", ATTNRNN_TC_WGMMA="7")
    _assert_runs_agree(PAIR_FORWARD_CASES, pair, single)
    for case, a, b in zip(PAIR_FORWARD_CASES, pair, single):
        assert not torch.equal(a["o"], b["o"]), f"{case.id}: the 128-token forward did not run"


# The 128-token forward at every shape (ATTNRNN_TC_WGMMA=79) against the float64 reference, by the rules
# (docs/design.md §4): its normalizer sums z on the tensor cores into the running accumulator, so a
# long sequence (one pass, and two with a segment split) checks that z and the outputs keep their
# accuracy; fp16 keeps a . z in fp32.
PAIR_FORWARD_RULE_CASES = [
    Case(1, 16384, 2, 128, bf16, initial_state=True, final_state=True),
    Case(4, 2000, 2, 128, fp16, Hkv=1, final_state=True),
]


def test_pair_forward_meets_rules_on_long_sequences(ar, ref, tmp_path):
    pair = _sweeps_in_subprocess(tmp_path / "pair.pt", "PAIR_FORWARD_RULE_CASES", ATTNRNN_TC_WGMMA="79")
    for case, ours in zip(PAIR_FORWARD_RULE_CASES, pair):
        inp = make_inputs(case, "cuda")
        base, ref64 = baselines_and_reference(ref, case, inp)
        check_all({name: x.cuda() for name, x in ours.items()}, base, ref64, case.dtype)


# dq at V = 128 on 128-token chunks and two warpgroups (bit 4 of ATTNRNN_TC_WGMMA, with bit 6 at every
# shape) against the 64-token dq sweep: GQA, states, varlen with short chunks, K = 64 (one output tile),
# two-pass with z partials, fp16 with a feature map (phi'), normalize on and off.
PAIR_DQ_CASES = [
    Case(2, 300, 4, 128, bf16, Hkv=2, initial_state=True, final_state=True),
    Case(1, 333, 4, 64, bf16, Hkv=2, V=128, seqlens=(0, 64, 1, 200, 68), initial_state=True, final_state=True),
    Case(1, 5000, 4, 128, bf16, Hkv=2, initial_state=True, final_state=True),  # two-pass, GQA
    Case(1, 5000, 2, 128, bf16, feature_map=None, normalize=False),  # two-pass, no z
    Case(2, 190, 2, 128, fp16, feature_map="relu"),
]


def test_pair_dq_sweep_agrees_with_the_64_token_sweep(ar, tmp_path):
    pair = _sweeps_in_subprocess(tmp_path / "pair.pt", "PAIR_DQ_CASES", ATTNRNN_TC_WGMMA="95")
    single = _sweeps_in_subprocess(tmp_path / "single.pt", "PAIR_DQ_CASES", ATTNRNN_TC_WGMMA="79")
    _assert_runs_agree(PAIR_DQ_CASES, pair, single)
    for case, a, b in zip(PAIR_DQ_CASES, pair, single):
        assert torch.equal(a["o"], b["o"]), f"{case.id}: the forward should be the same in both"
        assert not torch.equal(a["dq"], b["dq"]), f"{case.id}: the 128-token dq sweep did not run"


# dk at V = 128 and dv at K = 128 on 128-token chunks and two warpgroups (bit 5 of
# ATTNRNN_TC_WGMMA, with bit 6 at every shape) against the 64-token sweeps: group sums over GQA heads, states,
# varlen with short chunks, K != V (only one of the two paired), two-pass with dz partials, fp16 with
# a feature map (phi'), normalize on and off.
PAIR_DK_DV_CASES = [
    Case(2, 300, 4, 128, bf16, Hkv=2, initial_state=True, final_state=True),
    Case(1, 333, 4, 64, bf16, Hkv=2, V=128, seqlens=(0, 64, 1, 200, 68), initial_state=True, final_state=True),
    Case(1, 333, 2, 128, bf16, Hkv=1, V=64, seqlens=(0, 64, 1, 200, 68), initial_state=True, final_state=True),
    Case(1, 5000, 4, 128, bf16, Hkv=2, initial_state=True, final_state=True),  # two-pass, GQA
    Case(1, 5000, 2, 128, bf16, feature_map=None, normalize=False),  # two-pass, no dz
    Case(2, 190, 2, 128, fp16, feature_map="relu"),
    Case(2, 190, 2, 128, fp16, feature_map="relu", normalize=False),
    Case(1, 333, 4, 128, bf16, Hkv=2, seqlens=(0, 64, 1, 200, 68)),  # no states: dd columns weigh in dk
]


def test_pair_dk_dv_sweeps_agree_with_the_64_token_sweeps(ar, tmp_path):
    pair = _sweeps_in_subprocess(tmp_path / "pair.pt", "PAIR_DK_DV_CASES", ATTNRNN_TC_WGMMA="127")
    single = _sweeps_in_subprocess(tmp_path / "single.pt", "PAIR_DK_DV_CASES", ATTNRNN_TC_WGMMA="95")
    _assert_agree_and_equal_in(("o", "dq"), PAIR_DK_DV_CASES, pair, single)
    for case, a, b in zip(PAIR_DK_DV_CASES, pair, single):
        # dk is paired at V = 128, dv at K = 128; the other runs the same 64-token sweep in both
        for name, paired in (("dk", case.V == 128), ("dv", case.K == 128)):
            assert torch.equal(a[name], b[name]) != paired, f"{case.id}: {name} paired={paired}"



# The default mask pairs a sweep where the 64-token sweep's blocks would leave SMs with one
# warpgroup (one wave, no segment split), and keeps the 64-token sweeps where two of their blocks
# share an SM (a split at few blocks, or more blocks than SMs); the bf16 normalize forward pairs in
# a split too. Each case with the mask that forces what the default should pick: 127 every sweep
# paired, 79 the forward alone (the backward's results depend on the forward's o and w), 7 none.
def _shape_rule_cases():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return [
        (Case(sms // 8, 130, 4, 128, bf16, initial_state=True, final_state=True), "127"),  # sms // 8 * 8 blocks
        (Case(1, 5000, 2, 128, bf16, initial_state=True, final_state=True), "79"),  # 4 blocks: a split
        (Case(1, 5000, 2, 128, bf16, normalize=False, initial_state=True, final_state=True), "7"),
        (Case(1, 5000, 2, 128, fp16, initial_state=True, final_state=True), "7"),  # fp16 keeps the rule
        (Case(sms, 70, 4, 128, bf16), "7"),  # 8 blocks per SM
    ]


SHAPE_RULE = _shape_rule_cases() if torch.cuda.is_available() else []
SHAPE_RULE_CASES = [case for case, _ in SHAPE_RULE]


def test_default_mask_picks_the_sweeps_of_the_shape_rule(ar, tmp_path):
    runs = {mask: _sweeps_in_subprocess(tmp_path / f"mask{mask}.pt", "SHAPE_RULE_CASES", ATTNRNN_TC_WGMMA=mask)
            for mask in ("63", "127", "79", "7")}
    for i, (case, forced) in enumerate(SHAPE_RULE):
        for name in ("o", "dq", "dk", "dv"):
            assert torch.equal(runs["63"][i][name], runs[forced][i][name]), f"{case.id}: {name} should be as mask {forced}"
            assert not torch.equal(runs["127"][i][name], runs["7"][i][name]), \
                f"{case.id}: {name}: the two sweeps should differ in rounding"


def test_forward_backward_under_cuda_graph_replay(ar):
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=bf16).requires_grad_() for _ in range(3))
    do = torch.randn(2, 300, 4, 64, device="cuda", dtype=bf16)

    def step():
        o, _ = ar.chunk_linear_attn(q, k, v, feature_map="elu1")
        return torch.autograd.grad(o, (q, k, v), do)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graph asks
        for _ in range(2):
            expected = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


def test_decode_step_under_cuda_graph_replay(ar):
    B, H, K = 8, 4, 64
    S = torch.zeros(B, H, K, K, device="cuda")
    z = torch.zeros(B, H, K, device="cuda")
    q, k, v = (torch.randn(B, H, K, device="cuda") for _ in range(3))
    S_ref, z_ref = S.clone(), z.clone()
    ar.linear_attn_step(q, k, v, (S, z))  # warm-up outside the capture
    ar.linear_attn_step(q, k, v, (S_ref, z_ref))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = ar.linear_attn_step(q, k, v, (S, z))
    for _ in range(3):
        graph.replay()
        o_ref = ar.linear_attn_step(q, k, v, (S_ref, z_ref))
        torch.cuda.synchronize()
        assert torch.equal(o, o_ref) and torch.equal(S, S_ref)
