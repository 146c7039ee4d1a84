"""A NaN or Inf in q, k or v at token t reaches only the results that depend on token t.

What depends on token t follows from the math (query u sees keys s <= u):

* o_u and dq_u depend on q_u and on k_s, v_s for s <= u: a value in q at t reaches row t only, a
  value in k or v at t rows >= t.
* dk_s and dv_s sum over the queries u >= s that see key s: a value in q at t reaches rows <= t.
  A value in k or v at t reaches row t only, except through the normalizer: the denominators
  q'_u . z_u (linear attention with normalize=True) and the softmax's lse_u depend on every key
  s <= u, and the gradient of every key s <= u goes through them, so there it reaches every row.
  o is linear in v, so dv never depends on v.

Every other row must be finite and equal to the row of the same call without the bad value, for
a bad value at the first, an inner and the last token of a chunk (linear forms, chunk_size 16) and
of the CPU softmax kernel's 64-token blocks. These inputs are fp32 with D = 16 (on CUDA the generic
kernels); the tensor-core kernels are checked at the end.
"""
import functools

import pytest
import torch

from conftest import HAS_CUDA
from numerics import R2_TOL, relative_rms

T, H, HKV, D, CHUNK = 160, 2, 1, 16, 16
POSITIONS = (64, 100, 127)  # first, inner and last token of a chunk of 16 and of a block of 64
VALUES = {"nan": float("nan"), "inf": float("inf")}


def reachable_rows(result, poisoned, t, normalized, length=T):
    """The rows of `result` ("o", "dq", "dk", "dv") that a bad value at token t of `poisoned`
    ("q", "k", "v") may reach in a sequence of `length` tokens; `normalized`: linear attention with
    normalize=True, or softmax."""
    if result in ("o", "dq"):
        return range(t, t + 1) if poisoned == "q" else range(t, length)
    if poisoned == "q":
        return range(0, t + 1)
    if result == "dv" and poisoned == "v":
        return range(0)
    return range(length) if normalized else range(t, t + 1)


def _free_rows(result, poisoned, t, normalized, length):
    free = torch.ones(length, dtype=torch.bool)
    free[list(reachable_rows(result, poisoned, t, normalized, length))] = False
    return free


def _inputs(device, length=T, heads=H, kv_heads=HKV, dim=D, dtype=torch.float32, seed=11):
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (1, length, heads, dim), "k": (1, length, kv_heads, dim), "v": (1, length, kv_heads, dim),
              "do": (1, length, heads, dim)}
    return {name: torch.randn(*shape, generator=g).to(device, dtype) for name, shape in shapes.items()}


def _results(fn, inp):
    leaves = [inp[n].clone().requires_grad_() for n in "qkv"]
    o = fn(*leaves)
    grads = torch.autograd.grad(o, leaves, inp["do"])
    return dict(zip(("o", "dq", "dk", "dv"), (o.detach(), *grads)))


def _check_causal(fn, device, poisoned, value, normalized):
    inp = _inputs(device)
    clean = _results(fn, inp)
    failures = []
    for t in POSITIONS:
        bad = dict(inp)
        bad[poisoned] = inp[poisoned].clone()
        bad[poisoned][0, t, 0, 0] = VALUES[value]
        got = _results(fn, bad)
        for name, x in got.items():
            free = _free_rows(name, poisoned, t, normalized, T)
            rows, want = x[0, free], clean[name][0, free]
            if not torch.isfinite(rows).all():
                nonfinite = free.nonzero().flatten()[~torch.isfinite(rows).flatten(1).all(1).cpu()].tolist()
                failures.append(f"{value} in {poisoned} at token {t}: {name} rows {nonfinite} are not finite")
            # the reference's index_add sums in an order of its atomics on CUDA: equal up to rounding
            elif not torch.allclose(rows, want, rtol=1e-5, atol=1e-6 * clean[name].abs().max().item()):
                failures.append(f"{value} in {poisoned} at token {t}: {name} rows it cannot reach changed")
    assert not failures, "\n".join(failures)


def _form_params(forms):
    params = []
    for form in forms:
        params.append(pytest.param(form, "cpu", id=f"{form}-cpu"))
        params.append(pytest.param(form, "cuda", id=f"{form}-cuda",
                                   marks=pytest.mark.requires_cuda))
    return params


def _linear_form(form, ar, ref, normalize):
    fns = {"chunk": functools.partial(ar.chunk_linear_attn, chunk_size=CHUNK),
           "recurrent": ar.recurrent_linear_attn,
           "reference_chunk": functools.partial(ref.chunk_linear_attn, chunk_size=CHUNK),
           "reference_recurrent": ref.recurrent_linear_attn}
    return lambda q, k, v: fns[form](q, k, v, feature_map="elu1", normalize=normalize)[0]


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "unnorm"])
@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("poisoned", ["q", "k", "v"])
@pytest.mark.parametrize("form,device", _form_params(["chunk", "recurrent", "reference_chunk",
                                                      "reference_recurrent"]))
def test_linear_attention_keeps_a_nonfinite_value_causal(ar, ref, form, device, poisoned, value, normalize):
    _check_causal(_linear_form(form, ar, ref, normalize), device, poisoned, value, normalize)


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("poisoned", ["q", "k", "v"])
@pytest.mark.parametrize("form,device", _form_params(["streaming"]))
def test_softmax_attention_keeps_a_nonfinite_value_causal(ar, form, device, poisoned, value):
    _check_causal(lambda q, k, v: ar.softmax.streaming_attn(q, k, v), device, poisoned, value, True)


# The tensor-core kernels with a NaN or Inf at the first, an inner and the last token of a
# block (POSITIONS): they multiply masked scores (0) by the whole block's rows, and write the
# results that came out not finite again with the generic kernels. Every row reachable_rows leaves
# free must be finite and match the call without the bad value up to bf16 rounding: the repaired
# rows come from the generic kernels, the clean call's from the tensor cores, each within R2's bf16
# tolerance of the exact result.
def _check_tensor_core_rows(fn, x, poisoned, t, value):
    length = x["q"].shape[1]
    clean = _results(fn, x)
    bad = dict(x)
    bad[poisoned] = x[poisoned].clone()
    bad[poisoned][0, t, 0, 0] = VALUES[value]
    got = _results(fn, bad)
    failures = []
    for name, out in got.items():
        free = _free_rows(name, poisoned, t, True, length)
        rows, want = out[0, free], clean[name][0, free]
        if not torch.isfinite(rows).all():
            failures.append(f"{name}: rows it cannot reach are not finite")
        elif relative_rms(rows, want) > 2 * R2_TOL[torch.bfloat16]:
            failures.append(f"{name}: rows it cannot reach changed by {relative_rms(rows, want):.2e} (relative RMS)")
    assert not failures, "\n".join(failures)


def _bad_value_params():
    return [pytest.param(poisoned, value, t, id=f"{value}-in-{poisoned}-at-{t}")
            for poisoned in "qkv" for value in VALUES for t in POSITIONS]


# Chunks of 64 (normalize=True), 256 tokens: K = V = 64 in bf16, 96 in bf16 (tiles padded to 128 on
# sm_90a) and 64 in fp32 (the mma.sync sweeps in 3xTF32).
@pytest.mark.requires_cuda
@pytest.mark.parametrize("dim,dtype", [(64, torch.bfloat16), (96, torch.bfloat16), (64, torch.float32)],
                         ids=["K64-bf16", "K96-bf16", "K64-fp32"])
@pytest.mark.parametrize("poisoned,value,t", _bad_value_params())
def test_cuda_tensor_core_chunk_kernels_keep_a_nonfinite_value_causal(ar, poisoned, value, t, dim, dtype):
    x = _inputs("cuda", length=256, heads=2, kv_heads=2, dim=dim, dtype=dtype, seed=0)
    _check_tensor_core_rows(lambda q, k, v: ar.chunk_linear_attn(q, k, v, feature_map="elu1")[0], x, poisoned, t,
                            value)


# D = Dv = 64 and 128, two query heads on one kv head, 200 tokens (blocks of 64 keys and of 128
# queries; 200 is no multiple of either).
@pytest.mark.requires_cuda
@pytest.mark.parametrize("dim", [64, 128], ids=["D64", "D128"])
@pytest.mark.parametrize("poisoned,value,t", _bad_value_params())
def test_cuda_tensor_core_streaming_softmax_keeps_a_nonfinite_value_causal(ar, poisoned, value, t, dim):
    x = _inputs("cuda", length=200, heads=2, kv_heads=1, dim=dim, dtype=torch.bfloat16, seed=0)
    _check_tensor_core_rows(lambda q, k, v: ar.softmax.streaming_attn(q, k, v), x, poisoned, t, value)
