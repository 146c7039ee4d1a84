"""A small tour of every CUDA kernel and option, sized for compute-sanitizer (memcheck, racecheck,
initcheck, synccheck): scripts/gpu_suite.sh runs this file under each tool. On the CPU (and without
a sanitizer) it is an ordinary smoke test of the same calls against the reference."""
import pytest
import torch

from cases import Case, make_inputs, run
from numerics import relative_rms

CASES = [
    Case(2, 37, 4, 24, torch.bfloat16, Hkv=2, V=20, initial_state=True, final_state=True),
    Case(1, 70, 2, 64, torch.float32, feature_map="relu", normalize=False, noncontig=True),
    Case(1, 90, 2, 16, torch.float16, seqlens=(1, 0, 40, 49), initial_state=True, final_state=True),
    Case(1, 20, 1, 256, torch.float32, V=256, initial_state=True, final_state=True),
    # bf16/fp16, K and V in {64, 128}: the tensor-core scan (forward and backward sweeps)
    Case(2, 150, 4, 64, torch.bfloat16, Hkv=2, initial_state=True, final_state=True),
    Case(1, 200, 2, 128, torch.bfloat16, V=128, seqlens=(70, 0, 130), feature_map="relu", normalize=False),
    Case(1, 130, 2, 64, torch.float16, V=128, initial_state=True, final_state=True),
    # one block, 32 chunks: the two-pass segment split
    Case(1, 2048, 1, 64, torch.bfloat16, initial_state=True, final_state=True),
    # K = V = 128 with normalize, GQA and two passes (the 64-token wgmma sweeps)
    Case(1, 2048, 2, 128, torch.bfloat16, Hkv=1, initial_state=True, final_state=True),
    # the same without the normalizer (dk and dv in one sweep, wgmma_grad_kv_kernel, after dv's pass 1
    # on segment_state_kernel), and K = V = 64 (the fused dk + dv sweep's pass 1 there), dk and dv
    # summing a group's heads
    Case(1, 2048, 2, 128, torch.bfloat16, Hkv=1, feature_map=None, normalize=False),
    Case(1, 2048, 2, 64, torch.bfloat16, Hkv=1, feature_map=None, normalize=False),
    # the fused dk + dv sweep at K = V = 128 with one query head per kv head (its kOneHead variant)
    Case(1, 2048, 1, 128, torch.bfloat16, feature_map=None, normalize=False),
    # 128 blocks per sweep: every sweep on 128-token chunks (wgmma_pair_scan_kernel) on a GPU of 128 to 255 SMs
    Case(16, 130, 4, 128, torch.bfloat16, initial_state=True, final_state=True),
    # padded dims on sm_90a (zeros past the real columns of DI = 128, 192 and 256 tiles, output tiles
    # partly written), with GQA and states
    Case(1, 150, 4, 96, torch.bfloat16, Hkv=2, V=80, initial_state=True, final_state=True),
    Case(2, 100, 2, 192, torch.float16, V=136, feature_map="relu", normalize=False),
    Case(1, 100, 2, 256, torch.bfloat16, V=200, initial_state=True, final_state=True),
    # fp32 at K, V off 64 and 128: the padded mma.sync sweeps
    Case(1, 100, 2, 40, torch.float32, V=56, initial_state=True, final_state=True),
    # fp32 at K = V = 128 with normalize: the mma.sync sweeps in 3xTF32 (PyTorch's default precision)
    # and the weights pass
    Case(1, 130, 2, 128, torch.float32, initial_state=True, final_state=True),
]


# The recurrent form runs the generic kernels with no segment split: past one 64-token chunk their
# grid and code do not depend on T, which adds only turns of the same loop. Racecheck slows those
# loops most, so the recurrent tour takes the long cases at T = RECURRENT_T.
RECURRENT_T = 256
TOUR = [("chunk", c) for c in CASES] + [("recurrent", c if c.T <= RECURRENT_T else c.replace(T=RECURRENT_T))
                                        for c in CASES]


@pytest.mark.parametrize("op,case", TOUR, ids=[f"{op}-{c.id}" for op, c in TOUR])
def test_forward_backward_tour(ar, ref, device, op, case):
    inp = make_inputs(case, device)
    ours = run(getattr(ar, f"{op}_linear_attn"), case, inp)
    expected = run(ref.parallel_linear_attn, case, inp, dtype=torch.float64)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[case.dtype]
    for name in expected:
        assert relative_rms(ours[name].cpu(), expected[name].cpu()) <= tol, name


# fp32 at PyTorch's "high" matmul precision without the normalizer: on sm_90a the TF32 wgmma sweeps
# (scan_wgmma_tf32.cuh), here split in two segments, with GQA, padded dims and an output tile partly
# written; elsewhere the mma.sync sweeps on TF32 operands. TF32's 10 mantissa bits: fp16's bound.
TF32_CASES = [
    Case(1, 2100, 2, 48, torch.float32, Hkv=1, V=40, normalize=False, initial_state=True, final_state=True),
    Case(1, 70, 2, 64, torch.float32, feature_map="relu", normalize=False, seqlens=(0, 20, 50)),
    Case(1, 150, 2, 128, torch.float32, V=96, normalize=False, initial_state=True, final_state=True),
]


@pytest.mark.parametrize("case", TF32_CASES, ids=lambda c: c.id)
def test_tf32_forward_backward_tour(ar, ref, device, case):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        inp = make_inputs(case, device)
        ours = run(ar.chunk_linear_attn, case, inp)
    finally:
        torch.set_float32_matmul_precision(before)
    expected = run(ref.parallel_linear_attn, case, inp, dtype=torch.float64)
    for name in expected:
        assert relative_rms(ours[name].cpu(), expected[name].cpu()) <= 2e-3, name


# (K, V, normalize): without normalize the value columns split over blocks (V = 64: two, V = 128:
# four); K = 96 leaves each thread a partial second batch of state rows; V = 30 takes the
# scalar-column kernel.
STEP_CASES = [(32, 64, True), (32, 30, True), (96, 64, False), (32, 128, False)]


@pytest.mark.parametrize("K,V,normalize", STEP_CASES,
                         ids=[f"K{K}-V{V}-{'norm' if n else 'unnorm'}" for K, V, n in STEP_CASES])
def test_step_tour(ar, ref, device, K, V, normalize):
    B, P, H, Hkv = 3, 5, 4, 2
    q = torch.randn(B, H, K, device=device)
    k, v = torch.randn(B, Hkv, K, device=device), torch.randn(B, Hkv, V, device=device)
    S, z = torch.randn(P, Hkv, K, V, device=device), torch.rand(P, Hkv, K, device=device) + 1
    idx = torch.tensor([4, -1, 0], device=device, dtype=torch.int32)
    S_ref, z_ref = S.clone(), z.clone()
    state, state_ref = ((S, z), (S_ref, z_ref)) if normalize else ((S, None), (S_ref, None))
    o = ar.linear_attn_step(q, k, v, state, state_indices=idx, feature_map="elu1", normalize=normalize)
    o_ref = ref.linear_attn_step(q, k, v, state_ref, state_indices=idx, feature_map="elu1", normalize=normalize)
    assert relative_rms(o, o_ref) <= 1e-5 and relative_rms(S, S_ref) <= 1e-6


# Softmax attention (attnrnn.softmax), Tq = Tk: (B, T, H, Hkv, D, dtype, cu_seqlens)
SOFTMAX_CASES = [
    (1, 77, 4, 2, 64, torch.bfloat16, None),               # tensor cores, GQA, lengths off the blocks
    (2, 77, 4, 2, 128, torch.bfloat16, None),              # tensor cores at D = 128
    (1, 150, 4, 2, 64, torch.bfloat16, (0, 40, 40, 150)),  # varlen with an empty sequence
    (1, 77, 4, 2, 40, torch.float32, None),                # generic (CUDA-core) kernels
]


def _softmax_id(c):
    B, T, H, Hkv, D, dtype, cu = c
    return f"B{B}-T{T}-H{H}-Hkv{Hkv}-D{D}-{str(dtype).split('.')[-1]}" + ("-varlen" if cu else "")


@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=_softmax_id)
def test_softmax_forward_backward_tour(ar, device, case):
    B, T, H, Hkv, D, dtype, cu = case
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, T, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv, H))
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu is not None else None
    xs = [x.to(device, copy=True).requires_grad_() for x in (q, k, v)]
    o = ar.softmax.streaming_attn(*xs, cu_seqlens=cu_t.to(device) if cu_t is not None else None)
    o.backward(do.to(device))
    # float64 reference on the CPU (fewer kernels under the sanitizer)
    rs = [x.double().requires_grad_() for x in (q, k, v)]
    o_ref = ar.softmax.reference_attn(*rs, cu_seqlens=cu_t)[0]
    o_ref.backward(do.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]
    for name, x, r in zip(("o", "dq", "dk", "dv"), [o] + [x.grad for x in xs], [o_ref] + [r.grad for r in rs]):
        assert relative_rms(x.detach().cpu(), r) <= tol, name


@pytest.mark.parametrize("D", [128, 40], ids=["fast-D128", "generic-D40"])
def test_softmax_step_tour(ar, device, D):
    """Decode with k_new appended, split_size 64: several splits and the combine kernel."""
    B, H, Hkv, Lmax = 3, 8, 2, 200
    g = torch.Generator().manual_seed(1)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    q, kc, vc, kn, vn = mk(B, H, D), mk(B, Lmax, Hkv, D), mk(B, Lmax, Hkv, D), mk(B, Hkv, D), mk(B, Hkv, D)
    lens = torch.tensor([0, 77, Lmax - 1], dtype=torch.int32)
    kc_d, vc_d = kc.to(device, copy=True), vc.to(device, copy=True)
    o = ar.softmax.softmax_attn_step(q.to(device), kc_d, vc_d, lens.to(device), k_new=kn.to(device),
                                     v_new=vn.to(device), split_size=64)
    rows = torch.arange(B)
    kc[rows, lens.long()], vc[rows, lens.long()] = kn, vn
    assert torch.equal(kc_d.cpu(), kc) and torch.equal(vc_d.cpu(), vc)
    for b, L in enumerate((lens + 1).tolist()):
        r = ar.softmax.reference_attn(q[b:b + 1, None].double(), kc[b:b + 1, :L].double(), vc[b:b + 1, :L].double(),
                                      causal=False)[0][0, 0]
        assert relative_rms(o[b].cpu(), r) <= 8e-3, b


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 64), (torch.float32, 40)], ids=["bf16-D64", "fp32-D40"])
def test_cuda_softmax_bad_cu_seqlens_tour(ar, dtype, D):
    """Offsets that end short of T and decrease (not read back on CUDA): every output element is
    written (initcheck reads them all below) and nothing outside the tensors is touched."""
    for cu in ((0, 40, 60), (0, 40, 30)):
        xs = [torch.randn(1, 77, h, D, device="cuda", dtype=dtype).requires_grad_() for h in (4, 2, 2)]
        o, lse = ar.softmax.streaming_attn(*xs, return_lse=True,
                                           cu_seqlens=torch.tensor(cu, dtype=torch.int32, device="cuda"))
        o.backward(torch.randn_like(o))
        for x in (o, *(x.grad for x in xs)):
            assert torch.isfinite(x).all() and torch.equal(x[:, 60:], torch.zeros_like(x[:, 60:]))
        assert torch.isneginf(lse[..., 60:]).all()
