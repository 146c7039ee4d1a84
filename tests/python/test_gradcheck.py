"""float64 gradcheck of the chunk and recurrent ops with every option: normalize, each feature
map, initial state (gradients to it) and final state (gradients from it), varlen, GQA."""
import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

from cases import Case, make_inputs

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
