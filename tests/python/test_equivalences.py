"""Structural equivalences of the ops: varlen == a loop over sequences, GQA == repeated heads,
a callable feature map == the fused one, scale/eps honoured, float64 ops == float64 reference."""
import pytest
import torch
import torch.nn.functional as F

from cases import Case, make_inputs, run

OPS = ["chunk", "recurrent"]


def _api(ar, op):
    return getattr(ar, f"{op}_linear_attn")


@pytest.mark.parametrize("op", OPS)
def test_varlen_equals_loop_over_sequences(ar, op, device):
    seqlens = (1, 0, 70, 0, 1, 33)
    case = Case(1, sum(seqlens), 4, 16, torch.float64, Hkv=2, V=8, initial_state=True,
                final_state=True, seqlens=seqlens)
    inp = make_inputs(case, device)
    packed = run(_api(ar, op), case, inp)
    start = 0
    for n, L in enumerate(seqlens):
        one = Case(1, L, 4, 16, torch.float64, Hkv=2, V=8, initial_state=True, final_state=True)
        sl = slice(start, start + L)
        sub = {"q": inp["q"][:, sl], "k": inp["k"][:, sl], "v": inp["v"][:, sl],
               "S0": inp["S0"][n:n + 1], "z0": inp["z0"][n:n + 1], "do": inp["do"][:, sl],
               "dS": inp["dS"][n:n + 1], "dz": inp["dz"][n:n + 1]}
        alone = run(_api(ar, op), one, sub)
        for name, got in [("o", packed["o"][:, sl]), ("dq", packed["dq"][:, sl]),
                          ("dk", packed["dk"][:, sl]), ("dv", packed["dv"][:, sl]),
                          ("S", packed["S"][n:n + 1]), ("z", packed["z"][n:n + 1]),
                          ("dS0", packed["dS0"][n:n + 1]), ("dz0", packed["dz0"][n:n + 1])]:
            torch.testing.assert_close(got, alone[name], msg=lambda m: f"seq {n} {name}: {m}")
        start += L


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("Hkv", [1, 2])
def test_gqa_equals_repeated_heads(ar, op, device, Hkv):
    H, G = 4, 4 // Hkv
    case = Case(2, 50, H, 16, torch.float64, Hkv=Hkv, V=12, final_state=True)
    inp = make_inputs(case, device)
    gqa = run(_api(ar, op), case, inp)
    rep_case = case.replace(Hkv=H)
    rep_inp = dict(inp, k=inp["k"].repeat_interleave(G, 2), v=inp["v"].repeat_interleave(G, 2),
                   dS=inp["dS"].repeat_interleave(G, 1) / G, dz=inp["dz"].repeat_interleave(G, 1) / G)
    rep = run(_api(ar, op), rep_case, rep_inp)
    torch.testing.assert_close(gqa["o"], rep["o"])
    torch.testing.assert_close(gqa["dq"], rep["dq"])
    # Every query head of a group sees the same state; kv gradients are the group sums.
    torch.testing.assert_close(gqa["S"].repeat_interleave(G, 1), rep["S"])
    torch.testing.assert_close(gqa["z"].repeat_interleave(G, 1), rep["z"])
    torch.testing.assert_close(gqa["dk"], rep["dk"].unflatten(2, (Hkv, G)).sum(3))
    torch.testing.assert_close(gqa["dv"], rep["dv"].unflatten(2, (Hkv, G)).sum(3))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ["elu1", "relu"])
def test_callable_feature_map_equals_fused_one(ar, op, device, name):
    fns = {"elu1": lambda x: F.elu(x) + 1, "relu": F.relu}
    case = Case(2, 40, 2, 16, torch.float64, feature_map=name, initial_state=True, final_state=True)
    inp = make_inputs(case, device)
    fused = run(_api(ar, op), case, inp)
    call = run(lambda *a, feature_map=None, **kw: _api(ar, op)(*a, feature_map=fns[name], **kw),
               case, inp)
    for key in fused:
        torch.testing.assert_close(call[key], fused[key], msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("op", OPS)
def test_scale_and_eps_are_honoured(ar, ref, op, device):
    case = Case(1, 30, 2, 8, torch.float64, feature_map="relu")
    inp = make_inputs(case, device)
    for scale, eps in [(0.25, 1e-6), (1.0, 0.5), (3.0, 1e-2)]:
        ours = run(_api(ar, op), case, inp, scale=scale, eps=eps)
        want = run(ref.parallel_linear_attn, case, inp, scale=scale, eps=eps)
        for key in want:
            torch.testing.assert_close(ours[key], want[key], msg=lambda m: f"{scale} {eps} {key}: {m}")


@pytest.mark.parametrize("feature_map", [None, "elu1", "relu"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "unnorm"])
def test_chunk_and_recurrent_ops_agree_with_parallel_reference_fp64(ar, ref, device, feature_map,
                                                                   normalize):
    """The three forms (parallel reference, chunk op, recurrent op) are one function."""
    case = Case(2, 67, 2, 20, torch.float64, V=10, feature_map=feature_map, normalize=normalize,
                initial_state=True, final_state=True)
    inp = make_inputs(case, device, positive=feature_map is None)
    want = run(ref.parallel_linear_attn, case, inp)
    for op in OPS:
        got = run(_api(ar, op), case, inp)
        for key in want:
            torch.testing.assert_close(got[key], want[key], msg=lambda m: f"{op} {key}: {m}")
