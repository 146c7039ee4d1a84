"""Every bad input raises ValueError/TypeError/RuntimeError whose message names the offending argument.
Nothing is silently wrong."""
import pytest
import torch

from cases import assert_fake_kernel_raises_like_the_op

from conftest import HAS_CUDA

CUDA_ONLY = pytest.mark.skipif(not HAS_CUDA, reason="needs a second device")
# Values inside device tensors (cu_seqlens offsets, state_indices rows) are checked on the CPU only:
# reading them back would synchronize the GPU. On CUDA the kernels clamp offsets and skip rows
# outside the pool (test_cuda.py checks that nothing is read or written out of bounds).
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
    ("normalize-str", _set(normalize="False"), r"normalize", None),
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
    ("step-requires-grad", _step_set(q=lambda dev, d: d["q"].requires_grad_()),
     r"grad|differentiable", None),
    ("step-state-S-requires-grad",
     _step_set(state=lambda dev, d: (d["state"][0].requires_grad_(), d["state"][1])),
     r"state\.S requires grad", None),
    ("step-state-z-requires-grad",
     _step_set(state=lambda dev, d: (d["state"][0], d["state"][1].requires_grad_())),
     r"state\.z requires grad", None),
]


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
            out.append(pytest.param(api, build, regex, id=f"{api}-{name}", marks=_marks(mark)))
    for name, build, regex, mark in STEP_CASES:
        out.append(pytest.param("step", build, regex, id=name, marks=_marks(mark)))
    return out


@pytest.mark.parametrize("api,build,regex", _params())
def test_bad_input_raises_naming_the_argument(ar, device, api, build, regex, request):
    if device != "cpu" and VALUES_CHECKED_ON_CPU in request.node.keywords:
        pytest.skip("device-side values are validated on the CPU only (no host sync)")
    d = build(device)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=regex):
        if api == "step":
            ar.linear_attn_step(d["q"], d["k"], d["v"], d["state"], **d["kw"])
        else:
            getattr(ar, f"{api}_linear_attn")(d["q"], d["k"], d["v"], **d["kw"])


def test_step_state_requiring_grad_is_accepted_under_no_grad(ar, device):
    d = _step_valid(device)
    S, z = (x.requires_grad_() for x in d["state"])
    with torch.no_grad():
        ar.linear_attn_step(d["q"], d["k"], d["v"], (S, z), **d["kw"])


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
