"""float64 gradcheck of the chunk and recurrent ops with every option: normalize, each feature
map, initial state (gradients to it) and final state (gradients from it), varlen, GQA."""
import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

from cases import Case, make_inputs
from conftest import HAS_CUDA

OPTIONS = [
    Case(2, 5, 2, 4, torch.float64, V=3, feature_map=None, normalize=True),
    Case(2, 5, 2, 4, torch.float64, V=3, feature_map=None, normalize=False, initial_state=True,
         final_state=True),
    Case(2, 5, 2, 4, torch.float64, V=3, feature_map="elu1", initial_state=True, final_state=True),
    Case(2, 5, 2, 4, torch.float64, V=3, feature_map="relu", normalize=False, final_state=True),
    Case(2, 5, 4, 3, torch.float64, Hkv=2, V=2, feature_map="elu1", initial_state=True,
         final_state=True),
    Case(1, 7, 2, 3, torch.float64, Hkv=1, V=2, feature_map="elu1", initial_state=True,
         final_state=True, seqlens=(3, 0, 1, 3)),
]


@pytest.mark.parametrize("case", OPTIONS, ids=lambda c: c.id)
@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_gradcheck(ar, op, case, device):
    inp = make_inputs(case, device, positive=case.feature_map is None)
    fn = getattr(ar, f"{op}_linear_attn")
    extra = {"chunk_size": 2} if op == "chunk" else {}  # several chunks, last one partial
    names = [n for n in ("q", "k", "v", "S0", "z0") if n in inp]

    def f(*xs):
        d = dict(zip(names, xs))
        st0 = (d["S0"], d.get("z0")) if "S0" in d else None
        o, st = fn(d["q"], d["k"], d["v"], initial_state=st0, cu_seqlens=inp.get("cu_seqlens"),
                   **case.kwargs(), **extra)
        if st is None:
            return o
        return (o, st.S) + ((st.z,) if case.normalize else ())

    xs = [inp[n].detach().clone().requires_grad_() for n in names]
    assert gradcheck(f, xs, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_gradcheck_python_callable_feature_map(ar, op, device):
    case = Case(1, 4, 2, 3, torch.float64, V=2, feature_map=None)
    inp = make_inputs(case, device)
    fn = getattr(ar, f"{op}_linear_attn")

    def f(q, k, v):
        return fn(q, k, v, feature_map=lambda x: F.softplus(x), normalize=True)[0]

    xs = [inp[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
    assert gradcheck(f, xs, eps=1e-6, atol=1e-5, rtol=1e-4)


# ---- second order: the backward ops have no backward of their own -----------------------------------

@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_double_backward_raises_instead_of_silent_zero(ar, op, device):
    """create_graph=True builds the first-order gradient; differentiating it again must raise
    (the chunk_bwd/recurrent_bwd ops have no formula) rather than return zeros."""
    case = Case(1, 6, 2, 4, torch.float64, feature_map="elu1")
    inp = make_inputs(case, device)
    q = inp["q"].detach().clone().requires_grad_()
    o, _ = getattr(ar, f"{op}_linear_attn")(q, inp["k"], inp["v"], **case.kwargs())
    (dq,) = torch.autograd.grad(o.pow(2).sum(), q, create_graph=True)
    assert dq.requires_grad
    with pytest.raises(NotImplementedError, match=f"double backward of attnrnn::{op}_bwd"):
        torch.autograd.grad(dq.sum(), q)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("q_is_leaf", [True, False], ids=["leaf-q", "computed-q"])
def test_double_backward_on_cuda_raises_with_saved_features(ar, q_is_leaf):
    """The same where autograd saves phi(q), phi(k) instead of q and k (CUDA, bf16, elu1; without
    normalize o is not saved either, and o.sum() gives an upstream gradient with no history): the
    saved rows have no history, yet the backward's node must lead back to q (or to what q was
    computed from), so that differentiating dq reaches it and raises."""
    case = Case(1, 256, 2, 64, torch.bfloat16, feature_map="elu1", normalize=False)
    inp = make_inputs(case, "cuda")
    x = inp["q"].detach().clone().requires_grad_()
    q = x if q_is_leaf else x * 2
    o, _ = ar.chunk_linear_attn(q, inp["k"], inp["v"], **case.kwargs())
    (dx,) = torch.autograd.grad(o.sum(), x, create_graph=True)
    assert dx.requires_grad
    with pytest.raises(NotImplementedError, match="double backward of attnrnn::chunk_bwd"):
        torch.autograd.grad(dx.float().square().sum(), x)


def test_softmax_double_backward_raises_instead_of_silent_zero(ar, device):
    q, k, v = (torch.randn(1, 5, 2, 4, dtype=torch.float64, device=device) for _ in range(3))
    q.requires_grad_()
    o = ar.softmax.streaming_attn(q, k, v)
    (dq,) = torch.autograd.grad(o.pow(2).sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward of attnrnn::softmax_attn_bwd"):
        torch.autograd.grad(dq.sum(), q)


# ---- inference: the forward without an autograd node ---------------------------------------------

@pytest.mark.parametrize("op", ["chunk", "recurrent"])
@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
def test_no_grad_forward_records_nothing_and_matches_the_recorded_one(ar, op, normalize, device):
    """Under no_grad the forward skips the autograd Function (less host time per call): its
    outputs carry no graph and are bit for bit those of the recorded forward, final state too."""
    case = Case(2, 37, 4, 8, torch.float32, V=5, Hkv=2, feature_map="elu1", normalize=normalize, final_state=True)
    inp = make_inputs(case, device)
    q, k, v = (inp[n].detach().clone().requires_grad_() for n in "qkv")
    fn = getattr(ar, f"{op}_linear_attn")
    with torch.no_grad():
        o_inf, state_inf = fn(q, k, v, **case.kwargs())
    o_rec, state_rec = fn(q, k, v, **case.kwargs())
    assert o_inf.grad_fn is None and not o_inf.requires_grad and not state_inf.S.requires_grad
    assert o_rec.grad_fn is not None
    assert torch.equal(o_inf, o_rec) and torch.equal(state_inf.S, state_rec.S)
    if normalize:
        assert torch.equal(state_inf.z, state_rec.z)


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_forward_mode_ad_raises_instead_of_dropping_the_tangent(ar, op, device):
    """A dual input must not slip through the no-gradient path: the ops have no jvp, so forward
    mode raises rather than returning an output without a tangent."""
    import torch.autograd.forward_ad as fwAD

    case = Case(1, 6, 2, 4, torch.float64)
    inp = make_inputs(case, device)
    with fwAD.dual_level():
        q = fwAD.make_dual(inp["q"], torch.randn_like(inp["q"]))
        with pytest.raises(RuntimeError, match="jvp is not implemented"):
            getattr(ar, f"{op}_linear_attn")(q, inp["k"], inp["v"], **case.kwargs())


# ---- what the forward saves -----------------------------------------------------------------------

@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_cpu_backward_allows_in_place_on_output_with_normalize(ar, ref, op):
    """Only the CUDA backward reads o: on the CPU the output is not saved, so modifying it in
    place is allowed and the gradient is that of the modified graph."""
    case = Case(2, 9, 2, 4, torch.float64, V=3, feature_map="elu1", normalize=True)
    inp = make_inputs(case, "cpu")
    W = torch.randn(2, 9, 2, 3, dtype=torch.float64)
    grads = []
    for impl, in_place in ((ar, True), (ref, False)):
        q, k, v = (inp[n].detach().clone().requires_grad_() for n in "qkv")
        o, _ = getattr(impl, f"{op}_linear_attn")(q, k, v, **case.kwargs())
        if in_place:
            o.mul_(2)  # would fail the saved-tensor version check if o were saved
        else:
            o = o * 2
        (o * W).sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    for name, x, y in zip("qkv", *grads):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12, msg=lambda m: f"d{name}: {m}")
