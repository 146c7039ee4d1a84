"""What only a GPU can show: CPU and CUDA agree, bitwise determinism over many runs, a problem past
2**31 elements (64-bit offsets), bad device-side values stay in bounds, and the current stream.
Skipped without CUDA (the rest of the suite runs on CUDA too through its `device` fixture)."""
import re

import pytest
import torch

from cases import Case, make_inputs, run
from conftest import HAS_CUDA
from numerics import R2_TOL, relative_rms
from test_nonfinite_causality import _free_rows
from test_numerics import baselines_and_reference, check_all, compute_all

pytestmark = pytest.mark.requires_cuda


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


# Head dims other than 64 and 128 on the 64-token wgmma sweeps, their tiles padded with zeros (tiles.h,
# padded_dims): inner dims below 64, between 64 and 128, up to 192 (DI = 192) and past it (DI = 256),
# output dims that end inside a 64-column tile, K != V both ways, split sweeps (few blocks, long
# sequences), varlen, GQA, states, every feature map, both normalize modes.
PADDED_CASES = [
    Case(2, 300, 4, 32, bf16, initial_state=True, final_state=True),
    Case(2, 257, 3, 96, bf16, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 190, 4, 96, fp16, Hkv=2, feature_map="relu"),
    Case(1, 333, 2, 48, bf16, V=80, seqlens=(0, 64, 1, 200, 68), initial_state=True, final_state=True),
    Case(2, 300, 2, 64, bf16, V=96, normalize=False, initial_state=True, final_state=True),
    Case(2, 300, 2, 128, fp16, Hkv=1, V=40, initial_state=True, final_state=True),
    Case(1, 300, 2, 16, bf16, V=24, feature_map="relu"),
    Case(1, 4100, 4, 32, bf16, Hkv=1, initial_state=True, final_state=True),
    Case(1, 5000, 2, 96, bf16, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 3000, 1, 80, fp16, V=112, feature_map="relu", initial_state=True, final_state=True),
    Case(2, 200, 2, 96, bf16, V=192, initial_state=True, final_state=True),
    Case(2, 300, 2, 256, bf16, initial_state=True, final_state=True),
    Case(1, 333, 4, 192, fp16, Hkv=2, feature_map="relu", normalize=False, seqlens=(0, 64, 1, 200, 68),
         initial_state=True, final_state=True),
    Case(2, 257, 2, 64, bf16, V=256, feature_map=None),
    Case(1, 4100, 2, 200, bf16, V=136, initial_state=True, final_state=True),
    Case(1, 4100, 2, 160, bf16, Hkv=1, V=176, initial_state=True, final_state=True),
]


@pytest.mark.parametrize("case", PADDED_CASES, ids=lambda c: c.id)
def test_padded_head_dims_meet_rules(ar, ref, case):
    ours, base, ref64 = compute_all(ar, ref, "chunk", case, "cuda")
    check_all(ours, base, ref64, case.dtype)


# fp32 on the tensor cores at both of PyTorch's float32 matmul precisions, against baselines run
# under the same setting (the sweeps without the normalizer whose inner dim is at most 64 run on TF32
# wgmma at "high" on sm_90a, the rest on mma.sync). At "high" the products read TF32 operands, as PyTorch's own fp32 matmuls
# then do: R2 at fp16's bound (the same 10 mantissa bits). At "highest", the default, each operand
# is split into two TF32 parts (3xTF32) and the cases meet fp32's rules. One-pass and split sweeps
# (long sequences, few blocks), GQA, varlen, states, K != V, every feature map, both normalize modes.
fp32 = torch.float32
FP32_CASES = [
    Case(2, 300, 4, 64, fp32, initial_state=True, final_state=True),
    Case(1, 257, 2, 128, fp32, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(2, 190, 4, 128, fp32, Hkv=2, feature_map="relu"),
    Case(1, 333, 2, 64, fp32, V=128, seqlens=(0, 64, 1, 200, 68), initial_state=True, final_state=True),
    Case(1, 300, 2, 128, fp32, Hkv=1, V=64, normalize=False),
    Case(1, 4100, 2, 128, fp32, initial_state=True, final_state=True),
    Case(1, 3000, 2, 64, fp32, feature_map="relu", normalize=False),
]


@pytest.fixture(params=["highest", "high"])
def float32_matmul_precision(request):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(request.param)
    yield request.param
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("case", FP32_CASES, ids=lambda c: c.id)
def test_fp32_meets_rules_at_each_matmul_precision(ar, ref, case, float32_matmul_precision):
    ours, base, ref64 = compute_all(ar, ref, "chunk", case, "cuda")
    tf32 = float32_matmul_precision != "highest"
    check_all(ours, base, ref64, case.dtype, r2_tol=R2_TOL[fp16] if tf32 else None)


# fp32 at K = V = 128 runs every sweep on the tensor cores at both precisions, with the weights pass
# only with normalize: on TF32 wgmma at "high" without the normalizer on an sm_90a device, else on the
# mma.sync kernels, on TF32 operands at "high" and split into 3xTF32 (the kernels' last template
# argument, true) at "highest". (The generic kernels launch after them too, and return at once unless
# a row was not finite: args.cuh's note_nonfinite.)
@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "unnormalized"])
def test_fp32_runs_on_the_tensor_cores_at_each_matmul_precision(ar, float32_matmul_precision, normalize):
    names = _kernels_of_a_forward_backward(ar, Case(1, 1000, 2, 128, fp32, normalize=normalize))
    exact = float32_matmul_precision == "highest"
    sm90a = ar._C.built_with_wgmma() and torch.cuda.get_device_capability()[0] == 9
    tf32_wgmma = not exact and not normalize and sm90a
    sweeps = [n for n in names if "mma_scan_kernel<float" in n]
    assert _roles_of("wgmma_tf32_scan_kernel", names) == ({0, 1, 2, 3} if tf32_wgmma else set()), names
    assert _roles_of("mma_scan_kernel<float", sweeps) == (set() if tf32_wgmma else {0, 1, 2, 3}), names
    assert all(f", {str(exact).lower()}, false>(" in n for n in sweeps), sweeps  # kTf32x3, kPadded
    assert any("grad_weights_kernel<float" in n for n in names) == normalize, names


# fp32's mma.sync sweeps split where their (sequence, kv head, 32-column tile) blocks take at most one
# of each SM's two slots (tiles.h, split_segments), where other sweeps wait for half the SMs
# to go idle. A split sweep launches its kernel twice: pass 1 (the state alone), then pass 2. At
# K = V = 64 one sequence and head make two blocks.
@pytest.mark.parametrize("more,splits", [(0, True), (1, False)], ids=["B-half-sm_count", "B-half-sm_count-plus-1"])
def test_fp32_sweeps_split_where_their_blocks_take_one_slot_per_sm(ar, more, splits):
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    names = _kernels_of_a_forward_backward(ar, Case(sm_count // 2 + more, 3072, 1, 64, fp32, feature_map=None))
    launches = [int(m.group(1)) for n in names if "mma_scan_kernel<float" in n
                for m in [re.search(r"ScanRole\)(\d)", n)] if m]
    assert sorted(set(launches)) == [0, 1, 2, 3], names
    assert all(launches.count(role) == (2 if splits else 1) for role in range(4)), launches


# fp32 at head dims other than 64 and 128 (multiples of 8 up to 128) on the padded mma.sync sweeps, at
# both precisions: inner dims below 64 and between 64 and 128, output tiles partly written, a split
# sweep, varlen, GQA, states, feature maps, both normalize modes.
FP32_PADDED_CASES = [
    Case(2, 300, 4, 32, fp32, initial_state=True, final_state=True),
    Case(1, 257, 2, 96, fp32, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 333, 2, 48, fp32, V=80, feature_map="relu", seqlens=(0, 64, 1, 200, 68)),
    Case(1, 4100, 2, 80, fp32, Hkv=1, V=112, initial_state=True, final_state=True),
]


@pytest.mark.parametrize("case", FP32_PADDED_CASES, ids=lambda c: c.id)
def test_fp32_padded_head_dims_meet_rules_at_each_matmul_precision(ar, ref, case, float32_matmul_precision):
    ours, base, ref64 = compute_all(ar, ref, "chunk", case, "cuda")
    tf32 = float32_matmul_precision != "highest"
    check_all(ours, base, ref64, case.dtype, r2_tol=R2_TOL[fp16] if tf32 else None)


WGMMA = pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability()[0] != 9,
                           reason="the wgmma sweeps need an sm_90a device")


# fp32 without the normalizer at "high" on the TF32 wgmma sweeps (scan_wgmma_tf32.cuh), inner dims 64
# and 128: exact and padded dims, output tiles of 32 columns partly written, GQA (dk and dv summing a
# group's heads), varlen, states, split sweeps, feature maps, and K = 64 with V = 128, whose dq and dk
# (inner dim V) run at inner dim 128 beside the forward and dv at 64.
TF32_WGMMA_CASES = [
    Case(2, 300, 4, 64, fp32, Hkv=2, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 333, 4, 32, fp32, Hkv=1, normalize=False, seqlens=(0, 64, 1, 200, 68), initial_state=True,
         final_state=True),
    Case(1, 257, 2, 48, fp32, V=80, feature_map="relu", normalize=False, initial_state=True, final_state=True),
    Case(1, 4100, 2, 64, fp32, normalize=False, initial_state=True, final_state=True),
    Case(1, 3000, 3, 16, fp32, V=24, normalize=False),
    Case(2, 190, 2, 64, fp32, V=128, normalize=False, initial_state=True, final_state=True),
    Case(1, 300, 4, 128, fp32, Hkv=2, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 2100, 2, 96, fp32, V=80, normalize=False, initial_state=True, final_state=True),
]


@pytest.mark.parametrize("float32_matmul_precision", ["high"], indirect=True)
@pytest.mark.parametrize("case", TF32_WGMMA_CASES, ids=lambda c: c.id)
def test_fp32_tf32_wgmma_sweeps_meet_rules(ar, ref, float32_matmul_precision, case):
    ours, base, ref64 = compute_all(ar, ref, "chunk", case, "cuda")
    check_all(ours, base, ref64, case.dtype, r2_tol=R2_TOL[fp16])


# Which sweeps run on TF32 wgmma: all four at "high" without the normalizer, at K = V = 64 and at
# K = 64, V = 128 (dq and dk at inner dim 128); none at "highest" (3xTF32 on mma.sync) or with the
# normalizer.
@WGMMA
@pytest.mark.parametrize("float32_matmul_precision,normalize,V,roles", [
    ("high", False, 64, {0, 1, 2, 3}), ("highest", False, 64, set()), ("high", True, 64, set()),
    ("high", False, 128, {0, 1, 2, 3})], ids=["high-K64-V64", "highest-K64-V64", "high-normalize-K64-V64", "high-K64-V128"],
    indirect=["float32_matmul_precision"])
def test_fp32_sweeps_run_on_tf32_wgmma_where_allowed(ar, float32_matmul_precision, normalize, V, roles):
    names = _kernels_of_a_forward_backward(ar, Case(1, 1000, 2, 64, fp32, V=V, normalize=normalize))
    assert _roles_of("wgmma_tf32_scan_kernel", names) == roles, names
    assert _roles_of("mma_scan_kernel<float", names) == {0, 1, 2, 3} - roles, names


# Padded head dims on the mma.sync sweeps (tiles.h, padded_dims): every sweep of fp32 at K = 96,
# and of bf16 where the plan is forced off wgmma, runs mma_scan_kernel with kPadded (its last template
# argument).
@pytest.mark.parametrize("dtype,forced", [(fp32, False), (bf16, True)], ids=["fp32", "bf16-forced-mma-sync"])
def test_padded_head_dims_run_on_the_padded_mma_sync_sweeps(ar, forced_plan, dtype, forced):
    with forced_plan(mma_sync=forced):
        names = _kernels_of_a_forward_backward(ar, Case(1, 300, 2, 96, dtype, V=80, feature_map=None))
    sweeps = [n for n in names if "mma_scan_kernel<" in n and "wgmma" not in n]
    assert _roles_of("mma_scan_kernel<", sweeps) == {0, 1, 2, 3}, names
    assert all(n.split(">(")[0].endswith(", true") for n in sweeps), sweeps


# Backward shapes whose padded sweeps sit beside exact ones with three or four output tiles: dv at
# K = 128 over V = 192 or 256 (on 64- or 128-token chunks), dq and dk at V = 64 or 128 over K = 192
# or 256, dv at K = 64 over V = 192.
WIDE_OUTPUT_CASES = [
    Case(2, 300, 2, 128, bf16, V=256, initial_state=True, final_state=True),
    Case(1, 3000, 2, 128, bf16, V=192, feature_map=None, normalize=False),
    Case(2, 257, 2, 256, bf16, V=128, initial_state=True, final_state=True),
    Case(2, 300, 2, 192, fp16, V=64, feature_map="relu"),
    Case(2, 300, 2, 64, bf16, V=192, normalize=False, initial_state=True, final_state=True),
]


@pytest.mark.parametrize("pairing", ["auto", "always"])
@pytest.mark.parametrize("case", WIDE_OUTPUT_CASES, ids=lambda c: c.id)
def test_exact_sweeps_beside_padded_ones_meet_rules(ar, ref, forced_plan, case, pairing):
    with forced_plan(pairing=pairing):
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


# What the forward keeps for the backward (chunk_fwd's saved tensor) has the size the fake kernel
# computes for torch.compile (attnrnn._ops.saved_bytes): w per (token, query head) with normalize,
# the forward's segment states for dq without it at K = V = 128 where the sweeps split (sm_90a), and
# nothing elsewhere; also under every forced plan, whose choices the fake kernel follows.
SAVED_SIZE_CASES = [
    Case(2, 300, 3, 64, bf16),
    Case(2, 300, 3, 64, bf16, normalize=False),
    Case(1, 5000, 2, 128, bf16, feature_map=None, normalize=False),
    Case(1, 5000, 4, 128, fp16, Hkv=2, normalize=False, seqlens=(0, 64, 1, 4867, 68)),
    Case(1, 1500, 2, 128, bf16, normalize=False),  # too short to split
    Case(8, 300, 16, 128, bf16, normalize=False),  # enough blocks: no split
    Case(1, 150, 4, 48, bf16, Hkv=2, V=40),  # padded dims: w on the wgmma and mma.sync sweeps alike
    Case(1, 150, 4, 160, bf16, Hkv=2, V=40),  # padded past 128: w on sm_90a, nothing on mma.sync
    Case(1, 150, 4, 44, bf16, Hkv=2, V=40),  # the generic kernels: nothing saved
    Case(1, 150, 4, 64, torch.float32),
    Case(1, 150, 4, 96, torch.float32, V=40),  # fp32 padded (mma.sync): w
    Case(1, 5000, 2, 128, torch.float32, normalize=False),
]


@pytest.mark.parametrize("forced", [{}, {"segments": 5}, {"pairing": "always"}, {"mma_sync": True}],
                         ids=["default", "segments5", "paired", "mma-sync"])
@pytest.mark.parametrize("case", SAVED_SIZE_CASES, ids=lambda c: c.id)
def test_saved_size_is_the_fake_kernels(ar, forced_plan, case, forced):
    inp = make_inputs(case, "cuda")
    cu = inp.get("cu_seqlens")
    with forced_plan(**forced):
        saved = torch.ops.attnrnn.chunk_fwd(inp["q"], inp["k"], inp["v"], None, None, cu, case.K ** -0.5, 1e-6,
                                            "identity", case.normalize, False, 0, True)[3]
        expected = ar._ops.saved_bytes(inp["q"], inp["k"], inp["v"], cu, case.normalize, 0)
    assert saved.dtype == torch.uint8 and saved.numel() == expected


# fp32 keeps w (normalize) on the tensor cores at both precisions.
@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "unnormalized"])
def test_fp32_saved_size_is_the_fake_kernels_at_each_matmul_precision(ar, float32_matmul_precision, normalize):
    case = Case(1, 150, 4, 64, fp32, normalize=normalize)
    inp = make_inputs(case, "cuda")
    saved = torch.ops.attnrnn.chunk_fwd(inp["q"], inp["k"], inp["v"], None, None, None, case.K ** -0.5, 1e-6,
                                        "identity", case.normalize, False, 0, True)[3]
    expected = ar._ops.saved_bytes(inp["q"], inp["k"], inp["v"], None, case.normalize, 0)
    assert saved.numel() == expected == (-(-150 * 4 * 4 // 256) * 256 if normalize else 0)


def test_saved_states_are_kept_where_the_sweeps_split(ar):
    # The cases above would pass if nothing were ever kept: the unnormalized K = V = 128 split keeps
    # the forward's segment states on sm_90a, and normalize keeps 4 bytes per (token, query head).
    case = Case(1, 5000, 2, 128, bf16, normalize=False)
    inp = make_inputs(case, "cuda")
    fwd = lambda normalize: torch.ops.attnrnn.chunk_fwd(inp["q"], inp["k"], inp["v"], None, None, None, 0.1, 1e-6,
                                                        "identity", normalize, False, 0, True)[3]
    assert fwd(True).numel() >= case.B * case.T * case.H * 4
    if ar._C.built_with_wgmma() and torch.cuda.get_device_capability()[0] == 9:
        assert fwd(False).numel() > 0


UNALIGNED_OUT_CASES = [Case(2, 300, 20, 64, bf16, Hkv=4), Case(1, 200, 10, 128, fp16, feature_map=None)]


@pytest.mark.parametrize("case", UNALIGNED_OUT_CASES, ids=lambda c: c.id)
def test_backward_with_an_output_view_aligned_to_4_bytes(case):
    # The backward reads o in 16-byte pieces where o's rows allow it and in 4-byte ones otherwise:
    # the same sums.
    inp = make_inputs(case, "cuda", positive=case.feature_map is None)
    ops = torch.ops.attnrnn
    scale, fm = case.K ** -0.5, case.feature_map or "identity"
    o, _, _, saved = ops.chunk_fwd(inp["q"], inp["k"], inp["v"], None, None, None, scale, 1e-6, fm, True, False, 0,
                                   True)
    padded = torch.full((*o.shape[:-1], case.V + 2), float("nan"), device="cuda", dtype=o.dtype)
    padded[..., 2:] = o
    o_view = padded[..., 2:]  # 4-byte-aligned rows (the first 4 bytes past a 16-byte boundary)
    assert o_view.data_ptr() % 16 == 4
    bwd = lambda out: ops.chunk_bwd(inp["do"], inp["q"], inp["k"], inp["v"], out, saved, None, None, None, None,
                                    None, scale, 1e-6, fm, True, 0)
    for name, a, b in zip(("dq", "dk", "dv"), bwd(o_view), bwd(o)):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name


def _run_cases(ar, cases):
    return [run(ar.chunk_linear_attn, c, make_inputs(c, "cuda")) for c in cases]


@pytest.mark.parametrize("segments", [5, 3])
def test_forced_segment_split_meets_rules(ar, ref, forced_plan, segments):
    case = Case(1, 3000, 2, 64, torch.bfloat16, initial_state=True, final_state=True)
    with forced_plan(segments=segments):
        forced = run(ar.chunk_linear_attn, case, make_inputs(case, "cuda"))
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


def _assert_runs_agree(cases, runs, others):
    for case, a, b in zip(cases, runs, others):
        for name in a:
            assert torch.isfinite(a[name]).all(), f"{case.id}: {name}"
            if a[name].numel():
                assert relative_rms(a[name], b[name]) < 4e-3, f"{case.id}: {name}"


def _assert_bitwise_but(moved, cases, runs, others):
    """runs agree with others within the bound, and bit for bit in every output but `moved`."""
    _assert_runs_agree(cases, runs, others)
    for case, a, b in zip(cases, runs, others):
        for name in a:
            if name not in moved:
                assert torch.equal(a[name], b[name]), f"{case.id}: {name}"


# The mma.sync sweeps (every tensor-core build; on sm_90a the plan picks wgmma) meet the rules on
# their own: one-pass and split, GQA, varlen, both dtypes, feature maps, both normalize modes.
MMA_CASES = [
    Case(2, 300, 4, 64, bf16, Hkv=2, initial_state=True, final_state=True),
    Case(1, 3000, 2, 128, bf16, V=64, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 333, 4, 128, fp16, Hkv=2, feature_map="relu", seqlens=(0, 64, 1, 200, 68)),
    Case(1, 3000, 2, 64, fp16, V=128, normalize=False, initial_state=True, final_state=True),
    Case(1, 3000, 2, 64, fp16, V=128, initial_state=True, final_state=True),
]


# ... and at padded head dims (multiples of 8 up to 128, V past 128 in the forward only), the path of
# GPUs without wgmma: inner dims below 64 and between 64 and 128, output tiles partly written,
# split sweeps, varlen, GQA, states, feature maps, both normalize modes.
MMA_PADDED_CASES = [
    Case(2, 300, 4, 32, bf16, initial_state=True, final_state=True),
    Case(2, 257, 3, 96, bf16, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 190, 4, 96, fp16, Hkv=2, feature_map="relu"),
    Case(1, 333, 2, 48, bf16, V=80, seqlens=(0, 64, 1, 200, 68), initial_state=True, final_state=True),
    Case(1, 4100, 2, 80, bf16, Hkv=1, V=112, initial_state=True, final_state=True),
    Case(1, 3000, 1, 16, fp16, V=24, feature_map="relu", normalize=False),
    Case(1, 300, 2, 40, bf16, V=200, normalize=False),
]


@pytest.mark.parametrize("case", MMA_CASES + MMA_PADDED_CASES, ids=lambda c: c.id)
def test_mma_sync_sweeps_meet_rules(ar, ref, forced_plan, case):
    inp = make_inputs(case, "cuda")
    with forced_plan(mma_sync=True):
        ours = run(ar.chunk_linear_attn, case, inp)
    base, ref64 = baselines_and_reference(ref, case, inp)
    check_all(ours, base, ref64, case.dtype)


# dk and dv from one sweep (K = V = 64; K = V = 128 without the normalizer where the sweeps split)
# against the two sweeps: GQA, states, splits, varlen, fp16, feature maps, both normalize modes. The
# forward and dq are the same kernels either way; at K = V = 128 dv's products, their order and its
# state are those of dv's own sweep, so dv and dS0 are bitwise equal too, and dk, which sums the same
# terms in another order, agrees within the bound (it also meets the float64 rules:
# test_tensor_core_path_meets_rules' split case at K = V = 128 runs the fused sweep).
FUSED_DKV_CASES = [
    Case(2, 300, 4, 64, bf16, Hkv=2, initial_state=True, final_state=True),
    Case(1, 3000, 2, 64, bf16, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 3000, 2, 64, bf16, initial_state=True, final_state=True),  # split with dz partials
    Case(1, 333, 4, 64, fp16, Hkv=1, feature_map="relu", seqlens=(0, 64, 1, 200, 68)),
]
FUSED_DKV128_CASES = [
    Case(1, 5000, 2, 128, bf16, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 5000, 4, 128, bf16, Hkv=2, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 4003, 2, 128, fp16, feature_map="relu", normalize=False, seqlens=(0, 64, 1, 3870, 68)),
    # where dv's own 64-token blocks would not split (fill more than half the SMs) but the fused
    # sweep's do: then the two sweeps pair on 128-token chunks, and everything but the forward and dq
    # rounds differently
    Case(2, 2048, 32, 128, bf16, feature_map=None, normalize=False, initial_state=True, final_state=True),
]


@WGMMA
def test_fused_dk_dv_sweep_agrees_with_the_two_sweeps(ar, forced_plan):
    with forced_plan(separate_grad_kv=True):
        apart = _run_cases(ar, FUSED_DKV_CASES)
    _assert_runs_agree(FUSED_DKV_CASES, _run_cases(ar, FUSED_DKV_CASES), apart)


@WGMMA
def test_fused_dk_dv_sweep_at_k128_agrees_with_the_two_sweeps(ar, forced_plan):
    with forced_plan(separate_grad_kv=True):
        apart = _run_cases(ar, FUSED_DKV128_CASES)
    fused = _run_cases(ar, FUSED_DKV128_CASES)
    _assert_bitwise_but(("dk",), FUSED_DKV128_CASES[:3], fused[:3], apart[:3])
    _assert_bitwise_but(("dk", "dv", "dS0"), FUSED_DKV128_CASES[3:], fused[3:], apart[3:])


# Without the fused sweep, dk's partials come from dv's state pass (unnormalized K = V = 128: dk's
# state is the transpose of dv's), and dk runs no pass 1; dq's come from the forward's state pass.
# Both paths against the float64 reference, by the rules.
@WGMMA
@pytest.mark.parametrize("case", FUSED_DKV128_CASES[:3], ids=lambda c: c.id)
def test_shared_first_passes_meet_rules(ar, ref, forced_plan, case):
    inp = make_inputs(case, "cuda")
    with forced_plan(separate_grad_kv=True):
        ours = run(ar.chunk_linear_attn, case, inp)
    base, ref64 = baselines_and_reference(ref, case, inp)
    check_all(ours, base, ref64, case.dtype)


def _kernels_of_a_forward_backward(ar, case):
    """The names of the attnrnn kernels one forward+backward of `case` launches, in order."""
    inp = make_inputs(case, "cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(ar.chunk_linear_attn, case, inp)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "attnrnn" in e.name]


def _roles_of(kernel, names):
    """The ScanRole template arguments (0 forward, 1 dq, 2 dk, 3 dv) of `kernel` among `names`."""
    return {int(m.group(1)) for n in names if kernel in n for m in [re.search(r"ScanRole\)(\d)", n)] if m}


# Which kernels one forward+backward at a split shape runs (ScanRole in the kernels' names: 0
# forward, 1 dq, 2 dk, 3 dv): with normalize each sweep sums its own segments on the state kernel;
# without it dv's pass is dk's too and the forward's is dq's, and dk and dv run as one sweep.
@WGMMA
@pytest.mark.parametrize("Hkv", [2, 1], ids=["H2-Hkv2", "H2-Hkv1"])
@pytest.mark.parametrize("normalize", [False, True], ids=["unnormalized", "normalize"])
def test_state_pass_runs_for_every_split_sweep(ar, normalize, Hkv):
    case = Case(1, 8192, 2, 128, bf16, Hkv=Hkv, feature_map=None, normalize=normalize)
    names = _kernels_of_a_forward_backward(ar, case)
    expected = {0, 1, 2, 3} if normalize else {0, 3}
    assert _roles_of("segment_state_kernel", names) == expected, names
    fused = any("wgmma_grad_kv_kernel" in n for n in names)
    assert fused == (not normalize), "dk and dv from one sweep at K = V = 128 exactly without the normalizer"


# The padded shapes run every sweep on the wgmma kernels (ScanRole 0 forward, 1 dq, 2 dk, 3 dv), and
# a split sweep's pass 1 on the state kernel.
@WGMMA
@pytest.mark.parametrize("K,V", [(32, 32), (96, 96), (48, 80), (64, 192), (256, 256)],
                         ids=["K32", "K96", "K48-V80", "K64-V192", "K256"])
def test_padded_head_dims_run_on_the_wgmma_sweeps(ar, K, V):
    names = _kernels_of_a_forward_backward(ar, Case(1, 8192, 2, K, bf16, V=V, feature_map=None))
    assert _roles_of("wgmma_scan_kernel", names) == {0, 1, 2, 3}, names
    assert _roles_of("segment_state_kernel", names) == {0, 1, 2, 3}, names


# A wgmma sweep of three blocks per SM (DI = 64) whose real inner dim is at most 32 splits where its
# (sequence, kv head, tile) blocks take at most one slot of each SM, not only where they fill at most
# half the SMs (tiles.h, split_segments): at K = V = 32 as many sequences as SMs split every sweep, one
# more than that none; at K = V = 64 (exact tiles) as many as SMs do not split.
@WGMMA
@pytest.mark.parametrize("K,more,splits", [(32, 0, True), (32, 1, False), (64, 0, False)],
                         ids=["K32-B-sm_count", "K32-B-sm_count-plus-1", "K64-B-sm_count"])
def test_half_padded_dim_64_sweeps_split_where_their_blocks_take_one_slot_per_sm(ar, K, more, splits):
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    names = _kernels_of_a_forward_backward(ar, Case(sm_count + more, 3072, 1, K, bf16, feature_map=None))
    assert {0, 1} <= _roles_of("wgmma_scan_kernel", names), names
    assert _roles_of("segment_state_kernel", names) == ({0, 1, 2, 3} if splits else set()), names


# A padded sweep's tiles cover the least inner dim of 64, 128, 192 and 256 that holds the real one
# (tiles.h, padded_inner_dim): the forward's and dv's over K, dq's and dk's over V.
@WGMMA
@pytest.mark.parametrize("K,V,forward_inner,backward_inner",
                         [(32, 96, 64, 128), (136, 192, 192, 192), (192, 200, 192, 256), (256, 160, 256, 192)],
                         ids=["K32-V96", "K136-V192", "K192-V200", "K256-V160"])
def test_padded_sweeps_take_the_least_inner_dim_that_holds_the_head_dim(ar, K, V, forward_inner, backward_inner):
    names = _kernels_of_a_forward_backward(ar, Case(1, 300, 2, K, bf16, V=V, feature_map=None))
    inner = {int(m.group(1)): int(m.group(2)) for n in names if "wgmma_scan_kernel" in n
             for m in [re.search(r"ScanRole\)(\d), (\d+),", n)] if m}
    assert inner == {0: forward_inner, 1: backward_inner, 2: backward_inner, 3: forward_inner}, names


# relu is applied by the wgmma sweeps to their own q and k tiles; elu1 takes a feature pass (its exp in
# the sweeps measured slower than the pass: features.cuh).
@WGMMA
@pytest.mark.parametrize("feature_map,feature_pass", [("relu", False), ("elu1", True)], ids=["relu", "elu1"])
def test_only_elu1_runs_a_feature_pass_on_the_wgmma_sweeps(ar, feature_map, feature_pass):
    names = _kernels_of_a_forward_backward(ar, Case(1, 8192, 2, 128, bf16, feature_map=feature_map, normalize=False))
    assert any("wgmma_scan_kernel" in n for n in names), "the wgmma sweeps did not run"
    assert any("feature_pass_kernel" in n for n in names) == feature_pass


# The sweeps with inner dim 128 on 128-token chunks and two warpgroups against the 64-token sweeps:
# GQA, states, varlen (a 64-token sequence leaves the second warpgroup no rows; 200 tokens end in a
# 72-token chunk), K != V (only the sweeps with inner dim 128 pair), splits with z partials, fp16 with
# a feature map, both normalize modes. The sweeps that pair round differently; the others are the same
# kernels. (With normalize, identity features on signed inputs put q.z near zero, where the two
# chunkings' rounding differs by more than the bound: those cases run against the float64 reference
# elsewhere.)
PAIR_CASES = [
    Case(2, 300, 4, 128, bf16, Hkv=2, initial_state=True, final_state=True),
    Case(1, 333, 4, 128, bf16, Hkv=1, V=64, seqlens=(0, 64, 1, 200, 68), initial_state=True, final_state=True),
    Case(1, 333, 4, 64, bf16, Hkv=2, V=128, seqlens=(0, 64, 1, 200, 68), initial_state=True, final_state=True),
    Case(1, 5000, 4, 128, bf16, Hkv=2, initial_state=True, final_state=True),
    Case(1, 5000, 2, 128, bf16, feature_map=None, normalize=False),
    Case(2, 190, 2, 128, fp16, feature_map="relu"),
    Case(2, 190, 2, 128, fp16, feature_map="relu", normalize=False),
    Case(1, 5000, 4, 128, fp16, Hkv=2, initial_state=True, final_state=True),
]


@WGMMA
def test_paired_sweeps_agree_with_the_64_token_sweeps(ar, forced_plan):
    with forced_plan(pairing="always", separate_grad_kv=True):
        pair = _run_cases(ar, PAIR_CASES)
    with forced_plan(pairing="never", separate_grad_kv=True):
        single = _run_cases(ar, PAIR_CASES)
    _assert_runs_agree(PAIR_CASES, pair, single)
    for case, a, b in zip(PAIR_CASES, pair, single):
        # the forward and dv pair at K = 128, dq and dk at V = 128; with normalize the backward reads
        # the forward's w, which a paired forward rounds differently
        same_forward = case.K == 64 or not case.normalize
        for name, paired in (("o", case.K == 128), ("dv", case.K == 128), ("dq", case.V == 128),
                             ("dk", case.V == 128)):
            if paired:
                assert not torch.equal(a[name], b[name]), f"{case.id}: {name} did not pair"
            elif same_forward:
                assert torch.equal(a[name], b[name]), f"{case.id}: {name} should be the same kernel's"


# The 128-token forward against the float64 reference, by the rules: its normalizer sums z on the
# tensor cores into the running accumulator, so a long sequence (one pass, and two with a segment
# split) checks that z and the outputs keep their accuracy; fp16 keeps a . z in fp32.
PAIR_RULE_CASES = [
    Case(1, 16384, 2, 128, bf16, initial_state=True, final_state=True),
    Case(4, 2000, 2, 128, fp16, Hkv=1, final_state=True),
]


@WGMMA
@pytest.mark.parametrize("case", PAIR_RULE_CASES, ids=lambda c: c.id)
def test_paired_sweeps_meet_rules_on_long_sequences(ar, ref, forced_plan, case):
    inp = make_inputs(case, "cuda")
    with forced_plan(pairing="always"):
        ours = run(ar.chunk_linear_attn, case, inp)
    base, ref64 = baselines_and_reference(ref, case, inp)
    check_all(ours, base, ref64, case.dtype)


# The plan pairs a sweep where its 64-token blocks would leave SMs with one warpgroup (one wave, no
# split) and keeps the 64-token sweeps where two of their blocks share an SM (a split at few blocks,
# or more blocks than SMs); the bf16 normalize forward pairs in a split too. Which roles ran on the
# 128-token kernel (ScanRole in its name: 0 forward, 1 dq, 2 dk, 3 dv), per case.
def _shape_rule_cases():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return [
        (Case(sms // 8, 130, 4, 128, bf16, initial_state=True, final_state=True), {0, 1, 2, 3}),  # sms // 8 * 8 blocks
        (Case(1, 5000, 2, 128, bf16, initial_state=True, final_state=True), {0}),  # 4 blocks: a split
        (Case(1, 5000, 2, 128, bf16, normalize=False, initial_state=True, final_state=True), set()),
        (Case(1, 5000, 2, 128, fp16, initial_state=True, final_state=True), set()),  # fp16 keeps the rule
        (Case(sms, 70, 4, 128, bf16), set()),  # 8 blocks per SM
    ]


SHAPE_RULE = _shape_rule_cases() if torch.cuda.is_available() else []


@WGMMA
@pytest.mark.parametrize("case,paired", SHAPE_RULE, ids=[c.id for c, _ in SHAPE_RULE])
def test_the_plan_pairs_the_sweeps_of_the_shape_rule(ar, case, paired):
    names = _kernels_of_a_forward_backward(ar, case)
    assert _roles_of("wgmma_pair_scan_kernel", names) == paired, names


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


# A NaN in q, k or v at token t of one (sequence, kv head) on every tensor-core plan: the kernels
# flag that (sequence, kv head) and the generic kernels write it again (linear/args.cuh), so
# - the rows the value cannot reach (test_nonfinite_causality.reachable_rows) stay finite and agree
#   with the call without it within twice bf16's R2 bound (two kernels, each within it);
# - every other (sequence, kv head) is bitwise the tensor-core result of the call without it.
# Sequence 0, token 150 (inside a 64- and a 128-token chunk), kv head 0 of 2 (query heads 0 and 1).
NONFINITE_PLANS = {"default": {}, "mma_sync": {"mma_sync": True}, "segments3": {"segments": 3},
                   "paired": {"pairing": "always"}, "separate_dk_dv": {"separate_grad_kv": True}}


@pytest.mark.parametrize("poisoned", ["q", "k", "v"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "unnorm"])
@pytest.mark.parametrize("D", [64, 128], ids=["K64", "K128"])
@pytest.mark.parametrize("plan", list(NONFINITE_PLANS))
def test_tensor_core_plans_keep_a_nan_causal(ar, forced_plan, plan, D, normalize, poisoned):
    B, T, H, Hkv, t = 2, 300, 4, 2, 150
    g = torch.Generator().manual_seed(D + 2 * normalize)
    shapes = {"q": (B, T, H, D), "k": (B, T, Hkv, D), "v": (B, T, Hkv, D), "do": (B, T, H, D)}
    clean = {n: torch.randn(*s, generator=g).to("cuda", bf16) for n, s in shapes.items()}
    bad = dict(clean, **{poisoned: clean[poisoned].clone()})
    bad[poisoned][0, t, 0, 0] = float("nan")

    def results(x):
        leaves = [x[n].clone().requires_grad_() for n in "qkv"]
        with forced_plan(**NONFINITE_PLANS[plan]):
            o, _ = ar.chunk_linear_attn(*leaves, feature_map="elu1", normalize=normalize)
            grads = torch.autograd.grad(o, leaves, x["do"])
        return dict(zip(("o", "dq", "dk", "dv"), (o.detach(), *grads)))

    want, got = results(clean), results(bad)
    failures = []
    for name in ("o", "dq", "dk", "dv"):
        heads = slice(0, 2) if name in ("o", "dq") else slice(0, 1)  # kv head 0's rows
        untouched = got[name].clone()
        untouched[0, :, heads] = want[name][0, :, heads]
        if not torch.equal(untouched, want[name]):
            failures.append(f"{name}: rows of another (sequence, kv head) changed")
        free = _free_rows(name, poisoned, t, normalize, T)
        rows, ref_rows = got[name][0, free, heads].float(), want[name][0, free, heads].float()
        if not torch.isfinite(rows).all():
            failures.append(f"{name}: rows it cannot reach are not finite")
        elif relative_rms(rows, ref_rows) > 2 * R2_TOL[bf16]:
            failures.append(f"{name}: rows it cannot reach moved by {relative_rms(rows, ref_rows):.2e} (relative RMS)")
    assert torch.isnan(got["o"][0, t, 0 if poisoned == "q" else slice(0, 2)]).any(), "the bad value vanished"
    assert not failures, "\n".join(failures)
