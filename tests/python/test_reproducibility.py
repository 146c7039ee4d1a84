"""R4: forward and backward are bitwise reproducible run to run."""
import pytest
import torch

from cases import Case, make_inputs, run


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_forward_backward_bitwise_reproducible(ar, op, device):
    case = Case(2, 300, 4, 64, torch.bfloat16, Hkv=2, initial_state=True, final_state=True)
    inp = make_inputs(case, device)
    fn = getattr(ar, f"{op}_linear_attn")
    first = run(fn, case, inp)
    for _ in range(2):
        again = run(fn, case, inp)
        for name in first:
            assert torch.equal(first[name], again[name]), f"{name} differs between runs"


def test_varlen_bitwise_reproducible(ar, device):
    case = Case(1, 257, 2, 32, torch.float32, seqlens=(100, 0, 1, 156), initial_state=True,
                final_state=True)
    inp = make_inputs(case, device)
    a = run(ar.chunk_linear_attn, case, inp)
    b = run(ar.chunk_linear_attn, case, inp)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_step_bitwise_reproducible(ar, device):
    q = torch.randn(8, 4, 64, device=device)
    k = torch.randn(8, 2, 64, device=device)
    v = torch.randn(8, 2, 64, device=device)
    S0 = torch.randn(8, 2, 64, 64, device=device)
    z0 = torch.rand(8, 2, 64, device=device) + 1
    outs = []
    for _ in range(2):
        S, z = S0.clone(), z0.clone()
        o = ar.linear_attn_step(q, k, v, (S, z), feature_map="elu1")
        outs.append((o, S, z))
    for x, y in zip(*outs):
        assert torch.equal(x, y)


THREAD_CASES = [
    Case(2, 300, 4, 64, torch.float32, Hkv=2, initial_state=True, final_state=True),
    # few (sequence, head) items: the CPU cuts the sequence into segments to use the threads
    Case(1, 4096, 1, 32, torch.float32, initial_state=True, final_state=True),
]


@pytest.mark.parametrize("case", THREAD_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_bitwise_identical_across_thread_counts(ar, op, case):
    """The CPU result must not depend on torch.set_num_threads (1 vs 2 threads)."""
    inp = make_inputs(case, "cpu")
    fn = getattr(ar, f"{op}_linear_attn")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(fn, case, inp)
        torch.set_num_threads(2)
        two = run(fn, case, inp)
    finally:
        torch.set_num_threads(before)
    for name in one:
        assert torch.equal(one[name], two[name]), f"{name} differs between 1 and 2 threads"
