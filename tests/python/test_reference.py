"""The pure-PyTorch reference agrees with itself: its three forms, varlen vs a loop, GQA vs
repeated heads, the step vs the recurrent form. float64 throughout, CPU only (no extension)."""
import pytest
import torch
import torch.nn.functional as F

from cases import Case, make_inputs, run

FORMS = ["parallel", "recurrent", "chunk"]

CASES = [
    Case(2, 37, 4, 8, Hkv=2, V=5, dtype=torch.float64),
    Case(1, 20, 2, 6, dtype=torch.float64, feature_map="relu", normalize=False,
         initial_state=True, final_state=True),
    Case(1, 19, 2, 4, Hkv=1, V=3, dtype=torch.float64, initial_state=True, final_state=True,
         seqlens=(0, 1, 7, 0, 11)),
    Case(2, 9, 1, 3, dtype=torch.float64, feature_map=None, normalize=False, final_state=True),
]


def _form(ref, name, **kw):
    fn = getattr(ref, f"{name}_linear_attn")
    if kw:
        return lambda *a, **k: fn(*a, **k, **kw)
    return fn


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_three_forms_agree_forward_and_backward(ref, case):
    inp = make_inputs(case, "cpu")
    base = run(ref.parallel_linear_attn, case, inp)
    for name, fn in [("recurrent", ref.recurrent_linear_attn),
                     ("chunk", _form(ref, "chunk", chunk_size=8))]:
        got = run(fn, case, inp)
        assert got.keys() == base.keys()
        for key in base:
            torch.testing.assert_close(got[key], base[key], msg=lambda m: f"{name} {key}: {m}")


@pytest.mark.parametrize("chunk_size", [1, 3, 64, 100])
def test_reference_chunk_sizes_agree(ref, chunk_size):
    case = Case(1, 70, 2, 8, dtype=torch.float64, initial_state=True, final_state=True)
    inp = make_inputs(case, "cpu")
    base = run(ref.parallel_linear_attn, case, inp)
    got = run(_form(ref, "chunk", chunk_size=chunk_size), case, inp)
    for key in base:
        torch.testing.assert_close(got[key], base[key])


def test_reference_varlen_equals_loop_over_sequences(ref):
    seqlens = (5, 0, 1, 9)
    case = Case(1, 15, 2, 4, dtype=torch.float64, initial_state=True, final_state=True,
                seqlens=seqlens)
    inp = make_inputs(case, "cpu")
    o, st = ref.chunk_linear_attn(inp["q"], inp["k"], inp["v"], initial_state=(inp["S0"], inp["z0"]),
                                  output_final_state=True, cu_seqlens=inp["cu_seqlens"],
                                  feature_map="elu1", chunk_size=4)
    start = 0
    for n, L in enumerate(seqlens):
        sl = slice(start, start + L)
        o_n, st_n = ref.parallel_linear_attn(
            inp["q"][:, sl], inp["k"][:, sl], inp["v"][:, sl], feature_map="elu1",
            initial_state=(inp["S0"][n:n + 1], inp["z0"][n:n + 1]), output_final_state=True)
        torch.testing.assert_close(o[:, sl], o_n)
        torch.testing.assert_close(st.S[n:n + 1], st_n.S)
        torch.testing.assert_close(st.z[n:n + 1], st_n.z)
        start += L
    # Empty sequence: state passes through unchanged.
    assert torch.equal(st.S[1], inp["S0"][1]) and torch.equal(st.z[1], inp["z0"][1])


def test_reference_gqa_equals_repeated_heads(ref):
    case = Case(2, 12, 6, 5, Hkv=2, V=3, dtype=torch.float64, final_state=True)
    inp = make_inputs(case, "cpu")
    q, k, v = inp["q"], inp["k"], inp["v"]
    o, st = ref.parallel_linear_attn(q, k, v, feature_map="elu1", output_final_state=True)
    o_r, st_r = ref.parallel_linear_attn(q, k.repeat_interleave(3, 2), v.repeat_interleave(3, 2),
                                         feature_map="elu1", output_final_state=True)
    torch.testing.assert_close(o, o_r)
    torch.testing.assert_close(st.S.repeat_interleave(3, 1), st_r.S)


def test_reference_feature_maps_match_their_definition(ref):
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    torch.testing.assert_close(ref.apply_feature_map(x, "elu1"), F.elu(x) + 1)
    torch.testing.assert_close(ref.apply_feature_map(x, "relu"), x.clamp_min(0))
    assert ref.apply_feature_map(x, None) is x and ref.apply_feature_map(x, "identity") is x
    with pytest.raises(ValueError, match="feature_map"):
        ref.apply_feature_map(x, "gelu")


def test_reference_matches_hand_written_formula(ref):
    """o_t = q'_t S_t / (q'_t . z_t + eps) with explicit sums, one head, no vectorization."""
    T, K, V, scale, eps = 6, 3, 2, 0.7, 1e-3
    q, k, v = (torch.randn(1, T, 1, d, dtype=torch.float64) for d in (K, K, V))
    o, _ = ref.parallel_linear_attn(q, k, v, scale=scale, eps=eps, feature_map="elu1")
    phi = lambda x: F.elu(x) + 1  # noqa: E731
    for t in range(T):
        qt = scale * phi(q[0, t, 0])
        num = sum((qt @ phi(k[0, s, 0])) * v[0, s, 0] for s in range(t + 1))
        den = sum(qt @ phi(k[0, s, 0]) for s in range(t + 1)) + eps
        torch.testing.assert_close(o[0, t, 0], num / den)


def test_reference_step_equals_recurrent(ref):
    case = Case(3, 6, 4, 5, Hkv=2, V=3, dtype=torch.float64, initial_state=True)
    inp = make_inputs(case, "cpu")
    o_rec, _ = ref.recurrent_linear_attn(inp["q"], inp["k"], inp["v"], feature_map="elu1",
                                         initial_state=(inp["S0"], inp["z0"]))
    # Pool of 5 rows; batch entries map to rows 4, 0, 2.
    rows = torch.tensor([4, 0, 2])
    S = torch.zeros(5, 2, 5, 3, dtype=torch.float64)
    z = torch.zeros(5, 2, 5, dtype=torch.float64)
    S[rows], z[rows] = inp["S0"], inp["z0"]
    for t in range(case.T):
        o = ref.linear_attn_step(inp["q"][:, t], inp["k"][:, t], inp["v"][:, t], (S, z),
                                 feature_map="elu1", state_indices=rows)
        torch.testing.assert_close(o, o_rec[:, t])
    assert torch.equal(S[1], torch.zeros_like(S[1])) and torch.equal(S[3], torch.zeros_like(S[3]))
    # Negative index: output zero, state untouched.
    before = S.clone()
    o = ref.linear_attn_step(inp["q"][:, 0], inp["k"][:, 0], inp["v"][:, 0], (S, z),
                             feature_map="elu1", state_indices=torch.tensor([-1, 0, 2]))
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.equal(S[4], before[4])
    assert not torch.equal(S[0], before[0])


@pytest.mark.parametrize("what", ["k-batch-1", "v-T-short", "k-head-dim", "int-inputs"])
def test_reference_refuses_mismatched_or_integer_inputs(ref, what):
    """The references are the test oracle: they must not broadcast a batch or compute in integers."""
    q, k, v = torch.randn(2, 5, 2, 4), torch.randn(2, 5, 1, 4), torch.randn(2, 5, 1, 3)
    if what == "k-batch-1":
        k = k[:1]
    elif what == "v-T-short":
        v = v[:, :4]
    elif what == "k-head-dim":
        k = torch.randn(2, 5, 1, 6)
    else:
        q, k, v = (torch.randint(-3, 3, t.shape) for t in (q, k, v))
    for form in ("parallel", "recurrent", "chunk"):
        with pytest.raises(ValueError, match="q, k, v|q and k"):
            getattr(ref, f"{form}_linear_attn")(q, k, v)


def test_reference_step_refuses_float_state_indices(ref):
    q, k, v = torch.randn(2, 2, 4), torch.randn(2, 1, 4), torch.randn(2, 1, 3)
    S, z = torch.zeros(3, 1, 4, 3), torch.ones(3, 1, 4)
    with pytest.raises(ValueError, match="state_indices"):
        ref.linear_attn_step(q, k, v, (S, z), state_indices=torch.tensor([0.0, 1.7]))
