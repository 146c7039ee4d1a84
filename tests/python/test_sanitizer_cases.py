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
    # bf16, K = 64 and 128, V % 64 == 0: the tensor-core forward
    Case(2, 150, 4, 64, torch.bfloat16, Hkv=2, initial_state=True, final_state=True),
    Case(1, 200, 2, 128, torch.bfloat16, V=128, seqlens=(70, 0, 130), feature_map="relu", normalize=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_forward_backward_tour(ar, ref, device, op, case):
    inp = make_inputs(case, device)
    ours = run(getattr(ar, f"{op}_linear_attn"), case, inp)
    expected = run(ref.parallel_linear_attn, case, inp, dtype=torch.float64)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[case.dtype]
    for name in expected:
        assert relative_rms(ours[name].cpu(), expected[name].cpu()) <= tol, name


@pytest.mark.parametrize("V", [64, 30])
def test_step_tour(ar, ref, device, V):
    B, P, H, Hkv, K = 3, 5, 4, 2, 32
    q = torch.randn(B, H, K, device=device)
    k, v = torch.randn(B, Hkv, K, device=device), torch.randn(B, Hkv, V, device=device)
    S, z = torch.randn(P, Hkv, K, V, device=device), torch.rand(P, Hkv, K, device=device) + 1
    idx = torch.tensor([4, -1, 0], device=device, dtype=torch.int32)
    S_ref, z_ref = S.clone(), z.clone()
    o = ar.linear_attn_step(q, k, v, (S, z), state_indices=idx, feature_map="elu1")
    o_ref = ref.linear_attn_step(q, k, v, (S_ref, z_ref), state_indices=idx, feature_map="elu1")
    assert relative_rms(o, o_ref) <= 1e-5 and relative_rms(S, S_ref) <= 1e-6
