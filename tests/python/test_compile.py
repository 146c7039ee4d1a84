"""torch.compile(fullgraph=True) of the public functions: no graph break, same results as eager."""
import pytest
import torch

import torch._dynamo


def _inputs(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(5)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = mk(2, 33, 4, 16), mk(2, 33, 2, 16), mk(2, 33, 2, 8)
    S0, z0 = mk(2, 2, 16, 8).float(), mk(2, 2, 16).float().abs() + 1
    return q, k, v, S0, z0


def _train_step(ar):
    def f(q, k, v, S0, z0):
        o, st = ar.chunk_linear_attn(q, k, v, feature_map="elu1", initial_state=(S0, z0),
                                     output_final_state=True)
        return o.square().sum() + st.S.sum() + st.z.square().sum(), o, st.S
    return f


def _grads(f, q, k, v, S0, z0):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, S0, z0)]
    loss, o, S = f(*leaves)
    loss.backward()
    return [o.detach(), S.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_forward_backward_fullgraph(ar, device, backend):
    torch._dynamo.reset()
    f = _train_step(ar)
    eager = _grads(f, *_inputs(device))
    compiled = _grads(torch.compile(f, fullgraph=True, backend=backend), *_inputs(device))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)


def test_compile_decode_step_fullgraph(ar, device):
    torch._dynamo.reset()

    def decode(q, k, v, S, z, idx):
        o = ar.linear_attn_step(q, k, v, (S, z), feature_map="elu1", state_indices=idx)
        return o * 2

    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, h, 16, generator=g).to(device) for h in (4, 2, 2))
    S, z = torch.randn(5, 2, 16, 16).to(device), torch.rand(5, 2, 16).to(device) + 1
    idx = torch.tensor([4, -1, 1], device=device)
    S_e, z_e = S.clone(), z.clone()
    o_e = decode(q, k, v, S_e, z_e, idx)
    S_c, z_c = S.clone(), z.clone()
    o_c = torch.compile(decode, fullgraph=True, backend="aot_eager")(q, k, v, S_c, z_c, idx)
    torch.testing.assert_close(o_c, o_e)
    torch.testing.assert_close(S_c, S_e)  # the in-place update survives compilation
    torch.testing.assert_close(z_c, z_e)
    assert not torch.equal(S_c, S)


def test_compile_counts_one_graph(ar, device):
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    f = _train_step(ar)
    torch.compile(f, backend=cnt)(*_inputs(device))
    assert cnt.frame_count == 1 and cnt.op_count > 0
    assert len(torch._dynamo.utils.counters["graph_break"]) == 0, dict(torch._dynamo.utils.counters["graph_break"])
