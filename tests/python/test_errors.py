"""Every bad input raises ValueError (TypeError for an argument of the wrong type) whose message names
the offending argument, before anything changes. Nothing is silently wrong."""
import math

import pytest
import torch

from cases import assert_fake_kernel_raises_like_the_op

from conftest import HAS_CUDA

CUDA_ONLY = pytest.mark.requires_cuda(reason="needs a second device")
# Values inside device tensors (cu_seqlens offsets, state_indices rows) are checked on the CPU only:
# reading them back would synchronize the GPU. On CUDA the kernels clamp offsets and skip rows
# outside the pool (test_cuda.py checks that nothing is read or written out of bounds), and give
# entries that share a row NaN outputs (test_decode.py).
VALUES_CHECKED_ON_CPU = "values"


def _valid(device, B=2, T=8, H=4, Hkv=2, K=16, V=8, dtype=torch.float32):
    return dict(q=torch.randn(B, T, H, K, device=device, dtype=dtype),
                k=torch.randn(B, T, Hkv, K, device=device, dtype=dtype),
                v=torch.randn(B, T, Hkv, V, device=device, dtype=dtype),
                kw=dict(feature_map="elu1"))


def _state(device, N=2, Hkv=2, K=16, V=8, dtype=torch.float32):
    return (torch.zeros(N, Hkv, K, V, device=device, dtype=dtype),
            torch.ones(N, Hkv, K, device=device, dtype=dtype))


def _varlen(device, cu, T=8):
    d = _valid(device, B=1, T=T)
    d["kw"]["cu_seqlens"] = cu.to(device) if isinstance(cu, torch.Tensor) else cu
    return d


def _set(**changes):
    def f(device):
        d = _valid(device)
        for key, val in changes.items():
            val = val(device, d) if callable(val) else val
            if key in ("q", "k", "v"):
                d[key] = val
            else:
                d["kw"][key] = val
        return d
    return f


other = "cpu" if HAS_CUDA else None


def _other_device(device):
    return "cpu" if device == "cuda" else "cuda"


# (id, builder(device) -> dict(q, k, v, kw), regex naming the argument, marks)
SEQUENCE_CASES = [
    ("k-on-other-device", _set(k=lambda dev, d: d["k"].to(_other_device(dev))), r"\bk\b", CUDA_ONLY),
    ("initial_state-on-other-device",
     _set(initial_state=lambda dev, d: _state(_other_device(dev))), r"initial_state", CUDA_ONLY),
    ("q-int-dtype", _set(q=lambda dev, d: d["q"].to(torch.int32)), r"\bq\b", None),
    ("k-dtype-mix", _set(k=lambda dev, d: d["k"].to(torch.bfloat16)), r"\bk\b", None),
    ("v-dtype-mix", _set(v=lambda dev, d: d["v"].double()), r"\bv\b", None),
    ("q-rank-3", _set(q=lambda dev, d: d["q"][0]), r"\bq\b", None),
    ("k-rank-5", _set(k=lambda dev, d: d["k"][None]), r"\bk\b", None),
    ("k-batch-mismatch", _set(k=lambda dev, d: d["k"][:1]), r"\bk\b", None),
    ("v-seqlen-mismatch", _set(v=lambda dev, d: d["v"][:, :5]), r"\bv\b", None),
    ("k-headdim-mismatch", _set(k=lambda dev, d: d["k"][..., :8]), r"\bk\b", None),
    ("v-heads-differ-from-k", _set(v=lambda dev, d: d["v"][:, :, :1]), r"\bv\b", None),
    ("H-not-divisible-by-Hkv",
     _set(k=lambda dev, d: torch.randn(2, 8, 3, 16, device=dev),
          v=lambda dev, d: torch.randn(2, 8, 3, 8, device=dev)), r"\b(q|k)\b", None),
    ("headdim-K-0",
     _set(q=lambda dev, d: d["q"][..., :0], k=lambda dev, d: d["k"][..., :0]), r"\b(q|k)\b", None),
    ("headdim-V-0", _set(v=lambda dev, d: d["v"][..., :0]), r"\bv\b", None),
    ("headdim-K-257",
     _set(q=lambda dev, d: torch.randn(2, 8, 4, 257, device=dev),
          k=lambda dev, d: torch.randn(2, 8, 2, 257, device=dev)), r"\b(q|k)\b", None),
    ("headdim-V-300", _set(v=lambda dev, d: torch.randn(2, 8, 2, 300, device=dev)), r"\bv\b", None),
    ("q-last-dim-stride-2",
     _set(q=lambda dev, d: torch.randn(2, 8, 4, 32, device=dev)[..., ::2]), r"\bq\b", None),
    ("v-last-dim-stride-2",
     _set(v=lambda dev, d: torch.randn(2, 8, 2, 16, device=dev)[..., ::2]), r"\bv\b", None),
    ("cu_seqlens-float", lambda dev: _varlen(dev, torch.tensor([0.0, 3.0, 8.0])), r"cu_seqlens", None),
    ("cu_seqlens-not-from-0", lambda dev: _varlen(dev, torch.tensor([1, 3, 8])), r"cu_seqlens", VALUES_CHECKED_ON_CPU),
    ("cu_seqlens-decreasing", lambda dev: _varlen(dev, torch.tensor([0, 5, 3, 8])), r"cu_seqlens", VALUES_CHECKED_ON_CPU),
    ("cu_seqlens-not-ending-at-T", lambda dev: _varlen(dev, torch.tensor([0, 3, 7])), r"cu_seqlens", VALUES_CHECKED_ON_CPU),
    ("cu_seqlens-past-T", lambda dev: _varlen(dev, torch.tensor([0, 3, 9])), r"cu_seqlens", VALUES_CHECKED_ON_CPU),
    ("cu_seqlens-2d", lambda dev: _varlen(dev, torch.tensor([[0, 3, 8]])), r"cu_seqlens", None),
    ("cu_seqlens-with-B2",
     _set(cu_seqlens=lambda dev, d: torch.tensor([0, 8], dtype=torch.int32, device=dev)),
     r"cu_seqlens", None),
    ("initial_state-S-wrong-shape",
     _set(initial_state=lambda dev, d: (torch.zeros(2, 2, 16, 9, device=dev), _state(dev)[1])),
     r"initial_state", None),
    ("initial_state-wrong-N",
     _set(initial_state=lambda dev, d: _state(dev, N=3)), r"initial_state", None),
    ("initial_state-z-wrong-shape",
     _set(initial_state=lambda dev, d: (_state(dev)[0], torch.ones(2, 4, 16, device=dev))),
     r"initial_state", None),
    ("initial_state-S-wrong-dtype",
     _set(initial_state=lambda dev, d: _state(dev, dtype=torch.bfloat16)), r"initial_state", None),
    ("initial_state-fp64-for-fp32",
     _set(initial_state=lambda dev, d: _state(dev, dtype=torch.float64)), r"initial_state", None),
    ("initial_state-missing-z-with-normalize",
     _set(initial_state=lambda dev, d: (_state(dev)[0], None)), r"initial_state", None),
    ("feature_map-unknown", _set(feature_map="gelu"), r"feature_map", None),
    ("feature_map-not-str-or-callable", _set(feature_map=3), r"feature_map", None),
    ("feature_map-returns-no-tensor", _set(feature_map=lambda dev, d: lambda x: x.tolist()), r"feature_map\(q\)", None),
    ("scale-nan", _set(scale=float("nan")), r"scale", None),
    ("scale-str", _set(scale="0.5"), r"scale", None),
    ("scale-complex", _set(scale=1 + 2j), r"scale", None),
    ("eps-None", _set(eps=None), r"\beps\b", None),
    ("eps-negative", _set(eps=-1.0), r"\beps\b", None),
    ("normalize-str", _set(normalize="False"), r"normalize", None),
    ("normalize-None", _set(normalize=None), r"normalize", None),
    ("feature_map-output-strided", _set(feature_map=lambda dev, d: lambda x: torch.cat([x, x], -1)[..., ::2]),
     r"feature_map\(q\) must have unit stride in its last dimension", None),
    ("feature_map-output-drops-heads", _set(feature_map=lambda dev, d: lambda x: x.flatten(2)),
     r"feature_map\(q\) must keep the leading dimensions", None),
    ("cu_seqlens-list", _set(cu_seqlens=[0, 3, 8]), r"cu_seqlens", None),
    ("output_final_state-str", _set(output_final_state="no"), r"output_final_state", None),
    ("q-0d", _set(q=lambda dev, d: torch.tensor(1.0, device=dev)), r"\bq\b", None),
    # a meta tensor among real ones reaches the fake kernel, which must refuse it as the op does
    ("k-on-meta", _set(k=lambda dev, d: d["k"].to("meta")), r"\bk must be on the device of q", None),
    ("cu_seqlens-on-meta", _set(cu_seqlens=lambda dev, d: torch.tensor([0, 3, 8], device="meta")),
     r"cu_seqlens must be on the device of q", None),
    ("initial_state-on-meta", _set(initial_state=lambda dev, d: tuple(s.to("meta") for s in _state(dev))),
     r"initial_state\.S must be on the device of q", None),
]
CHUNK_ONLY_CASES = [
    ("chunk_size-0", _set(chunk_size=0), r"chunk_size", None),
    ("chunk_size-negative", _set(chunk_size=-16), r"chunk_size", None),
    ("chunk_size-str", _set(chunk_size="16"), r"chunk_size", None),
    ("chunk_size-float", _set(chunk_size=16.0), r"chunk_size", None),
]


def _step_valid(device, B=3, P=4, H=4, Hkv=2, K=16, V=8):
    return dict(q=torch.randn(B, H, K, device=device), k=torch.randn(B, Hkv, K, device=device),
                v=torch.randn(B, Hkv, V, device=device),
                state=(torch.zeros(P, Hkv, K, V, device=device), torch.ones(P, Hkv, K, device=device)),
                kw=dict(feature_map="elu1"))


def _step_set(**changes):
    def f(device):
        d = _step_valid(device)
        for key, val in changes.items():
            val = val(device, d) if callable(val) else val
            if key in ("q", "k", "v", "state"):
                d[key] = val
            else:
                d["kw"][key] = val
        return d
    return f


def _inside(base, shape):
    """A contiguous tensor of `shape` in the first elements of base's memory."""
    return base.view(-1)[:torch.Size(shape).numel()].view(shape)


def _idx(*rows, dtype=torch.int64):
    return lambda dev, d: torch.tensor(rows, dtype=dtype, device=dev)


STEP_CASES = [
    ("step-q-2d", _step_set(q=lambda dev, d: d["q"][0]), r"\bq\b", None),
    ("step-q-5d", _step_set(q=lambda dev, d: d["q"][:, None, None]), r"\bq\b", None),
    ("step-q-4d-T2", _step_set(q=lambda dev, d: torch.randn(3, 2, 4, 16, device=dev)), r"\bq\b", None),
    ("step-k-dtype-mix", _step_set(k=lambda dev, d: d["k"].half()), r"\bk\b", None),
    ("step-state_indices-out-of-range", _step_set(state_indices=_idx(0, 4, 1)), r"state_indices", VALUES_CHECKED_ON_CPU),
    ("step-state_indices-duplicate", _step_set(state_indices=_idx(2, 0, 2)), r"state_indices", VALUES_CHECKED_ON_CPU),
    ("step-state_indices-wrong-length", _step_set(state_indices=_idx(0, 1)), r"state_indices", None),
    ("step-state_indices-float",
     _step_set(state_indices=lambda dev, d: torch.tensor([0.0, 1.0, 2.0], device=dev)),
     r"state_indices", None),
    ("step-pool-smaller-than-batch-without-indices",
     _step_set(state=lambda dev, d: (d["state"][0][:2], d["state"][1][:2])), r"state", None),
    ("step-state-S-wrong-shape",
     _step_set(state=lambda dev, d: (torch.zeros(4, 2, 16, 9, device=dev), d["state"][1])),
     r"state", None),
    ("step-state-fp16", _step_set(state=lambda dev, d: (d["state"][0].half(), d["state"][1].half())),
     r"state", None),
    ("step-state-missing-z-with-normalize",
     _step_set(state=lambda dev, d: (d["state"][0], None)), r"state|\bz\b", None),
    ("step-state-on-other-device",
     _step_set(state=lambda dev, d: tuple(s.to(_other_device(dev)) for s in d["state"])),
     r"state", CUDA_ONLY),
    ("step-feature_map-unknown", _step_set(feature_map="softmax"), r"feature_map", None),
    ("step-state_indices-on-meta", _step_set(state_indices=lambda dev, d: torch.tensor([0, 1, 2], device="meta")),
     r"state_indices must be on the device of q", None),
    ("step-eps-str", _step_set(eps="1e-6"), r"\beps\b", None),
    ("step-normalize-None", _step_set(normalize=None), r"normalize", None),
    ("step-scale-nan", _step_set(scale=math.nan), r"scale", None),
    ("step-state_indices-list", _step_set(state_indices=[0, 1, 2]), r"state_indices", None),
    ("step-feature_map-output-strided",
     _step_set(feature_map=lambda dev, d: lambda x: torch.cat([x, x], -1)[..., ::2]),
     r"feature_map\(q\) must have unit stride in its last dimension", None),
    ("step-requires-grad", _step_set(q=lambda dev, d: d["q"].requires_grad_()),
     r"grad|differentiable", None),
    ("step-state-S-requires-grad",
     _step_set(state=lambda dev, d: (d["state"][0].requires_grad_(), d["state"][1])),
     r"state\.S requires grad", None),
    ("step-state-z-requires-grad",
     _step_set(state=lambda dev, d: (d["state"][0], d["state"][1].requires_grad_())),
     r"state\.z requires grad", None),
    ("step-state-z-inside-state-S",
     _step_set(state=lambda dev, d: (d["state"][0], _inside(d["state"][0], d["state"][1].shape))),
     r"state\.z and state\.S must not share memory", None),
    ("step-v-inside-state-S", _step_set(v=lambda dev, d: _inside(d["state"][0], d["v"].shape)),
     r"state\.S and v must not share memory", None),
    ("step-k-inside-state-z", _step_set(k=lambda dev, d: _inside(d["state"][1], d["k"].shape)),
     r"state\.z and k must not share memory", None),
]


# The cases whose argument has the wrong type: TypeError. Every other case: ValueError.
WRONG_TYPE = {"feature_map-not-str-or-callable", "feature_map-returns-no-tensor", "scale-str", "scale-complex",
              "eps-None", "normalize-str", "normalize-None", "output_final_state-str", "cu_seqlens-list",
              "chunk_size-str", "chunk_size-float", "step-eps-str", "step-normalize-None", "step-state_indices-list"}


def _marks(mark):
    if mark is None:
        return []
    if mark == VALUES_CHECKED_ON_CPU:
        return [getattr(pytest.mark, VALUES_CHECKED_ON_CPU)]
    return [mark]


def _params():
    out = []
    for api in ("chunk", "recurrent"):
        for name, build, regex, mark in SEQUENCE_CASES + (CHUNK_ONLY_CASES if api == "chunk" else []):
            error = TypeError if name in WRONG_TYPE else ValueError
            out.append(pytest.param(api, build, error, regex, id=f"{api}-{name}", marks=_marks(mark)))
    for name, build, regex, mark in STEP_CASES:
        error = TypeError if name in WRONG_TYPE else ValueError
        out.append(pytest.param("step", build, error, regex, id=name, marks=_marks(mark)))
    return out


@pytest.mark.parametrize("api,build,error,regex", _params())
def test_bad_input_raises_naming_the_argument(ar, device, api, build, error, regex, request):
    if device != "cpu" and VALUES_CHECKED_ON_CPU in request.node.keywords:
        pytest.skip("device-side values are validated on the CPU only (no host sync)")
    d = build(device)
    with pytest.raises(error, match=regex):
        if api == "step":
            ar.linear_attn_step(d["q"], d["k"], d["v"], d["state"], **d["kw"])
        else:
            getattr(ar, f"{api}_linear_attn")(d["q"], d["k"], d["v"], **d["kw"])


def test_step_state_requiring_grad_is_accepted_under_no_grad(ar, ref, device):
    """Under no_grad a state that requires grad is a state like any other: the step updates it in
    place and returns what the reference step returns."""
    d = _step_valid(device)
    S, z = (x.clone().requires_grad_() for x in d["state"])
    S_ref, z_ref = (x.clone() for x in d["state"])
    with torch.no_grad():
        o = ar.linear_attn_step(d["q"], d["k"], d["v"], (S, z), **d["kw"])
    o_ref = ref.linear_attn_step(d["q"], d["k"], d["v"], (S_ref, z_ref), **d["kw"])
    assert not torch.equal(S_ref, d["state"][0])  # the reference did update the state
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(S.detach(), S_ref)
    torch.testing.assert_close(z.detach(), z_ref)


# ---- fake kernels (torch.compile / FakeTensorMode) raise the real op's named ValueError -----------

def _seq_args(q_shape=(2, 8, 4, 16), v_shape=(2, 8, 2, 8), cu=None):
    q, k = torch.randn(*q_shape), torch.randn(2, 8, 2, 16)
    return (q, k, torch.randn(*v_shape), None, None, cu, 0.25, 1e-6, "elu1", True, True)


def _bwd_args(q_shape=(2, 8, 4, 16), cu=None, chunk=False):
    q = torch.randn(*q_shape)
    tensors = (torch.randn(2, 8, 4, 8), q, torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 8), torch.randn(2, 8, 4, 8))
    saved = (torch.zeros(0, dtype=torch.uint8),) if chunk else ()
    options = (None, None, None, None, cu, 0.25, 1e-6, "elu1", True) + ((0,) if chunk else ())
    return tensors + saved + options


def _empty_cu():
    return torch.zeros(0, dtype=torch.int32)


# (id, op name, builder of the arguments, regex naming the argument)
FAKE_CASES = [
    ("chunk_fwd-q-3d", "chunk_fwd", lambda: _seq_args(q_shape=(2, 8, 64)) + (0,), r"\bq must be a 4-D tensor"),
    ("chunk_fwd-v-3d", "chunk_fwd", lambda: _seq_args(v_shape=(2, 8, 16)) + (0,), r"\bv must be a 4-D tensor"),
    ("chunk_fwd-cu_seqlens-empty", "chunk_fwd", lambda: _seq_args(cu=_empty_cu()) + (0,),
     r"cu_seqlens must be a 1-D tensor \[N \+ 1\]"),
    ("chunk_fwd-cu_seqlens-2d", "chunk_fwd",
     lambda: _seq_args(cu=torch.zeros(1, 2, dtype=torch.int32)) + (0,), r"cu_seqlens must be a 1-D tensor"),
    ("recurrent_fwd-q-3d", "recurrent_fwd", lambda: _seq_args(q_shape=(2, 8, 64)), r"\bq must be a 4-D tensor"),
    ("recurrent_fwd-cu_seqlens-empty", "recurrent_fwd", lambda: _seq_args(cu=_empty_cu()),
     r"cu_seqlens must be a 1-D tensor"),
    ("chunk_bwd-q-3d", "chunk_bwd", lambda: _bwd_args(q_shape=(2, 8, 64), chunk=True), r"\bq must be a 4-D tensor"),
    ("recurrent_bwd-cu_seqlens-empty", "recurrent_bwd", lambda: _bwd_args(cu=_empty_cu()),
     r"cu_seqlens must be a 1-D tensor"),
    ("step-q-2d", "step",
     lambda: (torch.randn(3, 64), torch.randn(3, 2, 16), torch.randn(3, 2, 8), torch.zeros(4, 2, 16, 8),
              torch.ones(4, 2, 16), None, 0.25, 1e-6, "elu1", True),
     r"\bq must be a 3-D tensor"),
]


@pytest.mark.parametrize("name,build,regex", [pytest.param(*c[1:], id=c[0]) for c in FAKE_CASES])
def test_fake_kernel_raises_the_named_error_of_the_real_op(ar, name, build, regex):
    assert_fake_kernel_raises_like_the_op(name, build, regex)


# ---- the backward's saved argument (what the forward kept for it) ----------------------------------

def _bwd_call(saved, device="cpu"):
    """chunk_bwd on valid tensors (B 2, T 8, H 4, Hkv 2, K 16, V 8) with the given saved tensor."""
    q, k, v = (torch.randn(2, 8, h, d, device=device) for h, d in ((4, 16), (2, 16), (2, 8)))
    dout, o = torch.randn(2, 8, 4, 8, device=device), torch.randn(2, 8, 4, 8, device=device)
    return torch.ops.attnrnn.chunk_bwd(dout, q, k, v, o, saved, None, None, None, None, None, 0.25, 1e-6, "elu1",
                                       True, 0)


@pytest.mark.parametrize("saved,regex", [
    pytest.param(torch.zeros(0, dtype=torch.float32), r"saved must be the forward's saved tensor .*uint8 \[0\]",
                 id="fp32"),
    pytest.param(torch.zeros(16, dtype=torch.uint8), r"saved must be the forward's saved tensor .*uint8 \[0\]",
                 id="wrong-size"),
    pytest.param(torch.zeros(2, 0, dtype=torch.uint8), r"saved must be the forward's saved tensor", id="2-D"),
])
def test_chunk_bwd_rejects_a_saved_tensor_of_another_forward(ar, saved, regex):
    with pytest.raises(ValueError, match=regex):
        _bwd_call(saved)


def test_chunk_bwd_takes_the_forwards_saved_tensor(ar, device):
    q, k, v = (torch.randn(2, 8, h, d, device=device) for h, d in ((4, 16), (2, 16), (2, 8)))
    o, _, _, saved = torch.ops.attnrnn.chunk_fwd(q, k, v, None, None, None, 0.25, 1e-6, "elu1", True, False, 0, True)
    dout = torch.randn_like(o)
    dq, dk, dv, _, _ = torch.ops.attnrnn.chunk_bwd(dout, q, k, v, o, saved, None, None, None, None, None, 0.25, 1e-6,
                                                   "elu1", True, 0)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    torch.autograd.backward(torch.ops.attnrnn.chunk_fwd(qg, kg, vg, None, None, None, 0.25, 1e-6, "elu1", True,
                                                        False, 0)[0], dout)
    for got, want in ((dq, qg.grad), (dk, kg.grad), (dv, vg.grad)):
        assert torch.equal(got, want)


# ---- the reference checks the options the ops check (any head dim: it is plain PyTorch) ----------

REFERENCE_CASES = [
    ("normalize-str", dict(normalize="False"), TypeError, r"normalize"),
    ("normalize-None", dict(normalize=None), TypeError, r"normalize"),
    ("eps-negative", dict(eps=-1.0), ValueError, r"\beps\b"),
    ("eps-nan", dict(eps=math.nan), ValueError, r"\beps\b"),
    ("scale-nan", dict(scale=math.nan), ValueError, r"scale"),
    ("scale-str", dict(scale="0.5"), TypeError, r"scale"),
    ("feature_map-int", dict(feature_map=3), TypeError, r"feature_map"),
]
REFERENCE_SEQUENCE_CASES = REFERENCE_CASES + [
    ("output_final_state-str", dict(output_final_state="no"), TypeError, r"output_final_state"),
]


@pytest.mark.parametrize("kw,error,regex", [pytest.param(*c[1:], id=c[0]) for c in REFERENCE_SEQUENCE_CASES])
@pytest.mark.parametrize("form", ["parallel", "recurrent", "chunk"])
def test_reference_form_checks_its_options(ref, form, kw, error, regex):
    d = _valid("cpu")
    with pytest.raises(error, match=regex):
        getattr(ref, f"{form}_linear_attn")(d["q"], d["k"], d["v"], **kw)


@pytest.mark.parametrize("chunk_size,error", [(0, ValueError), (-4, ValueError), ("4", TypeError), (4.0, TypeError)],
                         ids=["zero", "negative", "str", "float"])
def test_reference_chunk_form_checks_chunk_size(ref, chunk_size, error):
    d = _valid("cpu")
    with pytest.raises(error, match="chunk_size"):
        ref.chunk_linear_attn(d["q"], d["k"], d["v"], chunk_size=chunk_size)


@pytest.mark.parametrize("kw,error,regex", [pytest.param(*c[1:], id=c[0]) for c in REFERENCE_CASES])
def test_reference_step_checks_its_options(ref, kw, error, regex):
    d = _step_valid("cpu")
    before = [x.clone() for x in d["state"]]
    with pytest.raises(error, match=regex):
        ref.linear_attn_step(d["q"], d["k"], d["v"], d["state"], **kw)
    assert all(torch.equal(a, b) for a, b in zip(d["state"], before))


# ---- layers and models: bad options raise at construction -----------------------------------------

def _linear_layer(**kw):
    from attnrnn.nn import LinearAttention
    return LinearAttention(32, 4, **kw)


def _softmax_layer(**kw):
    from attnrnn.nn import SoftmaxAttention
    return SoftmaxAttention(32, 4, **kw)


def _lm(**kw):
    from attnrnn.lm import CausalLM, LMConfig
    return CausalLM(LMConfig(**{"vocab_size": 11, **kw}))


def _hedgehog(proj_dim):
    from attnrnn.nn import HedgehogFeatureMap
    return HedgehogFeatureMap(8, proj_dim)


# (id, constructor, its arguments, error, regex naming the argument)
CONSTRUCTOR_CASES = [
    ("linear-chunk_size-0", _linear_layer, dict(chunk_size=0), ValueError, r"chunk_size"),
    ("linear-chunk_size-str", _linear_layer, dict(chunk_size="16"), TypeError, r"chunk_size"),
    ("linear-eps-negative", _linear_layer, dict(eps=-1), ValueError, r"\beps\b"),
    ("linear-scale-nan", _linear_layer, dict(scale=math.nan), ValueError, r"scale"),
    ("linear-scale-str", _linear_layer, dict(scale="0.5"), TypeError, r"scale"),
    ("linear-head_dim-300", _linear_layer, dict(head_dim=300), ValueError, r"head_dim must be an int in \[1, 256\]"),
    ("linear-value_dim-300", _linear_layer, dict(value_dim=300), ValueError, r"value_dim must be an int in \[1, 256\]"),
    ("linear-feature_dim-400", _linear_layer, dict(head_dim=8, feature_map=_hedgehog(200)), ValueError,
     r"feature_map's feature_dim must be an int in \[1, 256\]"),
    ("linear-normalize-None", _linear_layer, dict(normalize=None), TypeError, r"normalize must be a bool"),
    ("linear-normalize-str", _linear_layer, dict(normalize="False"), TypeError, r"normalize must be a bool"),
    ("linear-output_norm-int", _linear_layer, dict(output_norm=1), TypeError, r"output_norm must be a bool"),
    ("linear-feature_map-int", _linear_layer, dict(feature_map=3), TypeError, r"feature_map"),
    ("linear-num_heads-float", _linear_layer, dict(num_kv_heads=2.0), TypeError, r"num_kv_heads"),
    ("softmax-scale-nan", _softmax_layer, dict(scale=math.nan), ValueError, r"scale"),
    ("softmax-qk_norm-str", _softmax_layer, dict(qk_norm="yes"), TypeError, r"qk_norm must be a bool"),
    ("softmax-layer_idx-negative", _softmax_layer, dict(layer_idx=-1), ValueError, r"layer_idx"),
    ("lm-vocab_size-0", _lm, dict(vocab_size=0), ValueError, r"vocab_size"),
    ("lm-vocab_size-str", _lm, dict(vocab_size="11"), TypeError, r"vocab_size"),
    ("lm-head_dim-300", _lm, dict(head_dim=300), ValueError, r"head_dim must be an int in \[1, 256\]"),
    ("lm-num_layers-0", _lm, dict(num_layers=0), ValueError, r"num_layers"),
    ("lm-mlp_ratio-0", _lm, dict(mlp_ratio=0.0), ValueError, r"mlp_ratio"),
    ("lm-normalize-None", _lm, dict(normalize=None), TypeError, r"normalize must be a bool"),
    ("lm-feature_map-unknown", _lm, dict(feature_map="gelu"), ValueError, r"feature_map"),
    ("lm-layer_types-int", _lm, dict(layer_types=3), TypeError, r"layer_types"),
]


@pytest.mark.parametrize("make,kw,error,regex", [pytest.param(*c[1:], id=c[0]) for c in CONSTRUCTOR_CASES])
def test_bad_constructor_argument_raises_naming_it(ar, make, kw, error, regex):
    with pytest.raises(error, match=regex):
        make(**kw)


def test_causal_lm_refuses_a_config_that_is_not_an_lmconfig(ar):
    from attnrnn.lm import CausalLM
    with pytest.raises(TypeError, match="config must be an LMConfig"):
        CausalLM(dict(vocab_size=11))


# ---- the softmax decoders ---------------------------------------------------------------------------

def _sm():
    import attnrnn.softmax
    return attnrnn.softmax


def _tiny(max_len=16):
    torch.manual_seed(0)
    return _sm().TinyTransformer(vocab=11, dim=16, n_layers=1, n_heads=2, max_len=max_len).eval()


def _ids(*shape, high=11):
    return torch.randint(0, high, shape)


def _kv(batch=1, max_len=None):
    return _sm().KVCacheDecoder(_tiny(), batch, max_len)


def _full_kv():
    kv = _kv(max_len=4)
    kv.prefill(_ids(1, 4))
    return kv


def _nocache():
    return _sm().NoCacheDecoder(_tiny(), block_size=4)


# (id, the call, error, regex naming the argument)
DECODER_CASES = [
    ("tiny-vocab-0", lambda: _sm().TinyTransformer(vocab=0), ValueError, r"vocab"),
    ("tiny-max_len-float", lambda: _sm().TinyTransformer(max_len=8.0), TypeError, r"max_len"),
    ("tiny-ids-out-of-vocab", lambda: _tiny()(torch.tensor([[1, 11]])), ValueError,
     r"ids must lie in \[0, vocab=11\), got values in \[1, 11\]"),
    ("tiny-ids-past-max_len", lambda: _tiny()(_ids(1, 17)), ValueError, r"ids: positions up to 16 exceed the model's max_len=16"),
    ("tiny-ids-float", lambda: _tiny()(torch.zeros(1, 3)), ValueError, r"ids must be an int32/int64 tensor \[B, T\]"),
    ("kv-model-str", lambda: _sm().KVCacheDecoder("model", 1), TypeError, r"model"),
    ("kv-batch-0", lambda: _kv(batch=0), ValueError, r"batch"),
    ("kv-max_len-past-the-model", lambda: _kv(max_len=17), ValueError, r"max_len must be an int in \[1, 16\]"),
    ("kv-prefill-past-max_len", lambda: _kv(max_len=4).prefill(_ids(1, 5)), ValueError, r"ids must be \[batch=1, T\]"),
    ("kv-prefill-wrong-batch", lambda: _kv().prefill(_ids(2, 3)), ValueError, r"ids must be \[batch=1, T\]"),
    ("kv-step-past-max_len", lambda: _full_kv().step(_ids(1)), ValueError, r"token: the KV cache is full \(max_len=4"),
    ("kv-step-out-of-vocab", lambda: _kv().step(torch.tensor([11])), ValueError, r"token must lie in \[0, vocab=11\)"),
    ("kv-step-wrong-shape", lambda: _kv().step(_ids(1, 1)), ValueError, r"token must be \[batch=1\]"),
    ("nocache-model-none", lambda: _sm().NoCacheDecoder(None), TypeError, r"model"),
    ("nocache-steps-negative", lambda: _nocache().generate(_ids(1, 3), steps=-1), ValueError, r"steps"),
    ("nocache-steps-float", lambda: _nocache().generate(_ids(1, 3), steps=1.5), TypeError, r"steps"),
    ("nocache-steps-past-max_len", lambda: _nocache().generate(_ids(1, 3), steps=14), ValueError,
     r"steps: 3 \+ 14 tokens exceed the model's max_len=16"),
    ("nocache-ids-out-of-vocab", lambda: _nocache().next_logits(torch.tensor([[0, -1]])), ValueError,
     r"ids must lie in \[0, vocab=11\)"),
]


@pytest.mark.parametrize("call,error,regex", [pytest.param(*c[1:], id=c[0]) for c in DECODER_CASES])
def test_softmax_decoder_bad_argument_raises_naming_it(ar, call, error, regex):
    with pytest.raises(error, match=regex):
        call()


def test_layer_names_a_feature_map_module_whose_output_is_strided(ar):
    from attnrnn.nn import LinearAttention

    class StridedMap(torch.nn.Module):
        feature_dim = 8

        def forward(self, x):
            return torch.cat([x, x], -1)[..., ::2]

    layer = LinearAttention(32, 4, feature_map=StridedMap())
    with pytest.raises(ValueError, match=r"feature_map\(q\) must have unit stride in its last dimension"):
        layer(torch.randn(1, 3, 32))
