"""attnrnn.nn layers and cache, and the attnrnn.lm model: prefill + decode = full forward, batched
serving through state_indices, state_dict round trip, clear errors that leave the cache untouched,
torch.compile(fullgraph=True)."""
import copy
import io

import pytest
import torch

import torch._dynamo

H, D = 32, 4  # hidden size, heads of the small layers below
TIGHT = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture
def nn(ar):
    import attnrnn.nn
    return attnrnn.nn


@pytest.fixture
def lm(ar):
    import attnrnn.lm
    return attnrnn.lm


def _linear(nn, fm, normalize, **kw):
    if fm == "hedgehog":
        fm = nn.HedgehogFeatureMap(H // D)
    return nn.LinearAttention(H, D, feature_map=fm, normalize=normalize, **kw)


def _model(lm, layer_types="hybrid", num_layers=2, hidden=H, feature_map="elu1", seed=0):
    torch.manual_seed(seed)
    cfg = lm.LMConfig(vocab_size=23, hidden_size=hidden, num_layers=num_layers, num_heads=D, num_kv_heads=2,
                      layer_types=layer_types, feature_map=feature_map)
    return lm.CausalLM(cfg)


def _snapshot(cache):
    tensors = [t.clone() for pool in cache.layers for t in pool.tensors()]
    return tensors + [t.clone() for t in cache.extras.values()]


def _assert_untouched(cache, snap):
    now = _snapshot(cache)
    assert len(now) == len(snap)
    for a, b in zip(now, snap):
        assert torch.equal(a, b)


def _stepwise(module, x, cache, idx, prefill):
    """Prefill x[:, :prefill] in one call, then one call per remaining token; outputs along dim 1."""
    with torch.no_grad():
        outs = [module(x[:, :prefill], cache, idx)]
        for t in range(prefill, x.shape[1]):
            outs.append(module(x[:, t:t + 1], cache, idx))
    return torch.cat(outs, dim=1)


# -- prefill + decode equals the full forward --------------------------------------------------------
LINEAR_CASES = [
    pytest.param("elu1", True, {}, id="elu1-normalized"),
    pytest.param("relu", False, {"output_norm": True}, id="relu-unnormalized-outnorm"),
    pytest.param("identity", False, {"num_kv_heads": 2}, id="identity-gqa"),
    pytest.param("hedgehog", True, {"qk_norm": True, "num_kv_heads": 2}, id="hedgehog-qknorm-gqa"),
]


@pytest.mark.parametrize("fm,normalize,kw", LINEAR_CASES)
def test_linear_layer_prefill_then_decode_equals_forward(nn, device, fm, normalize, kw):
    layer = _linear(nn, fm, normalize, **kw).to(device)
    x = torch.randn(3, 19, H, device=device)
    full = layer(x).detach()
    cache = layer.make_cache(4)
    idx = cache.allocate(3)
    torch.testing.assert_close(_stepwise(layer, x, cache, idx, prefill=11), full, **TIGHT)


def test_linear_layer_final_state_in_cache_equals_chunk_state(nn, ar, device):
    layer = nn.LinearAttention(H, D).to(device)
    x = torch.randn(2, 9, H, device=device)
    cache = layer.make_cache(3)
    idx = cache.allocate(2)
    with torch.no_grad():
        layer(x, cache, idx)
        q, k, v = layer._project(x)
        _, st = ar.chunk_linear_attn(q, k, v, feature_map="elu1", output_final_state=True)
    torch.testing.assert_close(cache.layers[0].S[:2], st.S, **TIGHT)
    torch.testing.assert_close(cache.layers[0].z[:2], st.z, **TIGHT)
    assert cache.layers[0].S.dtype == torch.float32 and cache.layers[0].S.shape == (3, D, H // D, H // D)


def test_softmax_layer_prefill_then_decode_equals_forward(nn, device):
    layer = nn.SoftmaxAttention(H, D, num_kv_heads=2).to(device)
    x = torch.randn(3, 19, H, device=device)
    full = layer(x).detach()
    cache = layer.make_cache(4, max_len=19)
    idx = cache.allocate(3)
    torch.testing.assert_close(_stepwise(layer, x, cache, idx, prefill=6), full, **TIGHT)
    assert cache.layers[0].lengths[:3].tolist() == [19, 19, 19]


def test_cached_prefill_is_differentiable(nn, device):
    layer = nn.LinearAttention(H, D).to(device)
    cache = layer.make_cache(1)
    idx = cache.allocate(1)
    x = torch.randn(1, 5, H, device=device, requires_grad=True)
    layer(x, cache, idx).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert not cache.layers[0].S.requires_grad


@pytest.mark.parametrize("layer_types", ["linear", "softmax", "hybrid"])
def test_lm_prefill_then_decode_equals_forward(lm, device, layer_types):
    model = _model(lm, layer_types).to(device)
    ids = torch.randint(0, 23, (2, 17), device=device)
    full = model(ids).detach()
    cache = model.make_cache(2, max_len=17)
    idx = cache.allocate(2)
    torch.testing.assert_close(_stepwise(model, ids, cache, idx, prefill=7), full, **TIGHT)


def test_lm_hedgehog_prefill_then_decode_equals_forward(lm, device):
    model = _model(lm, "linear", feature_map="hedgehog").to(device)
    ids = torch.randint(0, 23, (2, 12), device=device)
    full = model(ids).detach()
    cache = model.make_cache(2)
    torch.testing.assert_close(_stepwise(model, ids, cache, cache.allocate(2), prefill=5), full, **TIGHT)


def test_generate_greedy_follows_full_forward_argmax(lm, device):
    model = _model(lm, "hybrid").to(device)
    prompt = torch.randint(0, 23, (2, 6), device=device)
    out = model.generate(prompt, max_new_tokens=8)
    assert out.shape == (2, 14) and torch.equal(out[:, :6], prompt)
    with torch.no_grad():
        pred = model(out[:, :-1]).argmax(-1)
    assert torch.equal(pred[:, 5:], out[:, 6:])


def test_generate_top_k_1_equals_greedy(lm, device):
    model = _model(lm, "linear").to(device)
    prompt = torch.randint(0, 23, (3, 4), device=device)
    greedy = model.generate(prompt, max_new_tokens=5)
    sampled = model.generate(prompt, max_new_tokens=5, temperature=1.3, top_k=1)
    assert torch.equal(greedy, sampled)


def test_sample_top_k_stays_within_top_k(lm):
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]]).repeat(200, 1)
    tok = lm.CausalLM.sample(logits, temperature=2.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {1, 2}


@pytest.mark.parametrize("top_k,error", [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)],
                         ids=["zero", "negative", "float", "bool"])
def test_generate_rejects_bad_top_k(lm, top_k, error):
    model = _model(lm, "linear")
    with pytest.raises(error, match="top_k"):
        model.generate(torch.randint(0, 23, (1, 3)), max_new_tokens=2, temperature=1.0, top_k=top_k)


@pytest.mark.parametrize("temperature", [-0.5, float("nan")], ids=["negative", "nan"])
def test_generate_rejects_bad_temperature(lm, temperature):
    model = _model(lm, "linear")
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.randint(0, 23, (1, 3)), max_new_tokens=2, temperature=temperature)


@pytest.mark.parametrize("n,error", [(-3, ValueError), (2.5, TypeError), (True, TypeError)],
                         ids=["negative", "float", "bool"])
def test_generate_rejects_bad_max_new_tokens(lm, n, error):
    model = _model(lm, "linear")
    with pytest.raises(error, match="max_new_tokens"):
        model.generate(torch.randint(0, 23, (1, 3)), max_new_tokens=n)


@pytest.mark.parametrize("n,error", [(0, ValueError), (-1, ValueError), (2.5, TypeError)],
                         ids=["zero", "negative", "float"])
def test_make_cache_rejects_bad_num_slots(lm, n, error):
    with pytest.raises(error, match="num_slots"):
        _model(lm, "linear").make_cache(n)


@pytest.mark.parametrize("slots", [[1.7], "1", [True]], ids=["float", "str", "bool"])
def test_cache_free_rejects_slots_that_are_not_ints(lm, slots):
    cache = _model(lm, "linear").make_cache(3)
    cache.allocate(3)
    with pytest.raises(TypeError, match="slots"):
        cache.free(slots)
    assert cache.allocated_slots == [0, 1, 2], "nothing freed by a refused call"


def test_sample_rejects_top_k_zero(lm):
    with pytest.raises(ValueError, match="top_k"):
        lm.CausalLM.sample(torch.randn(2, 5), temperature=1.0, top_k=0)


# -- batched serving -------------------------------------------------------------------------------
def test_batched_serving_add_drop_reorder_equals_independent(lm, device):
    """Sequences join, leave and change batch order; each one's logits equal its own full forward."""
    model = _model(lm, "hybrid").to(device)
    g = torch.Generator().manual_seed(3)
    seqs = {n: torch.randint(0, 23, (1, 16), generator=g).to(device) for n in "ABCD"}
    with torch.no_grad():
        ref = {n: model(s)[0] for n, s in seqs.items()}
    cache = model.make_cache(3, max_len=16)
    slot, pos, got = {}, {}, {n: [] for n in seqs}

    def prefill(name, length):
        slot[name] = cache.allocate(1)
        with torch.no_grad():
            got[name].append(model(seqs[name][:, :length], cache, slot[name])[0])
        pos[name] = length

    def decode(names):
        idx = torch.cat([slot[n] for n in names])
        tok = torch.cat([seqs[n][:, pos[n]:pos[n] + 1] for n in names])
        with torch.no_grad():
            out = model(tok, cache, idx)
        for b, n in enumerate(names):
            got[n].append(out[b])
            pos[n] += 1

    prefill("A", 5)
    prefill("B", 8)
    decode(["A", "B"])
    decode(["B", "A"])                   # reordered
    prefill("C", 3)                      # joins
    decode(["C", "A", "B"])
    cache.free(slot.pop("A"))            # A leaves ...
    done_a, len_a = got.pop("A"), pos.pop("A")
    decode(["B", "C"])
    prefill("D", 4)                      # ... and D reuses A's slot, zeroed
    assert int(slot["D"]) == 0
    decode(["D", "B", "C"])
    decode(["C", "D"])
    torch.testing.assert_close(torch.cat(done_a), ref["A"][:len_a], **TIGHT)
    for n in "BCD":
        torch.testing.assert_close(torch.cat(got[n]), ref[n][:pos[n]], **TIGHT)


def test_decode_does_not_touch_other_slots(lm, device):
    model = _model(lm, "hybrid").to(device)
    cache = model.make_cache(4, max_len=8)
    idx = cache.allocate(4)
    with torch.no_grad():
        model(torch.randint(0, 23, (4, 5), device=device), cache, idx)
        others = [[t[[0, 2]].clone() for t in pool.tensors()] for pool in cache.layers]
        model(torch.randint(0, 23, (2, 1), device=device), cache, idx[[3, 1]])
    for pool, before in zip(cache.layers, others):
        for t, b in zip(pool.tensors(), before):
            assert torch.equal(t[[0, 2]], b)


def test_allocator_free_list(nn):
    layer = nn.LinearAttention(H, D)
    cache = layer.make_cache(3)
    a = cache.allocate(2)
    assert a.tolist() == [0, 1] and cache.num_free == 1
    cache.free(a[:1])
    assert cache.allocated_slots == [1] and cache.num_free == 2
    with torch.no_grad():
        layer(torch.randn(1, 4, H), cache, a[1:])
        layer(torch.randn(1, 4, H), cache, cache.allocate(1))  # slot 2
    cache.layers[0].S[0] = 7.0                                  # stale data in a free slot
    b = cache.allocate(1)
    assert b.tolist() == [0] and torch.count_nonzero(cache.layers[0].S[0]) == 0


# -- state_dict ------------------------------------------------------------------------------------
def test_lm_state_dict_roundtrip(lm):
    model = _model(lm, "hybrid", feature_map="hedgehog", seed=0)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    other = _model(lm, "hybrid", feature_map="hedgehog", seed=1)
    ids = torch.randint(0, 23, (2, 9))
    assert not torch.allclose(other(ids), model(ids))
    buf.seek(0)
    other.load_state_dict(torch.load(buf, weights_only=True))
    torch.testing.assert_close(other(ids), model(ids), atol=0, rtol=0)
    assert any("feature_map.proj.weight" in k for k in model.state_dict())


def test_layer_state_dict_roundtrip_with_norms(nn):
    torch.manual_seed(0)
    a = nn.LinearAttention(H, D, qk_norm=True, output_norm=True, feature_map=nn.HedgehogFeatureMap(H // D))
    for p in a.parameters():
        torch.nn.init.normal_(p, std=0.3)
    b = nn.LinearAttention(H, D, qk_norm=True, output_norm=True, feature_map=nn.HedgehogFeatureMap(H // D))
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 7, H)
    torch.testing.assert_close(b(x), a(x), atol=0, rtol=0)


# -- bad inputs: clear errors, cache untouched ----------------------------------------------------
def test_layer_rejects_wrong_hidden_size(nn):
    for layer in (nn.LinearAttention(H, D), nn.SoftmaxAttention(H, D)):
        with pytest.raises(ValueError, match=r"x must be \[B, T, hidden_size=32\]"):
            layer(torch.randn(2, 3, H + 1))


def test_layer_rejects_bad_constructor_args(nn):
    with pytest.raises(ValueError, match="num_kv_heads"):
        nn.LinearAttention(H, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="feature_map"):
        nn.LinearAttention(H, 4, feature_map="softmax")
    with pytest.raises(ValueError, match="max_len"):
        nn.SoftmaxAttention(H, 4).make_cache(2)


@pytest.mark.parametrize("layer", ["LinearAttention", "SoftmaxAttention"])
@pytest.mark.parametrize("arg,value,error", [("head_dim", -1, ValueError), ("head_dim", 8.5, TypeError),
                                             ("head_dim", 0, ValueError), ("value_dim", 0, ValueError)])
def test_layer_rejects_bad_head_dims(nn, layer, arg, value, error):
    with pytest.raises(error, match=arg):
        getattr(nn, layer)(H, 4, **{arg: value})


@pytest.mark.parametrize("scale,error", [(float("nan"), ValueError), (float("inf"), ValueError), ("0.5", TypeError)],
                         ids=["nan", "inf", "str"])
def test_softmax_layer_rejects_a_bad_scale(nn, scale, error):
    with pytest.raises(error, match="scale"):
        nn.SoftmaxAttention(H, 4, scale=scale)


def test_state_index_out_of_range_leaves_cache_untouched(lm):
    model = _model(lm, "hybrid")
    cache = model.make_cache(3, max_len=8)
    idx = cache.allocate(3)
    with torch.no_grad():
        model(torch.randint(0, 23, (3, 4)), cache, idx)
    snap = _snapshot(cache)
    for bad, msg in ((torch.tensor([0, 3]), r"state_indices has indices \[3\] out of range \[0, 3\)"),
                     (torch.tensor([1, -1]), r"state_indices has indices \[-1\] out of range"),
                     (torch.tensor([1, 1]), "state_indices must be distinct"),
                     (torch.tensor([0]), r"state_indices must be an int32/int64 tensor of shape \[2\]"),
                     (torch.tensor([0.0, 1.0]), "state_indices must be an int32/int64")):
        with pytest.raises(ValueError, match=msg), torch.no_grad():
            model(torch.randint(0, 23, (2, 1)), cache, bad)
        _assert_untouched(cache, snap)


def test_unallocated_slot_rejected(lm):
    model = _model(lm, "linear")
    cache = model.make_cache(3)
    cache.allocate(1)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match=r"state_indices addresses slots \[2\] that are not allocated"):
        model(torch.zeros(1, 1, dtype=torch.long), cache, torch.tensor([2]))
    _assert_untouched(cache, snap)


@pytest.mark.parametrize("other", [
    pytest.param(dict(num_layers=3), id="layer-count"),
    pytest.param(dict(hidden=48), id="head-shape"),
    pytest.param(dict(layer_types="linear"), id="layer-kinds"),
])
def test_cache_from_another_model_rejected(lm, other):
    model = _model(lm, "hybrid")
    kw = dict(layer_types="hybrid", num_layers=2, hidden=H)
    kw.update(other)
    stranger = _model(lm, **kw)
    cache = stranger.make_cache(2, max_len=8)
    idx = cache.allocate(2)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="cache was built for another model"):
        model(torch.zeros(2, 3, dtype=torch.long), cache, idx)
    _assert_untouched(cache, snap)


def test_cache_of_a_model_without_token_shift_is_rejected_naming_it(lm):
    model = _model(lm, "linear")
    cfg = lm.LMConfig(vocab_size=23, hidden_size=H, num_layers=2, num_heads=D, num_kv_heads=2, layer_types="linear",
                      token_shift=False)
    cache = lm.CausalLM(cfg).make_cache(2)
    with pytest.raises(ValueError, match="token_shift=False, this model's .* token_shift=True"):
        model(torch.zeros(2, 3, dtype=torch.long), cache, cache.allocate(2))


def test_layer_rejects_cache_of_other_layer(nn):
    lin, smx = nn.LinearAttention(H, D), nn.SoftmaxAttention(H, D)
    kv = smx.make_cache(2, max_len=8)
    idx = kv.allocate(1)
    snap = _snapshot(kv)
    with pytest.raises(ValueError, match=r"cache.layers\[0\] is a softmax KV cache .* needs a linear-attention state"):
        lin(torch.randn(1, 2, H), kv, idx)
    small = nn.LinearAttention(H, D, head_dim=4).make_cache(2)
    with pytest.raises(ValueError, match=r"cache.layers\[0\] is a linear-attention state S \[2, 4, 4, 4\]"):
        lin(torch.randn(1, 2, H), small, small.allocate(1))
    deep = nn.LinearAttention(H, D, layer_idx=1)
    with pytest.raises(ValueError, match="layer_idx=1"):
        deep(torch.randn(1, 2, H), lin.make_cache(2), torch.tensor([0]))
    _assert_untouched(kv, snap)


def test_softmax_layer_overflow_names_the_full_slots_untouched(nn):
    layer = nn.SoftmaxAttention(H, D)
    cache = layer.make_cache(3, max_len=5)
    idx = cache.allocate(3)
    with torch.no_grad():
        layer(torch.randn(3, 3, H), cache, idx)
        layer(torch.randn(1, 2, H), cache, idx[1:2])
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match=r"x: 1 more token\(s\) do not fit in the KV cache of layer 0 \(max_len=5\) "
                                         r"for slots \[1\]"):
        layer(torch.randn(3, 1, H), cache, idx)
    _assert_untouched(cache, snap)


def test_kv_cache_overflow_rejected_untouched(lm):
    model = _model(lm, "hybrid")
    cache = model.make_cache(1, max_len=6)
    idx = cache.allocate(1)
    with torch.no_grad():
        model(torch.zeros(1, 5, dtype=torch.long), cache, idx)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match=r"input_ids: 2 more token\(s\) do not fit in the KV cache of layer 1 "
                                         r"\(max_len=6\) for slots \[0\]"):
        model(torch.zeros(1, 2, dtype=torch.long), cache, idx)
    _assert_untouched(cache, snap)


def test_bad_input_ids_and_allocation(lm):
    model = _model(lm, "linear")
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=23\)"):
        model(torch.tensor([[1, 23]]))
    with pytest.raises(ValueError, match=r"input_ids must be an int tensor \[B, T\]"):
        model(torch.zeros(2, 3))
    cache = model.make_cache(2)
    with pytest.raises(ValueError, match=r"n=3 slots requested but only 2 of 2 are free"):
        cache.allocate(3)
    with pytest.raises(ValueError, match="max_len is required"):
        _model(lm, "hybrid").make_cache(2)


# -- torch.compile ---------------------------------------------------------------------------------
def test_compile_linear_layer_forward_backward_fullgraph(nn, device):
    torch._dynamo.reset()
    layer = _linear(nn, "hedgehog", True, qk_norm=True, output_norm=True, num_kv_heads=2).to(device)
    x = torch.randn(2, 13, H, device=device)

    def grads(fn):
        xx = x.clone().requires_grad_()
        y = fn(xx)
        y.square().sum().backward()
        out = [y.detach(), xx.grad] + [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
        return out

    eager = grads(layer)
    compiled = grads(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, **TIGHT)


def test_compile_decode_with_cache_fullgraph(nn, device):
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin, smx = nn.LinearAttention(H, D).to(device), nn.SoftmaxAttention(H, D, layer_idx=1).to(device)
    from attnrnn.nn import AttentionCache

    def make():
        c = AttentionCache([lin.make_state(3), smx.make_state(3, max_len=8)])
        return c, c.allocate(3)

    def step(x, cache, idx):
        return smx(lin(x, cache, idx), cache, idx)

    x = torch.randn(3, 4, H, device=device)
    ce, ie = make()
    cc, ic = make()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for t in range(4):
            torch.testing.assert_close(compiled(x[:, t:t + 1], cc, ic), step(x[:, t:t + 1], ce, ie), **TIGHT)
    for a, b in zip(_snapshot(cc), _snapshot(ce)):
        torch.testing.assert_close(a, b, **TIGHT)   # the in-place cache updates survive compilation


def test_compile_softmax_layer_forward_fullgraph(nn, device):
    torch._dynamo.reset()
    layer = nn.SoftmaxAttention(H, D, num_kv_heads=2, qk_norm=True).to(device)
    x = torch.randn(2, 9, H, device=device)
    torch.testing.assert_close(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), layer(x), **TIGHT)


# ---- decoding without device reads: the checked indices and the KV lengths on the host ---------

def test_checked_indices_are_not_read_again_until_they_change(lm):
    """check_indices reads a tensor's values once: the same int32 tensor again (or the int64 indices
    it returned) returns the same int64 indices; either written in place (here to an unallocated
    slot), or any tensor after a free, is checked again."""
    cache = _model(lm, "linear").make_cache(4)
    cache.allocate(3)
    given = torch.tensor([2, 0], dtype=torch.int32)
    first = cache.check_indices(given, 2)
    assert cache.check_indices(given, 2) is first and cache.check_indices(first, 2) is first
    assert cache._slots_of(first) == [2, 0]
    given[0] = 3
    with pytest.raises(ValueError, match=r"addresses slots \[3\] that are not allocated"):
        cache.check_indices(given, 2)
    given[0] = 1
    returned = cache.check_indices(given, 2)
    assert returned.tolist() == [1, 0]
    returned[1] = 3  # the int64 copy written: checked again as well
    with pytest.raises(ValueError, match=r"addresses slots \[3\] that are not allocated"):
        cache.check_indices(returned, 2)
    cache.free([1])
    with pytest.raises(ValueError, match=r"addresses slots \[1\] that are not allocated"):
        cache.check_indices(given, 2)


def test_indices_without_a_version_are_checked_every_time(lm):
    """Where writes cannot be seen (inference tensors carry no version counter), and for the arange
    of state_indices=None once written, every call reads the values again."""
    cache = _model(lm, "linear").make_cache(4)
    cache.allocate(2)
    with torch.inference_mode():
        given = torch.tensor([0, 1], dtype=torch.int32)
        returned = cache.check_indices(given, 2)
        returned[0] = 3
        with pytest.raises(ValueError, match=r"addresses slots \[3\] that are not allocated"):
            cache.check_indices(returned, 2)
    arange = cache.check_indices(None, 2)
    arange[0] = 3
    with pytest.raises(ValueError, match=r"addresses slots \[3\] that are not allocated"):
        cache.check_indices(arange, 2)


def test_kv_lengths_on_the_host_follow_every_write(lm):
    """The KV pools' host copy of lengths: kept by the layers' appends, reset by allocate, and read
    again from the device after any other write (the demo fills a cache by hand), in a copy of the
    cache, and when lengths is replaced."""
    model = _model(lm, "softmax")
    cache = model.make_cache(3, max_len=16)
    idx = cache.allocate(2)
    with torch.no_grad():
        model(torch.randint(0, 23, (2, 5)), cache, idx)
        model(torch.randint(0, 23, (2, 1)), cache, idx)
    for pool in cache.layers:
        assert pool.host_lengths() == pool.lengths.tolist() == [6, 6, 0]
    cache.free(idx[:1])
    assert sorted(cache.allocate(2).tolist()) == [0, 2]  # slot 0 again, and the one never used
    pool = cache.layers[0]
    assert pool.host_lengths() == pool.lengths.tolist() == [0, 6, 0]
    pool.lengths[2] = 9
    assert pool.host_lengths() == [0, 6, 9]
    twin = copy.deepcopy(cache).layers[0]  # a copy reads its own lengths
    twin.lengths[1] = 4
    assert twin.host_lengths() == [0, 4, 9] and pool.host_lengths() == [0, 6, 9]
    pool.lengths = torch.full((3,), 2)  # another tensor altogether
    assert pool.host_lengths() == [2, 2, 2]


@pytest.mark.requires_cuda(reason="syncs are a CUDA matter")
@pytest.mark.parametrize("layer_types", ["linear", "softmax", "hybrid"])
def test_decoding_steps_on_cuda_do_not_synchronize(lm, layer_types):
    """After the prefill, a hybrid model's decoding steps with the same state_indices read nothing
    back from the GPU (torch.cuda's sync debug mode raises on a synchronizing call), so the host can
    run ahead of the kernels, and they give the full forward's logits."""
    model = _model(lm, layer_types).to("cuda")
    ids = torch.randint(0, 23, (2, 9), device="cuda")
    cache = model.make_cache(2, max_len=9)
    idx = cache.allocate(2)
    steps = []
    with torch.no_grad():
        model(ids[:, :5], cache, idx)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in range(5, 9):
                steps.append(model(ids[:, t:t + 1], cache, idx, _ids_in_range=True))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        full = model(ids)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 5:], **TIGHT)


@pytest.mark.requires_cuda(reason="CUDA graphs")
def test_decoding_is_refused_inside_a_cuda_graph_capture(lm):
    """The cache's host-side bookkeeping would not follow a graph's replays: capturing a decoding
    step raises before anything is launched."""
    model = _model(lm, "softmax").to("cuda")
    cache = model.make_cache(1, max_len=4)
    idx = cache.allocate(1)
    ids = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        model(ids, cache, idx, _ids_in_range=True)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                model(ids, cache, idx, _ids_in_range=True)
