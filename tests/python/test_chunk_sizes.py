"""R5: every chunk size meets R1/R2; the chunk op's final state equals T recurrent steps."""
import pytest
import torch

from cases import Case, make_inputs, run
from numerics import assert_close_by_rules

CASE = Case(1, 300, 2, 64, torch.bfloat16, V=32, initial_state=True, final_state=True)


@pytest.fixture(scope="module")
def expected():
    """(float64 reference, bf16 baseline) per device, computed once."""
    import conftest
    cache = {}

    def get(device):
        if device not in cache:
            inp = make_inputs(CASE, device)
            cache[device] = (inp,
                             run(conftest.REF.parallel_linear_attn, CASE, inp, dtype=torch.float64),
                             run(conftest.REF.parallel_linear_attn, CASE, inp, dtype=CASE.dtype))
        return cache[device]
    return get


@pytest.mark.parametrize("chunk_size", [1, 16, 64, 100, 256])
def test_chunk_size_meets_rules(ar, expected, device, chunk_size):
    inp, ref64, base = expected(device)
    ours = run(ar.chunk_linear_attn, CASE, inp, chunk_size=chunk_size)
    for name in ref64:
        kind = "fwd" if name in ("o", "S", "z") else "bwd"
        t_dim = 1 if name in ("o", "dq", "dk", "dv") else None
        assert_close_by_rules(ours[name], base[name], ref64[name], kind=kind, dtype=CASE.dtype,
                              name=f"{name}@C={chunk_size}", t_dim=t_dim)


@pytest.mark.parametrize("chunk_size", [16, 64, 100])
def test_chunk_final_state_equals_recurrent_steps(ar, device, chunk_size):
    B, T, H, K, V = 2, 130, 2, 32, 16
    q = torch.randn(B, T, H, K, device=device)
    k = torch.randn(B, T, H, K, device=device)
    v = torch.randn(B, T, H, V, device=device)
    S0 = torch.randn(B, H, K, V, device=device)
    z0 = torch.rand(B, H, K, device=device) + 1
    o, st = ar.chunk_linear_attn(q, k, v, feature_map="elu1", initial_state=(S0, z0),
                                 output_final_state=True, chunk_size=chunk_size)
    S, z = S0.clone(), z0.clone()
    steps = [ar.linear_attn_step(q[:, t], k[:, t], v[:, t], (S, z), feature_map="elu1")
             for t in range(T)]
    torch.testing.assert_close(st.S, S)
    torch.testing.assert_close(st.z, z)
    torch.testing.assert_close(o, torch.stack(steps, 1))
