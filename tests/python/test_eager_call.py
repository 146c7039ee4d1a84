"""The public functions' eager call (attnrnn._C.chunk_fwd / step / softmax_attn_step,
csrc/torch/module.cpp) stands in for torch.ops.attnrnn.<op>.default: the same results, errors,
in-place version bumps and autograd, and it steps aside (NotImplemented, then torch.ops) for tensor
subclasses and __torch_function__ modes."""
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from cases import Case, make_inputs


def _chunk_args(inp, normalize, final_state=True, chunk=0, for_backward=False):
    return (inp["q"], inp["k"], inp["v"], None, None, None, 0.5, 1e-6, "elu1", normalize, final_state, chunk,
            for_backward)


@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
def test_chunk_fwd_eager_call_equals_torch_ops(ar, normalize, device):
    """B2-T37-H4-Hkv2-K8-V5-fp32: every result of the typed call bit for bit that of torch.ops."""
    from attnrnn import _C
    inp = make_inputs(Case(2, 37, 4, 8, torch.float32, V=5, Hkv=2, normalize=normalize), device)
    eager = _C.chunk_fwd(*_chunk_args(inp, normalize))
    boxed = torch.ops.attnrnn.chunk_fwd.default(*_chunk_args(inp, normalize))
    assert isinstance(eager, tuple) and len(eager) == len(boxed) == 4
    for got, want in zip(eager, boxed):
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)


def test_step_eager_call_updates_the_state_and_bumps_its_version(ar, device):
    """B3-H4-K8-V8: the typed step writes S and z as torch.ops' does, and autograd sees them written."""
    from attnrnn import _C
    q, k, v = (torch.randn(3, 4, 8, device=device) for _ in range(3))
    S, z = torch.zeros(3, 4, 8, 8, device=device), torch.zeros(3, 4, 8, device=device)
    S2, z2 = S.clone(), z.clone()
    versions = (S._version, z._version)
    o = _C.step(q, k, v, S, z, None, 0.5, 1e-6, "elu1", True)
    o2 = torch.ops.attnrnn.step.default(q, k, v, S2, z2, None, 0.5, 1e-6, "elu1", True)
    assert torch.equal(o, o2) and torch.equal(S, S2) and torch.equal(z, z2)
    assert S._version > versions[0] and z._version > versions[1]


@pytest.mark.parametrize("needs_grad", ["q", "S"])
def test_step_operator_refuses_to_record_a_gradient(ar, device, needs_grad):
    """The step's Autograd kernel: with grad mode on, a q or a state that requires grad is refused by
    the operator itself (through torch.ops and the typed call), and the state is left unwritten."""
    from attnrnn import _C
    q, k, v = (torch.randn(2, 2, 4, device=device) for _ in range(3))
    S = torch.zeros(2, 2, 4, 4, device=device)
    if needs_grad == "q":
        q.requires_grad_()
    else:
        S = S.clone().requires_grad_().clone()  # a non-leaf that requires grad (a leaf may not be written)
    for call in (torch.ops.attnrnn.step.default, _C.step):
        with pytest.raises(RuntimeError, match="not differentiable"):
            call(q, k, v, S, None, None, 0.5, 1e-6, "identity", False)
        assert not S.detach().any()
    with torch.no_grad():
        _C.step(q, k, v, S, None, None, 0.5, 1e-6, "identity", False)
    assert S.detach().any()


def test_softmax_step_eager_call_appends_to_the_caches_and_bumps_their_versions(ar, device):
    """B2-L6-H4-Hkv2-D8: the typed softmax step writes k_new, v_new at row cache_seqlens[b] of the
    caches and returns the output as torch.ops' does, and autograd sees both caches written."""
    from attnrnn import _C
    q = torch.randn(2, 4, 8, device=device)
    kc, vc = torch.randn(2, 6, 2, 8, device=device), torch.randn(2, 6, 2, 8, device=device)
    k_new, v_new = torch.randn(2, 2, 8, device=device), torch.randn(2, 2, 8, device=device)
    lens = torch.tensor([2, 5], dtype=torch.int32, device=device)
    kc2, vc2 = kc.clone(), vc.clone()
    versions = (kc._version, vc._version)
    o = _C.softmax_attn_step(q, kc, vc, lens, k_new, v_new, 0.5, 0)
    o2 = torch.ops.attnrnn.softmax_attn_step.default(q, kc2, vc2, lens, k_new, v_new, 0.5, 0)
    assert torch.equal(o, o2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(kc[0, 2], k_new[0]) and torch.equal(vc[1, 5], v_new[1])
    assert kc._version > versions[0] and vc._version > versions[1]


@pytest.mark.parametrize("needs_grad", ["q", "k_cache"])
def test_softmax_step_operator_refuses_to_record_a_gradient(ar, device, needs_grad):
    """The softmax step's Autograd kernel: with grad mode on, a q or a cache that requires grad is
    refused by the operator (through torch.ops and the typed call) before the cache is written."""
    from attnrnn import _C
    q = torch.randn(1, 2, 8, device=device)
    kc = torch.zeros(1, 4, 1, 8, device=device)
    if needs_grad == "q":
        q.requires_grad_()
    else:
        kc = kc.clone().requires_grad_().clone()  # a non-leaf that requires grad
    vc, k_new = torch.zeros(1, 4, 1, 8, device=device), torch.ones(1, 1, 8, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    for call in (torch.ops.attnrnn.softmax_attn_step.default, _C.softmax_attn_step):
        with pytest.raises(RuntimeError, match="not differentiable"):
            call(q, kc, vc, lens, k_new, k_new, 0.5, 0)
        assert not kc.detach().any() and not vc.any()


def test_eager_call_raises_the_operators_error(ar, device):
    """A 3-D q: the same ValueError, naming the argument, as through torch.ops."""
    from attnrnn import _C
    inp = make_inputs(Case(1, 5, 2, 4, torch.float32), device)
    inp["q"] = inp["q"][0]
    with pytest.raises(ValueError, match=r"q must be a 4-D tensor \[B, T, H, K\]"):
        _C.chunk_fwd(*_chunk_args(inp, True))
    with pytest.raises(ValueError, match=r"q must be a 4-D tensor \[B, T, H, K\]"):
        torch.ops.attnrnn.chunk_fwd.default(*_chunk_args(inp, True))


def test_eager_call_rejects_a_wrong_argument_count(ar):
    from attnrnn import _C
    with pytest.raises(TypeError, match="chunk_fwd takes 13 positional arguments"):
        _C.chunk_fwd(None)


class _Tagged(torch.Tensor):
    """A tensor subclass: the typed call must leave it to torch.ops."""


def test_eager_call_declines_tensor_subclasses_and_odd_arguments(ar, device):
    from attnrnn import _C
    inp = make_inputs(Case(1, 5, 2, 4, torch.float32), device)
    tagged = dict(inp, q=inp["q"].as_subclass(_Tagged))
    assert _C.chunk_fwd(*_chunk_args(tagged, True)) is NotImplemented
    kc = torch.zeros(1, 4, 2, 4, device=device)
    lens = torch.zeros(1, dtype=torch.int32, device=device)
    assert _C.softmax_attn_step(tagged["q"][:, 0], kc, kc, lens, None, None, 0.5, 0) is NotImplemented
    args = list(_chunk_args(inp, True))
    args[6] = torch.tensor(0.5)  # a tensor scale: torch.ops decides what that means
    assert _C.chunk_fwd(*args) is NotImplemented


def test_public_function_honours_torch_function_modes(ar, device):
    """Under a __torch_function__ mode the public function goes through torch.ops, which the mode sees."""
    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    inp = make_inputs(Case(1, 5, 2, 4, torch.float32), device)
    with Record():
        ar.chunk_linear_attn(inp["q"], inp["k"], inp["v"])
    assert any("attnrnn.chunk_fwd" in name for name in seen), seen


def test_public_function_with_a_subclass_matches_plain_tensors(ar, device):
    inp = make_inputs(Case(2, 9, 2, 4, torch.float32), device)
    o_plain, _ = ar.chunk_linear_attn(inp["q"], inp["k"], inp["v"])
    o_sub, _ = ar.chunk_linear_attn(inp["q"].as_subclass(_Tagged), inp["k"], inp["v"])
    assert torch.equal(o_plain, o_sub.as_subclass(torch.Tensor))


def test_gradients_flow_through_the_eager_call(ar, device):
    """B2-T17-H2-K4-fp64: the typed call reaches the Autograd kernel, so backward works as through torch.ops."""
    from attnrnn import _C
    inp = make_inputs(Case(2, 17, 2, 4, torch.float64), device)
    grads = []
    for call in (_C.chunk_fwd, torch.ops.attnrnn.chunk_fwd.default):
        q, k, v = (inp[n].detach().clone().requires_grad_() for n in "qkv")
        o = call(q, k, v, None, None, None, 0.5, 1e-6, "elu1", True, False, 0, False)[0]
        o.pow(2).sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    for got, want in zip(*grads):
        assert torch.equal(got, want)


def _torch_ops_python_calls(fn):
    """Names of the torch/_ops.py functions fn enters (OpOverload.__call__ is torch.ops' entry)."""
    entered = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.replace("\\", "/").endswith("torch/_ops.py"):
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return entered


def test_public_functions_take_the_eager_call(ar, device):
    """chunk_linear_attn and linear_attn_step reach their operator without torch.ops' Python entry
    (which the same check does see when torch.ops is called)."""
    inp = make_inputs(Case(1, 5, 2, 4, torch.float32), device)
    q, k, v = inp["q"], inp["k"], inp["v"]
    assert _torch_ops_python_calls(lambda: ar.chunk_linear_attn(q, k, v)) == []
    S = torch.zeros(1, 2, 4, 4, device=device)
    assert _torch_ops_python_calls(
        lambda: ar.linear_attn_step(q[:, 0], k[:, 0], v[:, 0], (S, None), normalize=False)) == []
    assert "__call__" in _torch_ops_python_calls(
        lambda: torch.ops.attnrnn.chunk_fwd.default(*_chunk_args(inp, True)))


def test_warning_turned_error_leaves_no_tensors_behind(ar, device):
    """Under vmap the operator warns (its batching fallback); with warnings as errors the typed
    call raises that warning, and the results it made are freed, not stranded."""
    import gc
    import warnings

    from attnrnn import _C
    q, k, v = (torch.randn(3, 1, 5, 2, 4, device=device) for _ in range(3))
    per_sample = lambda q, k, v: _C.chunk_fwd(q, k, v, None, None, None, 0.5, 1e-6, "identity", True, False, 0,
                                              False)[0]

    def live_tensors():
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    before = live_tensors()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(20):  # a leak would keep 4 tensors per call
            with pytest.raises(UserWarning):
                torch.vmap(per_sample)(q, k, v)
    assert live_tensors() <= before  # other tests' leftovers may be freed meanwhile, never more


def test_eager_call_declines_integers_past_int64(ar, device):
    """An int that does not fit the schema's int is torch.ops' error to raise, not the typed call's."""
    from attnrnn import _C
    inp = make_inputs(Case(1, 5, 2, 4, torch.float32), device)
    assert _C.chunk_fwd(*_chunk_args(inp, True, chunk=2**80)) is NotImplemented
