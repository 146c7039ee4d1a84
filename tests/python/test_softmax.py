"""attnrnn.softmax: streaming (online-softmax) attention forward/backward and the split-KV decode
step, judged by the numerics rules (FlashAttention's: <= 2x forward / 3x backward of PyTorch's
error in the test dtype, against a float64 reference on the same rounded inputs)."""
import pytest
import torch

from cases import assert_fake_kernel_raises_like_the_op
from numerics import assert_close_by_rules, relative_rms

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_dt_id = lambda d: str(d).split(".")[-1]  # noqa: E731


def _mk(shape, dtype, device, g, mult=1.0):
    return (torch.randn(*shape, generator=g) * mult).to(device=device, dtype=dtype)


def _qkv(B, Tq, Tk, H, Hkv, D, Dv, dtype, device, seed=0, mult=1.0):
    g = torch.Generator().manual_seed(seed)
    return (_mk((B, Tq, H, D), dtype, device, g, mult), _mk((B, Tk, Hkv, D), dtype, device, g),
            _mk((B, Tk, Hkv, Dv), dtype, device, g))


def _run(fn, q, k, v, do, **kw):
    """(o, dq, dk, dv) of fn on fresh leaves."""
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(*xs, **kw)
    if isinstance(o, tuple):
        o = o[0]
    o.backward(do)
    return [o.detach()] + [x.grad for x in xs]


# (B, Tq, Tk, H, Hkv, D, Dv, score multiplier)
SHAPES = [
    (2, 1, 239, 4, 2, 64, 64, 1.0),
    (1, 3, 799, 4, 1, 60, 48, 1.0),
    (1, 1023, 1024, 2, 1, 64, 64, 1.0),
    (2, 130, 130, 4, 2, 32, 40, 5.0),   # scores x5: large logits, peaked softmax
    (1, 200, 77, 2, 2, 16, 16, 1.0),    # Tq > Tk: the first 123 queries see no key
]
# Tensor-core paths on CUDA (bf16/fp16, D = Dv in {64, 128}): blocks of 128 queries x 64 keys
# forward and dq, 128 keys x 64 queries dk/dv; lengths off the block sizes, GQA/MQA, Tq != Tk.
SHAPES_CUDA = [
    (2, 300, 300, 4, 2, 128, 128, 1.0),
    (1, 1000, 1000, 8, 1, 128, 128, 5.0),  # MQA, scores x5
    (1, 129, 400, 2, 2, 128, 128, 1.0),    # Tq < Tk
    (1, 400, 129, 4, 2, 64, 64, 1.0),      # Tq > Tk: 271 queries see no key
    (3, 65, 65, 2, 2, 64, 64, 1.0),
    (1, 4224, 4224, 2, 2, 128, 128, 1.0),
]
_CUDA_ONLY = pytest.mark.requires_cuda


def _shape_id(device, shape, dtype, causal=True):
    B, Tq, Tk, H, Hkv, D, Dv, mult = shape
    sid = f"{device}-B{B}-Tq{Tq}-Tk{Tk}-H{H}" + (f"-Hkv{Hkv}" if Hkv != H else "") + f"-D{D}"
    sid += (f"-Dv{Dv}" if Dv != D else "") + (f"-x{mult:g}" if mult != 1 else "") + ("" if causal else "-full")
    return sid + "-" + {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def _rule_params(shapes, devices, dtypes, causals=(True,)):
    out = []
    for device in devices:
        marks = [_CUDA_ONLY] if device == "cuda" else []
        for shape in shapes:
            for dtype in dtypes:
                for causal in causals:
                    out.append(pytest.param(device, shape, dtype, causal, marks=marks,
                                            id=_shape_id(device, shape, dtype, causal)))
    return out


def _check_by_rules(ar, device, shape, dtype, causal=True, cu_seqlens=None):
    B, Tq, Tk, H, Hkv, D, Dv, mult = shape
    q, k, v = _qkv(B, Tq, Tk, H, Hkv, D, Dv, dtype, device, mult=mult)
    g = torch.Generator().manual_seed(1)
    do = _mk((B, Tq, H, Dv), dtype, device, g)
    kw = dict(causal=causal, cu_seqlens=cu_seqlens)
    ours = _run(ar.softmax.streaming_attn, q, k, v, do, **kw)
    pt = _run(ar.softmax.reference_attn, q, k, v, do, **kw)
    r64 = _run(ar.softmax.reference_attn, q.double(), k.double(), v.double(), do.double(), **kw)
    for name, x, x_pt, x_ref in zip(("o", "dq", "dk", "dv"), ours, pt, r64):
        assert_close_by_rules(x, x_pt, x_ref, kind="fwd" if name == "o" else "bwd", dtype=dtype, name=name)
    o, lse = ar.softmax.streaming_attn(q, k, v, return_lse=True, **kw)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Tq)
    _, lse_ref = ar.softmax.reference_attn(q.double(), k.double(), v.double(), **kw)
    seen = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse[seen].double(), lse_ref[seen], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device,shape,dtype,causal", _rule_params(SHAPES, ("cpu", "cuda"), DTYPES))
def test_forward_backward_by_rules(ar, device, shape, dtype, causal):
    _check_by_rules(ar, device, shape, dtype, causal)


@pytest.mark.parametrize("device,shape,dtype,causal",
                         _rule_params(SHAPES_CUDA, ("cuda",), [torch.bfloat16, torch.float16], (True, False)))
def test_cuda_tensor_core_paths_by_rules(ar, device, shape, dtype, causal):
    _check_by_rules(ar, device, shape, dtype, causal)


def test_float64_stays_float64(ar, device):
    q, k, v = _qkv(2, 70, 90, 4, 2, 24, 20, torch.float64, device)
    o, lse = ar.softmax.streaming_attn(q, k, v, return_lse=True)
    ro, rl = ar.softmax.reference_attn(q, k, v)
    assert o.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(o, ro, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, rl, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_noncausal_and_noncontiguous(ar, device, causal):
    g = torch.Generator().manual_seed(2)
    qkv = _mk((2, 100, 3 * 4, 32), torch.float32, device, g)  # q, k, v as strided slices of one tensor
    q, k, v = qkv[:, :, :4], qkv[:, 50:, 4:6], qkv[:, 50:, 8:10]
    do = _mk((2, 100, 4, 32), torch.float32, device, g).transpose(0, 1).contiguous().transpose(0, 1)
    ours = _run(ar.softmax.streaming_attn, q, k, v, do, causal=causal)
    r64 = _run(ar.softmax.reference_attn, q.double(), k.double(), v.double(), do.double(), causal=causal)
    for x, r in zip(ours, r64):
        torch.testing.assert_close(x.double(), r, rtol=1e-4, atol=2e-5)


def test_fully_masked_rows_and_empty_sequences(ar, device):
    # Tq > Tk: queries 0..5 see no key; Tk = 0: nobody sees anything.
    for Tq, Tk in ((10, 4), (5, 0)):
        q, k, v = _qkv(2, Tq, Tk, 2, 1, 8, 8, torch.float32, device)
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o, lse = ar.softmax.streaming_attn(*xs, return_lse=True)
        o.sum().backward()
        dead = Tq - Tk
        assert torch.equal(o[:, :dead], torch.zeros_like(o[:, :dead]))
        assert torch.isneginf(lse[..., :dead]).all() and torch.isfinite(lse[..., dead:]).all()
        for x in [o] + [x.grad for x in xs]:
            assert torch.isfinite(x).all()
        assert torch.equal(xs[0].grad[:, :dead], torch.zeros_like(xs[0].grad[:, :dead]))
    # varlen with empty and 1-token sequences
    cu = torch.tensor([0, 0, 1, 1, 40, 41, 90], dtype=torch.int32, device=device)
    q, k, v = _qkv(1, 90, 90, 4, 2, 16, 12, torch.float32, device)
    g = torch.Generator().manual_seed(4)
    do = _mk((1, 90, 4, 12), torch.float32, device, g)
    ours = _run(ar.softmax.streaming_attn, q, k, v, do, cu_seqlens=cu)
    r64 = _run(ar.softmax.reference_attn, q.double(), k.double(), v.double(), do.double(), cu_seqlens=cu.cpu())
    for x, r in zip(ours, r64):
        torch.testing.assert_close(x.double(), r, rtol=1e-4, atol=2e-5)
    # B = 0
    q, k, v = _qkv(0, 5, 5, 2, 2, 8, 8, torch.float32, device)
    assert ar.softmax.streaming_attn(q, k, v).shape == (0, 5, 2, 8)


def test_reproducible(ar, device):
    q, k, v = _qkv(1, 300, 300, 4, 2, 32, 32, torch.float32, device)
    do = torch.randn(1, 300, 4, 32, device=device)
    a = _run(ar.softmax.streaming_attn, q, k, v, do)
    b = _run(ar.softmax.streaming_attn, q, k, v, do)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---- decode step ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dt_id)
@pytest.mark.parametrize("split_size", [None, 64, 100])
def test_decode_equals_last_row_of_forward(ar, device, dtype, split_size):
    B, T, H, Hkv, D, Dv, Lmax = 3, 700, 4, 2, 64, 32, 800
    q, k, v = _qkv(B, T, T, H, Hkv, D, Dv, dtype, device)
    o_full = ar.softmax.streaming_attn(q, k, v)
    k_cache = torch.zeros(B, Lmax, Hkv, D, dtype=dtype, device=device)
    v_cache = torch.zeros(B, Lmax, Hkv, Dv, dtype=dtype, device=device)
    k_cache[:, :T - 1], v_cache[:, :T - 1] = k[:, :T - 1], v[:, :T - 1]
    lens = torch.full((B,), T - 1, dtype=torch.int32, device=device)
    o = ar.softmax.softmax_attn_step(q[:, -1], k_cache, v_cache, lens, k_new=k[:, -1], v_new=v[:, -1],
                                     split_size=split_size)
    assert torch.equal(lens, torch.full_like(lens, T - 1)), "cache_seqlens must not be updated"
    assert torch.equal(k_cache[:, T - 1], k[:, -1]) and torch.equal(v_cache[:, T - 1], v[:, -1])
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(o, o_full[:, -1], **tol)
    # without k_new: the cache already holds the token
    o2 = ar.softmax.softmax_attn_step(q[:, -1:], k_cache, v_cache, lens + 1, split_size=split_size)
    torch.testing.assert_close(o2[:, 0], o, rtol=0, atol=0)


def test_decode_loop_ragged_lengths_gqa(ar, device):
    """Token-by-token decoding with different lengths per sequence equals the forward of each."""
    B, H, Hkv, D, Lmax = 3, 6, 2, 16, 64
    starts = [0, 5, 30]
    g = torch.Generator().manual_seed(7)
    q, k, v = (_mk((B, Lmax, h, D), torch.float32, device, g) for h in (H, Hkv, Hkv))
    k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)
    for b, s in enumerate(starts):
        k_cache[b, :s], v_cache[b, :s] = k[b, :s], v[b, :s]
    lens = torch.tensor(starts, dtype=torch.int32, device=device)
    outs = []
    for t in range(20):
        idx = (lens.long() + 0).tolist()
        qt = torch.stack([q[b, i] for b, i in enumerate(idx)])
        kt = torch.stack([k[b, i] for b, i in enumerate(idx)])
        vt = torch.stack([v[b, i] for b, i in enumerate(idx)])
        outs.append(ar.softmax.softmax_attn_step(qt, k_cache, v_cache, lens, k_new=kt, v_new=vt, split_size=8))
        lens += 1
    for b, s in enumerate(starts):
        full = ar.softmax.streaming_attn(q[b:b + 1, :s + 20], k[b:b + 1, :s + 20], v[b:b + 1, :s + 20])
        torch.testing.assert_close(torch.stack([o[b] for o in outs]), full[0, s:], rtol=1e-5, atol=1e-6)


def test_decode_empty_cache_and_out_of_range(ar, device):
    q = torch.randn(2, 2, 8, device=device)
    kc, vc = torch.randn(2, 4, 1, 8, device=device), torch.randn(2, 4, 1, 8, device=device)
    o = ar.softmax.softmax_attn_step(q, kc, vc, torch.zeros(2, dtype=torch.int32, device=device))
    assert torch.equal(o, torch.zeros_like(o))
    if device == "cpu":
        before = kc.clone()
        with pytest.raises(ValueError, match="cache_seqlens"):
            ar.softmax.softmax_attn_step(q, kc, vc, torch.tensor([1, 4], dtype=torch.int32), k_new=kc[:, 0] + 1,
                                         v_new=vc[:, 0])
        assert torch.equal(kc, before), "nothing may be written when a length is out of range"


def test_reference_attn_keeps_nan_and_zeroes_only_rows_without_keys(ar):
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8)
    q[0, 1] = float("nan")
    o, lse = ar.softmax.reference_attn(q, k, v, causal=True)  # Tq < Tk: every query sees keys
    assert torch.isnan(o[0, 1]).all() and torch.isfinite(o[0, [0, 2, 3]]).all()
    o, lse = ar.softmax.reference_attn(torch.randn(1, 3, 1, 8), k[:, :0], v[:, :0], causal=False)
    assert torch.equal(o, torch.zeros_like(o)) and (lse == float("-inf")).all()


@pytest.mark.parametrize("cu", [[0, 5, 3, 8], [0, 9], [-1, 8]], ids=["decreasing", "past-T", "negative"])
def test_reference_attn_refuses_bad_cu_seqlens(ar, cu):
    x = torch.randn(1, 8, 1, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ar.softmax.reference_attn(x, x, x, cu_seqlens=torch.tensor(cu))


@pytest.mark.parametrize("cache", ["k_cache", "v_cache"])
def test_decode_refuses_to_append_to_a_cache_whose_rows_share_memory(ar, device, cache):
    d = _step_inputs(device)
    d[cache] = d[cache][:1].expand_as(d[cache])  # every batch row the same memory
    kn = torch.randn_like(d["k_cache"][:, 0])
    vn = torch.randn_like(d["v_cache"][:, 0])
    with pytest.raises(ValueError, match=f"{cache} must not have elements that share memory"):
        ar.softmax.softmax_attn_step(d["q"], d["k_cache"], d["v_cache"], d["cache_seqlens"], k_new=kn, v_new=vn)


def _shared_caches(device, overlap):
    """k_cache and v_cache [2, 10, 2, 8] in one buffer: the same tensor, or v_cache 8 elements on."""
    buf = torch.randn(2 * 10 * 2 * 8 + 8, device=device)
    k_cache = buf[:320].view(2, 10, 2, 8)
    return k_cache, (k_cache if overlap == "same-tensor" else buf[8:].view(2, 10, 2, 8))


@pytest.mark.parametrize("overlap", ["same-tensor", "overlapping"])
def test_decode_refuses_to_append_to_caches_that_share_memory(ar, device, overlap):
    k_cache, v_cache = _shared_caches(device, overlap)
    q, new = torch.randn(2, 2, 8, device=device), torch.randn(2, 2, 8, device=device)
    lens = torch.tensor([3, 5], dtype=torch.int32, device=device)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="v_cache and k_cache must not share memory"):
        ar.softmax.softmax_attn_step(q, k_cache, v_cache, lens, k_new=new, v_new=new.clone())
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("arg", ["q", "k_new", "v_new"])
def test_decode_refuses_an_input_inside_the_cache_it_appends_to(ar, device, arg):
    d = _step_inputs(device)
    d["k_new"], d["v_new"] = torch.randn(2, 2, 16, device=device), torch.randn(2, 2, 8, device=device)
    cache = "v_cache" if arg == "v_new" else "k_cache"
    d[arg] = d[cache].view(-1)[:d[arg].numel()].view(d[arg].shape)
    with pytest.raises(ValueError, match=f"{cache} and {arg} must not share memory"):
        ar.softmax.softmax_attn_step(d["q"], d["k_cache"], d["v_cache"], d["cache_seqlens"], k_new=d["k_new"],
                                     v_new=d["v_new"])


@pytest.mark.parametrize("overlap", ["same-tensor", "overlapping"])
def test_decode_without_append_reads_caches_that_share_memory(ar, device, overlap):
    """Without k_new and v_new nothing is written, so caches in one buffer are only read."""
    k_cache, v_cache = _shared_caches(device, overlap)
    q = torch.randn(2, 2, 8, device=device)
    lens = torch.tensor([3, 5], dtype=torch.int32, device=device)
    o = ar.softmax.softmax_attn_step(q, k_cache, v_cache, lens)
    torch.testing.assert_close(o, ar.softmax.softmax_attn_step(q, k_cache.clone(), v_cache.clone(), lens))


@pytest.mark.parametrize("L", [6, 3000], ids=["one-split", "splits"])
def test_decode_step_of_a_nan_query_is_nan(ar, device, L):
    """Every score NaN must not read as an empty cache (whose output is 0), in one split or merged
    over several."""
    q = torch.randn(2, 2, 8, device=device)
    q[0, 0, 0] = float("nan")
    kc, vc = torch.randn(2, L, 1, 8, device=device), torch.randn(2, L, 1, 8, device=device)
    lens = torch.tensor([L - 1, L], dtype=torch.int32, device=device)
    o = ar.softmax.softmax_attn_step(q, kc, vc, lens)
    assert torch.isnan(o[0, 0]).all() and torch.isfinite(o[0, 1]).all() and torch.isfinite(o[1]).all()


def test_decode_refuses_grad(ar, device):
    q = torch.randn(1, 2, 8, device=device, requires_grad=True)
    kc, vc = torch.randn(1, 4, 1, 8, device=device), torch.randn(1, 4, 1, 8, device=device)
    with pytest.raises(ValueError, match="q requires grad.*not differentiable"):
        ar.softmax.softmax_attn_step(q, kc, vc, torch.ones(1, dtype=torch.int32, device=device))


@pytest.mark.parametrize("cache", ["k_cache", "v_cache"])
def test_decode_refuses_grad_on_kv_cache(ar, device, cache):
    d = _step_inputs(device)
    d[cache].requires_grad_()
    with pytest.raises(ValueError, match=f"{cache} requires grad.*not differentiable"):
        ar.softmax.softmax_attn_step(d["q"], d["k_cache"], d["v_cache"], d["cache_seqlens"])


# ---- torch.library: opcheck, gradcheck, compile; errors; CUDA ----------------------------------

def _opcheck_samples(device):
    q, k, v = _qkv(2, 9, 13, 4, 2, 8, 6, torch.float32, device)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32, device=device)
    qv, kv, vv = _qkv(1, 11, 11, 2, 1, 8, 8, torch.bfloat16, device)
    fwd = [(q, k, v, None, 0.3, True), (q, k, v, None, 0.3, False), (qv, kv, vv, cu, 0.35, True)]
    return fwd


def test_opcheck(ar, device):
    ops = torch.ops.attnrnn
    for args in _opcheck_samples(device):
        args = tuple(a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                     else a for a in args)
        torch.library.opcheck(ops.softmax_attn_fwd, args)
        q, k, v, cu, scale, causal = args
        o, lse = ops.softmax_attn_fwd(q.detach(), k.detach(), v.detach(), cu, scale, causal)
        do = torch.randn_like(o)
        torch.library.opcheck(ops.softmax_attn_bwd, (do, q.detach(), k.detach(), v.detach(), o, lse, cu, scale, causal))
    q = torch.randn(2, 4, 8, device=device)
    kc, vc = torch.randn(2, 10, 2, 8, device=device), torch.randn(2, 10, 2, 8, device=device)
    lens = torch.tensor([3, 7], dtype=torch.int32, device=device)
    kn, vn = torch.randn(2, 2, 8, device=device), torch.randn(2, 2, 8, device=device)
    torch.library.opcheck(ops.softmax_attn_step, (q, kc, vc, lens, kn, vn, 0.3, 4))
    torch.library.opcheck(ops.softmax_attn_step, (q, kc, vc, lens, None, None, 0.3, 0))


@pytest.mark.parametrize("case", [
    dict(B=2, Tq=5, Tk=5, H=2, Hkv=2, causal=True),
    dict(B=1, Tq=3, Tk=7, H=4, Hkv=2, causal=True),     # bottom-right, GQA
    dict(B=1, Tq=6, Tk=3, H=2, Hkv=1, causal=True),     # fully masked rows
    dict(B=2, Tq=4, Tk=6, H=2, Hkv=1, causal=False),
    dict(B=1, Tq=9, Tk=9, H=2, Hkv=1, causal=True, cu=[0, 3, 3, 4, 9]),
], ids=["square", "gqa-br", "masked", "full", "varlen"])
def test_gradcheck(ar, device, case):
    q, k, v = _qkv(case["B"], case["Tq"], case["Tk"], case["H"], case["Hkv"], 5, 3, torch.float64, device)
    cu = torch.tensor(case["cu"], device=device) if "cu" in case else None
    xs = [x.requires_grad_() for x in (q, k, v)]
    f = lambda q, k, v: ar.softmax.streaming_attn(q, k, v, causal=case["causal"], cu_seqlens=cu)  # noqa: E731
    assert torch.autograd.gradcheck(f, xs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_compile_fullgraph(ar, device):
    import torch._dynamo
    torch._dynamo.reset()

    def train(q, k, v):
        o, lse = ar.softmax.streaming_attn(q, k, v, return_lse=True)
        return o.square().sum() + lse.detach().sum(), o

    def grads(f):
        xs = [x.detach().clone().requires_grad_() for x in _qkv(2, 33, 40, 4, 2, 16, 8, torch.float32, device)]
        loss, o = f(*xs)
        loss.backward()
        return [o.detach()] + [x.grad for x in xs]

    for a, b in zip(grads(torch.compile(train, fullgraph=True, backend="aot_eager")), grads(train)):
        torch.testing.assert_close(a, b)

    def decode(q, kc, vc, lens, kn, vn):
        return ar.softmax.softmax_attn_step(q, kc, vc, lens, k_new=kn, v_new=vn) * 2

    q = torch.randn(2, 4, 8, device=device)
    kc, vc = torch.randn(2, 10, 2, 8, device=device), torch.randn(2, 10, 2, 8, device=device)
    lens = torch.tensor([3, 7], dtype=torch.int32, device=device)
    kn, vn = torch.randn(2, 2, 8, device=device), torch.randn(2, 2, 8, device=device)
    kc_e, vc_e = kc.clone(), vc.clone()
    o_e = decode(q, kc_e, vc_e, lens, kn, vn)
    o_c = torch.compile(decode, fullgraph=True, backend="aot_eager")(q, kc, vc, lens, kn, vn)
    torch.testing.assert_close(o_c, o_e)
    torch.testing.assert_close(kc, kc_e)  # the in-place append survives compilation
    torch.testing.assert_close(vc, vc_e)


def _fwd_inputs(device):
    return dict(q=torch.randn(2, 8, 4, 16, device=device), k=torch.randn(2, 8, 2, 16, device=device),
                v=torch.randn(2, 8, 2, 8, device=device))


def _step_inputs(device):
    return dict(q=torch.randn(2, 4, 16, device=device), k_cache=torch.randn(2, 10, 2, 16, device=device),
                v_cache=torch.randn(2, 10, 2, 8, device=device),
                cache_seqlens=torch.tensor([3, 5], dtype=torch.int32, device=device))


def _with(base, op, **changes):
    def build(device):
        d = base(device)
        for key, val in changes.items():
            d[key] = val(d, device) if callable(val) else val
        return op, d
    return build


_F, _S = "streaming_attn", "softmax_attn_step"
BAD = [
    ("q-int", _with(_fwd_inputs, _F, q=lambda d, dev: d["q"].int()), r"\bq\b"),
    ("k-dtype-mix", _with(_fwd_inputs, _F, k=lambda d, dev: d["k"].double()), r"\bk\b"),
    ("v-dtype-mix", _with(_fwd_inputs, _F, v=lambda d, dev: d["v"].half()), r"\bv\b"),
    ("q-rank-3", _with(_fwd_inputs, _F, q=lambda d, dev: d["q"][0]), r"\bq\b"),
    ("k-batch", _with(_fwd_inputs, _F, k=lambda d, dev: d["k"][:1]), r"\bk\b"),
    ("v-length", _with(_fwd_inputs, _F, v=lambda d, dev: d["v"][:, :5]), r"\bv\b"),
    ("k-headdim", _with(_fwd_inputs, _F, k=lambda d, dev: d["k"][..., :8]), r"\bk\b"),
    ("heads-not-divisible", _with(_fwd_inputs, _F, k=lambda d, dev: torch.randn(2, 8, 3, 16, device=dev),
                                  v=lambda d, dev: torch.randn(2, 8, 3, 8, device=dev)), r"\bk\b"),
    ("headdim-300", _with(_fwd_inputs, _F, v=lambda d, dev: torch.randn(2, 8, 2, 300, device=dev)), r"\bv\b"),
    ("q-stride", _with(_fwd_inputs, _F, q=lambda d, dev: torch.randn(2, 8, 4, 32, device=dev)[..., ::2]), r"\bq\b"),
    ("cu-batch-2", _with(_fwd_inputs, _F, cu_seqlens=lambda d, dev: torch.tensor([0, 8], device=dev)),
     r"cu_seqlens"),
    ("cu-float", _with(_fwd_inputs, _F, q=lambda d, dev: d["q"][:1], k=lambda d, dev: d["k"][:1],
                       v=lambda d, dev: d["v"][:1], cu_seqlens=lambda d, dev: torch.tensor([0., 8.], device=dev)),
     r"cu_seqlens"),
    ("cu-end", _with(_fwd_inputs, _F, q=lambda d, dev: d["q"][:1], k=lambda d, dev: d["k"][:1],
                     v=lambda d, dev: d["v"][:1], cu_seqlens=lambda d, dev: torch.tensor([0, 3, 7], device=dev)),
     r"cu_seqlens"),
    ("scale-nan", _with(_fwd_inputs, _F, scale=float("nan")), r"scale"),
    ("step-q-rank", _with(_step_inputs, _S, q=lambda d, dev: d["q"][0]), r"\bq\b"),
    ("step-k_cache-batch", _with(_step_inputs, _S, k_cache=lambda d, dev: d["k_cache"][:1]), r"k_cache"),
    ("step-v_cache-length", _with(_step_inputs, _S, v_cache=lambda d, dev: d["v_cache"][:, :4]), r"v_cache"),
    ("step-cache-dtype", _with(_step_inputs, _S, v_cache=lambda d, dev: d["v_cache"].double()), r"v_cache"),
    ("step-lens-int64", _with(_step_inputs, _S, cache_seqlens=lambda d, dev: d["cache_seqlens"].long()),
     r"cache_seqlens"),
    ("step-lens-shape", _with(_step_inputs, _S, cache_seqlens=lambda d, dev: d["cache_seqlens"][:1]),
     r"cache_seqlens"),
    ("step-k_new-shape", _with(_step_inputs, _S, k_new=lambda d, dev: torch.randn(2, 2, 8, device=dev),
                               v_new=lambda d, dev: torch.randn(2, 2, 8, device=dev)), r"k_new"),
    ("step-k_new-alone", _with(_step_inputs, _S, k_new=lambda d, dev: torch.randn(2, 2, 16, device=dev)), r"v_new"),
    ("step-split", _with(_step_inputs, _S, split_size=0), r"split_size"),
]


def _fake_fwd_args(q_shape=(2, 8, 4, 16), cu=None):
    return (torch.randn(*q_shape), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 8), cu, 0.25, True)


def _fake_bwd_args(q_shape=(2, 8, 4, 16)):
    return (torch.randn(2, 8, 4, 8), torch.randn(*q_shape), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 8),
            torch.randn(2, 8, 4, 8), torch.randn(2, 4, 8), None, 0.25, True)


# (id, op name, builder of the arguments, regex naming the argument)
FAKE_CASES = [
    ("fwd-q-3d", "softmax_attn_fwd", lambda: _fake_fwd_args(q_shape=(2, 8, 64)), r"\bq must be a 4-D tensor"),
    ("fwd-cu_seqlens-empty", "softmax_attn_fwd", lambda: _fake_fwd_args(cu=torch.zeros(0, dtype=torch.int32)),
     r"cu_seqlens must be a 1-D tensor \[N \+ 1\]"),
    ("bwd-q-3d", "softmax_attn_bwd", lambda: _fake_bwd_args(q_shape=(2, 8, 64)), r"\bq must be a 4-D tensor"),
    ("step-q-2d", "softmax_attn_step",
     lambda: (torch.randn(2, 64), torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 8),
              torch.tensor([3, 5], dtype=torch.int32), None, None, 0.25, 0),
     r"\bq must be a 3-D tensor"),
]


@pytest.mark.parametrize("name,build,regex", [pytest.param(*c[1:], id=c[0]) for c in FAKE_CASES])
def test_fake_kernel_raises_the_named_error_of_the_real_op(ar, name, build, regex):
    assert_fake_kernel_raises_like_the_op(name, build, regex)


def _bad_params():
    out = []
    for device in ("cpu", "cuda"):
        marks = [_CUDA_ONLY] if device == "cuda" else []
        for i, build, _ in BAD:
            if device == "cuda" and i == "cu-end":
                continue  # CUDA does not read cu_seqlens back: test_cuda_bad_cu_seqlens_values_are_not_trusted
            out.append(pytest.param(device, build, marks=marks, id=f"{device}-{i}"))
    return out


@pytest.mark.parametrize("device,build", _bad_params())
def test_bad_inputs_name_the_argument(ar, device, build):
    pattern = dict((b, p) for _, b, p in BAD)[build]
    op, d = build(device)
    fn = getattr(ar.softmax, op)
    if op == _F:
        q, k, v = d.pop("q"), d.pop("k"), d.pop("v")
        args = (q, k, v)
    else:
        args = (d.pop("q"), d.pop("k_cache"), d.pop("v_cache"), d.pop("cache_seqlens"))
    with pytest.raises((ValueError, RuntimeError), match=pattern):
        fn(*args, **d)


# ---- CUDA only: paths, poisoned outputs, CPU agreement, determinism, decode, graphs ---------------

def _poison_cuda_allocator(*tensors_like):
    """Fill blocks of the caching allocator with NaN and free them, so that outputs the next op
    allocates with these sizes start as NaN (R3: an element the kernels forget to write shows)."""
    junk = [torch.full_like(t, float("nan")) for t in tensors_like]
    junk += [torch.full((1 << 22,), float("nan"), device="cuda") for _ in range(4)]
    del junk


@_CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_dt_id)
@pytest.mark.parametrize("D", [64, 128])
def test_cuda_varlen_tensor_cores_by_rules(ar, D, dtype):
    # empty, 1-token, block-crossing sequences packed along T; GQA
    cu = torch.tensor([0, 0, 1, 130, 130, 387, 388, 600], dtype=torch.int32, device="cuda")
    _check_by_rules(ar, "cuda", (1, 600, 600, 4, 2, D, D, 1.0), dtype, True, cu)
    _check_by_rules(ar, "cuda", (1, 600, 600, 4, 2, D, D, 1.0), dtype, False, cu.long())


@_CUDA_ONLY
@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 64), (torch.float16, 128), (torch.float32, 64),
                                     (torch.bfloat16, 40)], ids=["bf16-D64", "fp16-D128", "fp32-D64", "bf16-D40"])
def test_cuda_fully_masked_rows_and_empty_sequences_nan_poisoned(ar, dtype, D):
    """Rows that see no key: o = 0, lse = -inf, dq = 0, no NaN anywhere, on every path."""
    for B, Tq, Tk, cu in ((2, 300, 100, None), (2, 70, 0, None), (1, 300, 300, [0, 0, 150, 150, 151, 300, 300])):
        q, k, v = _qkv(B, Tq, Tk, 4, 2, D, D, dtype, "cuda")
        cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda") if cu is not None else None
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        _poison_cuda_allocator(q, k, v, q.new_empty(B, 4, Tq, dtype=torch.float32))
        o, lse = ar.softmax.streaming_attn(*xs, return_lse=True, cu_seqlens=cu_t)
        _poison_cuda_allocator(q, k, v)
        (o.float() * torch.linspace(-1, 1, D, device="cuda")).sum().backward()
        for x in [o] + [x.grad for x in xs]:
            assert torch.isfinite(x).all()
        if cu is None:
            dead = Tq - Tk
            assert torch.equal(o[:, :dead], torch.zeros_like(o[:, :dead]))
            assert torch.isneginf(lse[..., :dead]).all() and torch.isfinite(lse[..., dead:]).all()
            assert torch.equal(xs[0].grad[:, :dead], torch.zeros_like(xs[0].grad[:, :dead]))
        else:
            assert torch.isfinite(lse).all()
        r64 = ar.softmax.reference_attn(q.double(), k.double(), v.double(),
                                        cu_seqlens=cu_t.cpu() if cu is not None else None)[0]
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
        assert relative_rms(o, r64) <= tol


@_CUDA_ONLY
@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 64), (torch.float32, 40)], ids=["bf16-D64", "fp32-D40"])
@pytest.mark.parametrize("bad,good,covered", [
    ([0, 70, 250], [0, 70, 250, 300], (0, 250)),        # ends short of T: tokens [250, 300) in no sequence
    ([0, 70, 301], [0, 70, 300], (0, 300)),             # one past T: clamped to T
    ([0, 70, 250, 200], [0, 70, 250, 300], (0, 250)),   # decreasing: the last sequence is empty
    ([150, 170, 300], [0, 150, 170, 300], (150, 300)),  # starts past a whole block of queries
], ids=["end-short", "end-past", "decreasing", "start-late"])
def test_cuda_bad_cu_seqlens_values_are_not_trusted(ar, dtype, D, bad, good, covered):
    """CUDA does not read cu_seqlens back (a host sync; the CPU raises: test_bad_inputs_name_the_argument):
    no error, nothing outside the tensors touched, the sequences the offsets do describe computed
    exactly as by the well-formed call, and tokens in no sequence written as o = 0, lse = -inf and
    zero gradients (NaN-poisoned allocator: an unwritten element would show). Tensor cores (bf16,
    D = 64) and the generic kernels (fp32, D = 40)."""
    T = 300
    q, k, v = _qkv(1, T, T, 4, 2, D, D, dtype, "cuda")
    do = _mk((1, T, 4, D), dtype, "cuda", torch.Generator().manual_seed(2))
    runs = []
    for cu in (bad, good):
        cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        _poison_cuda_allocator(q, k, v, q.new_empty(1, 4, T, dtype=torch.float32))
        o, lse = ar.softmax.streaming_attn(*xs, return_lse=True, cu_seqlens=cu_t)
        _poison_cuda_allocator(q, k, v)
        o.backward(do)
        torch.cuda.synchronize()
        runs.append((o.detach(), lse) + tuple(x.grad for x in xs))
    (o, lse, *grads), (o_ok, lse_ok, *grads_ok) = runs
    a, b = covered
    for name, x, x_ok in zip(("o", "dq", "dk", "dv"), [o] + grads, [o_ok] + grads_ok):
        assert torch.isfinite(x).all(), name
        assert torch.equal(x[:, a:b], x_ok[:, a:b]), name
        outside = torch.cat([x[:, :a], x[:, b:]], dim=1)
        assert torch.equal(outside, torch.zeros_like(outside)), name
    assert torch.equal(lse[..., a:b], lse_ok[..., a:b])
    assert torch.isneginf(lse[..., :a]).all() and torch.isneginf(lse[..., b:]).all()


@_CUDA_ONLY
@pytest.mark.parametrize("dtype,D,Dv", [(torch.float32, 48, 40), (torch.bfloat16, 64, 64), (torch.bfloat16, 128, 128),
                                        (torch.float64, 24, 20), (torch.float16, 96, 96)],
                         ids=["fp32-D48-Dv40", "bf16-D64", "bf16-D128", "fp64-D24-Dv20", "fp16-D96"])
def test_cuda_matches_cpu(ar, dtype, D, Dv):
    cu = [0, 33, 33, 200, 260]
    for B, Tq, Tk, cu_l in ((2, 150, 190, None), (1, 260, 260, cu)):
        q, k, v = _qkv(B, Tq, Tk, 4, 2, D, Dv, dtype, "cpu")
        do = _mk((B, Tq, 4, Dv), dtype, "cpu", torch.Generator().manual_seed(3))
        cu_t = torch.tensor(cu_l, dtype=torch.int32) if cu_l is not None else None
        on_cpu = _run(ar.softmax.streaming_attn, q, k, v, do, cu_seqlens=cu_t)
        on_cuda = _run(ar.softmax.streaming_attn, q.cuda(), k.cuda(), v.cuda(), do.cuda(),
                       cu_seqlens=cu_t.cuda() if cu_t is not None else None)
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
        for name, a, b in zip(("o", "dq", "dk", "dv"), on_cuda, on_cpu):
            assert relative_rms(a.cpu(), b) <= tol, name


@_CUDA_ONLY
@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 64)],
                         ids=["bf16-D128", "fp16-D64", "fp32-D64"])
def test_cuda_forward_backward_bitwise_deterministic(ar, dtype, D):
    q, k, v = _qkv(2, 700, 700, 8, 2, D, D, dtype, "cuda")
    do = _mk((2, 700, 8, D), dtype, "cuda", torch.Generator().manual_seed(5))
    first = _run(ar.softmax.streaming_attn, q, k, v, do)
    for _ in range(20):
        again = _run(ar.softmax.streaming_attn, q, k, v, do)
        for name, a, b in zip(("o", "dq", "dk", "dv"), again, first):
            assert torch.equal(a, b), name


@_CUDA_ONLY
def test_cuda_unaligned_rows_take_the_generic_path(ar):
    """bf16, D = 64 but rows not 16-byte aligned (a view one element in): same math, no fault."""
    g = torch.Generator().manual_seed(6)
    base = _mk((1, 200, 3, 65), torch.bfloat16, "cuda", g)
    q, k, v = base[:, :, :2, 1:], base[:, :, 2:, 1:], base[:, :, 2:, :64]
    do = _mk((1, 200, 2, 64), torch.bfloat16, "cuda", g)
    ours = _run(ar.softmax.streaming_attn, q, k, v, do)
    aligned = _run(ar.softmax.streaming_attn, q.contiguous(), k.contiguous(), v.contiguous(), do)
    for a, b in zip(ours, aligned):
        assert relative_rms(a, b) <= 8e-3


def _decode_reference(ar, q, k_cache, v_cache, lens):
    """float64 attention of q [B, H, D] over cache rows [0, lens[b]) of each b."""
    out = []
    for b, L in enumerate(lens.tolist()):
        o, _ = ar.softmax.reference_attn(q[b:b + 1, None].double(), k_cache[b:b + 1, :L].double(),
                                         v_cache[b:b + 1, :L].double(), causal=False)
        out.append(o[0, 0])
    return torch.stack(out)


@_CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_dt_id)
@pytest.mark.parametrize("H,Hkv,D", [(4, 4, 128), (8, 2, 64), (32, 2, 128), (6, 2, 40)],
                         ids=["G1-D128", "G4-D64", "G16-D128", "G3-D40"])
@pytest.mark.parametrize("split_size", [None, 100])
def test_cuda_decode_step(ar, dtype, H, Hkv, D, split_size):
    """Fast (D = Dv in {64, 128}) and generic step kernels, one and many splits, ragged lengths
    (0, 1, mid, full), GQA: equals float64 attention over the cache; the step with k_new equals
    the step without it over the appended cache, bit for bit."""
    B, Lmax = 5, 3000
    g = torch.Generator().manual_seed(8)
    q = _mk((B, H, D), dtype, "cuda", g)
    k_cache, v_cache = _mk((B, Lmax, Hkv, D), dtype, "cuda", g), _mk((B, Lmax, Hkv, D), dtype, "cuda", g)
    k_new, v_new = _mk((B, Hkv, D), dtype, "cuda", g), _mk((B, Hkv, D), dtype, "cuda", g)
    lens = torch.tensor([0, 1, 777, 2048, Lmax - 1], dtype=torch.int32, device="cuda")
    kc0 = k_cache.clone()
    o = ar.softmax.softmax_attn_step(q, k_cache, v_cache, lens, k_new=k_new, v_new=v_new, split_size=split_size)
    rows = torch.arange(B, device="cuda")
    assert torch.equal(k_cache[rows, lens.long()], k_new) and torch.equal(v_cache[rows, lens.long()], v_new)
    untouched = torch.ones(B, Lmax, dtype=torch.bool, device="cuda")
    untouched[rows, lens.long()] = False
    assert torch.equal(k_cache[untouched], kc0[untouched])
    ref = _decode_reference(ar, q, k_cache, v_cache, lens + 1)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
    assert relative_rms(o, ref) <= tol
    o2 = ar.softmax.softmax_attn_step(q, k_cache, v_cache, lens + 1, split_size=split_size)
    assert torch.equal(o2, o)
    o0 = ar.softmax.softmax_attn_step(q, k_cache, v_cache, torch.zeros_like(lens), split_size=split_size)
    assert torch.equal(o0, torch.zeros_like(o0))


@_CUDA_ONLY
@pytest.mark.parametrize("D", [64, 48])
def test_cuda_decode_length_out_of_range_gives_nan_and_writes_nothing(ar, D):
    q = torch.randn(3, 4, D, device="cuda")
    kc, vc = torch.randn(3, 50, 2, D, device="cuda"), torch.randn(3, 50, 2, D, device="cuda")
    kn, vn = torch.randn(3, 2, D, device="cuda"), torch.randn(3, 2, D, device="cuda")
    kc0, vc0 = kc.clone(), vc.clone()
    for split in (None, 8):
        o = ar.softmax.softmax_attn_step(q, kc, vc, torch.tensor([50, -1, 10], dtype=torch.int32, device="cuda"),
                                         k_new=kn, v_new=vn, split_size=split)
        assert torch.isnan(o[:2]).all() and torch.isfinite(o[2]).all()
        assert torch.equal(kc[:2], kc0[:2]) and torch.equal(vc[:2], vc0[:2])


@_CUDA_ONLY
@pytest.mark.parametrize("split_size", [None, 64])
def test_cuda_decode_step_under_cuda_graph_capture(ar, split_size):
    B, H, Hkv, D, Lmax = 4, 8, 2, 128, 4096
    g = torch.Generator().manual_seed(9)
    q = _mk((B, H, D), torch.bfloat16, "cuda", g)
    kc, vc = _mk((B, Lmax, Hkv, D), torch.bfloat16, "cuda", g), _mk((B, Lmax, Hkv, D), torch.bfloat16, "cuda", g)
    kn, vn = _mk((B, Hkv, D), torch.bfloat16, "cuda", g), _mk((B, Hkv, D), torch.bfloat16, "cuda", g)
    lens = torch.tensor([5, 1000, 3000, 4000], dtype=torch.int32, device="cuda")
    kc_ref, vc_ref = kc.clone(), vc.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        ar.softmax.softmax_attn_step(q, kc.clone(), vc.clone(), lens, k_new=kn, v_new=vn, split_size=split_size)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = ar.softmax.softmax_attn_step(q, kc, vc, lens, k_new=kn, v_new=vn, split_size=split_size)
    for step in range(3):
        graph.replay()
        o_ref = ar.softmax.softmax_attn_step(q, kc_ref, vc_ref, lens, k_new=kn, v_new=vn, split_size=split_size)
        torch.cuda.synchronize()
        assert torch.equal(o, o_ref) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
        lens += 1  # the captured kernels read the lengths from the device on every replay
        kn.add_(0.5)


@_CUDA_ONLY
def test_cuda_ops_run_on_the_current_stream(ar):
    q, k, v = _qkv(2, 900, 900, 4, 2, 128, 128, torch.bfloat16, "cuda")
    do = torch.randn(2, 900, 4, 128, device="cuda", dtype=torch.bfloat16)
    expected = _run(ar.softmax.streaming_attn, q, k, v, do)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = _run(ar.softmax.streaming_attn, q, k, v, do)
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@_CUDA_ONLY
def test_cuda_past_2_pow_31_elements_uses_64_bit_offsets(ar):
    """q, k, v, o of more than 2**31 elements each (bf16, 1024-token sequences packed with
    cu_seqlens): the last sequences start past element 2**31 and match the reference, forward
    and backward."""
    H, D, L = 1, 128, 1024
    N = (2**31) // (L * H * D) + 1
    T = N * L
    cu = torch.arange(0, T + 1, L, device="cuda", dtype=torch.int64)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    assert q.numel() > 2**31
    o, lse = torch.ops.attnrnn.softmax_attn_fwd(q, k, v, cu, D ** -0.5, True)
    dq, dk, dv = torch.ops.attnrnn.softmax_attn_bwd(do, q, k, v, o, lse, cu, D ** -0.5, True)
    for n in (0, N - 2, N - 1):
        s = slice(n * L, (n + 1) * L)
        r = _run(ar.softmax.reference_attn, q[:, s].double(), k[:, s].double(), v[:, s].double(), do[:, s].double())
        for name, x, ref in zip(("o", "dq", "dk", "dv"), (o[:, s], dq[:, s], dk[:, s], dv[:, s]), r):
            assert relative_rms(x.double(), ref) <= 8e-3, (n, name)
