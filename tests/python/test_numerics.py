"""R1-R3: every output and gradient of the chunk and recurrent ops against the float64 parallel
reference, judged relative to PyTorch in the test dtype (numerics.py), over the shape sweep of
design.md §4: odd head dims, T around the chunk size, GQA/MQA, varlen with 1-token and empty
sequences, strided inputs and upstream gradients, fp32/fp16/bf16, initial and final states."""
import pytest
import torch

from cases import Case, make_inputs, run
from numerics import assert_close_by_rules, baseline_forms

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32

SWEEP = [
    Case(2, 1, 2, 16, fp32, initial_state=True, final_state=True),  # T=1: o depends on q via h0
    Case(2, 2, 4, 60, bf16, Hkv=2, V=64),
    Case(1, 63, 2, 64, fp16, initial_state=True, final_state=True),
    Case(2, 65, 2, 100, fp32, V=60, feature_map="relu", normalize=False),
    Case(1, 129, 2, 72, fp32, Hkv=1, V=104, initial_state=True, final_state=True),
    Case(1, 65, 1, 256, fp32, feature_map=None, normalize=False, initial_state=True, final_state=True),
    Case(1, 130, 2, 128, bf16, V=256, feature_map="relu", initial_state=True),
    Case(1, 130, 2, 176, bf16, V=160, initial_state=True, final_state=True),
    Case(1, 1000, 4, 64, bf16, Hkv=1),
    Case(1, 1000, 2, 16, fp16, feature_map=None, normalize=False, final_state=True),
    Case(1, 4224, 1, 128, bf16, initial_state=True, final_state=True),
    Case(1, 200, 4, 64, bf16, Hkv=2, initial_state=True, final_state=True,
         seqlens=(1, 0, 63, 0, 71, 65)),
    Case(2, 65, 4, 32, fp32, Hkv=2, noncontig=True, initial_state=True, final_state=True),
    Case(1, 63, 2, 16, fp16, feature_map="relu", normalize=False, noncontig=True),
    # varlen without the normalizer (the tensor-core sweeps compiled without it on CUDA)
    Case(1, 300, 4, 128, bf16, Hkv=2, feature_map="relu", normalize=False, initial_state=True, final_state=True,
         seqlens=(0, 1, 130, 64, 105)),
    Case(1, 190, 2, 64, fp16, feature_map=None, normalize=False, final_state=True, seqlens=(65, 0, 125)),
]
OPS = ["chunk", "recurrent"]


def _api(ar, op):
    return getattr(ar, f"{op}_linear_attn")


def check_all(ours, bases, ref, dtype, r2_tol=None):
    for base in bases:
        assert ours.keys() == ref.keys() == base.keys()
    for name in ref:
        kind = "fwd" if name in ("o", "S", "z") else "bwd"
        t_dim = 1 if name in ("o", "dq", "dk", "dv") else None
        assert_close_by_rules(ours[name], [b[name] for b in bases], ref[name], kind=kind, dtype=dtype,
                              name=name, t_dim=t_dim, r2_tol=r2_tol)


def baselines_and_reference(ref, case, inp):
    """The same PyTorch math in the case dtype (each baseline form) and the float64 reference."""
    base = [run(f, case, inp, dtype=case.dtype) for f in baseline_forms(ref, case.dtype)]
    return base, run(ref.parallel_linear_attn, case, inp, dtype=torch.float64)


def compute_all(ar, ref, op, case, device, **extra):
    inp = make_inputs(case, device)
    ours = run(_api(ar, op), case, inp, **extra)
    base, ref64 = baselines_and_reference(ref, case, inp)
    return ours, base, ref64


@pytest.mark.parametrize("case", SWEEP, ids=lambda c: c.id)
@pytest.mark.parametrize("op", OPS)
def test_forward_and_backward_meet_rules(ar, ref, op, case, device):
    ours, base, ref64 = compute_all(ar, ref, op, case, device)
    # The state is fp32 whatever the input dtype; o has q's dtype.
    assert ours["o"].dtype == case.dtype
    for name in ("S", "z", "dS0", "dz0"):
        if name in ours:
            assert ours[name].dtype == torch.float32, name
    check_all(ours, base, ref64, case.dtype)


@pytest.mark.parametrize("op", OPS)
def test_backward_with_expanded_upstream_gradient(ar, ref, op, device):
    """loss = o.sum() hands the backward a gradient with all strides 0."""
    case = Case(2, 70, 2, 32, bf16, Hkv=1)
    inp = make_inputs(case, device)
    inp["do"] = torch.ones((), dtype=case.dtype, device=device).expand(2, 70, 2, 32)
    ours = run(_api(ar, op), case, inp)
    base, ref64 = baselines_and_reference(ref, case, inp)
    check_all(ours, base, ref64, case.dtype)


@pytest.mark.parametrize("op", OPS)
def test_fp64_inputs_match_reference_to_fp64_precision(ar, ref, op, device):
    """With float64 inputs the ops compute in float64 (state too): the three forms are one."""
    case = Case(2, 45, 4, 12, torch.float64, Hkv=2, V=7, initial_state=True, final_state=True)
    inp = make_inputs(case, device)
    ours = run(_api(ar, op), case, inp)
    ref64 = run(ref.parallel_linear_attn, case, inp)
    for name in ref64:
        assert ours[name].dtype == torch.float64, name
        torch.testing.assert_close(ours[name], ref64[name], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
@pytest.mark.parametrize("dtype", [bf16, fp16], ids=["bf16", "fp16"])
def test_elu1_gradients_at_its_kink_and_in_its_tail(ar, ref, device, dtype, normalize):
    """elu1's phi' where x + 1 and exp(x) both round to 1 (|x| ~ 1e-3) and where exp(x) is tiny or
    below fp16's range (x down to ~ -100): the CUDA wgmma sweeps take it from phi(x) as the feature
    pass stored it, min(phi, 1), instead of computing exp(x) again (B1-T300-H4-Hkv2-K128, GQA, a
    ragged last chunk)."""
    case = Case(1, 300, 4, 128, dtype, Hkv=2, normalize=normalize)
    inp = make_inputs(case, device)
    gen = torch.Generator().manual_seed(1)
    for name in ("q", "k"):
        x = inp[name].double().cpu()
        kind = torch.randint(0, 3, x.shape, generator=gen)
        x = torch.where(kind == 0, x * 1e-3, torch.where(kind == 1, -30 * x.abs(), x))
        inp[name] = x.to(device=device, dtype=case.dtype)
    ours = run(_api(ar, "chunk"), case, inp)
    base, ref64 = baselines_and_reference(ref, case, inp)
    check_all(ours, base, ref64, case.dtype)


def _poison_allocator(device, numels):
    """Fill freed memory blocks of the sizes the op will allocate with NaN.

    On CUDA the caching allocator hands those blocks back to the next allocations of the same
    size; on CPU glibc malloc usually does (best effort)."""
    held = []
    for n in numels:
        for _ in range(4):
            held.append(torch.full((max(n, 1),), float("nan"), device=device))
    del held
    if device == "cuda":
        probe = torch.empty(max(numels), device=device)
        assert torch.isnan(probe).any(), "poisoning precondition: freed NaN block was not reused"
        del probe


@pytest.mark.parametrize("op", OPS)
def test_outputs_are_fully_written_over_poisoned_memory(ar, ref, op, device):
    """R3: outputs and gradients are finite and exact even when the allocator hands out
    NaN-filled memory: T not a multiple of the chunk, empty sequences (final state = initial),
    GQA, state gradients."""
    case = Case(1, 77, 4, 16, torch.float64, Hkv=2, V=24, initial_state=True, final_state=True,
                seqlens=(0, 30, 1, 0, 46))
    inp = make_inputs(case, device)
    ref64 = run(ref.parallel_linear_attn, case, inp)
    _poison_allocator(device, [t.numel() for t in ref64.values()])
    ours = run(_api(ar, op), case, inp)
    for name in ref64:
        assert torch.isfinite(ours[name]).all(), f"{name}: non-finite values (unwritten memory?)"
        torch.testing.assert_close(ours[name], ref64[name], msg=lambda m: f"{name}: {m}")
    # Empty sequences 0 and 3 pass their initial state through unchanged.
    for n in (0, 3):
        assert torch.equal(ours["S"][n], inp["S0"][n]) and torch.equal(ours["z"][n], inp["z0"][n])
