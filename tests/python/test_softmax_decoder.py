"""attnrnn.softmax.NoCacheDecoder: decoding a stack of softmax-attention layers with no KV cache
(keys and values of every layer recomputed from the ids) equals KV-cached decoding and the full
forward (fp32, relative error <= 1e-5)."""
import pytest
import torch


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("n_layers", [1, 2, 3])
def test_nocache_equals_kv_cache_decoding(ar, n_layers):
    sm = ar.softmax
    torch.manual_seed(0)
    model = sm.TinyTransformer(vocab=50, dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, max_len=128).eval()
    ids = torch.randint(0, 50, (2, 60))
    with torch.no_grad():
        full = model(ids)
    kv = sm.KVCacheDecoder(model, batch=2, max_len=128)
    nc = sm.NoCacheDecoder(model, block_size=16)  # several blocks, the last one partial
    logits = kv.prefill(ids[:, :5])
    for t in range(5, 60):
        if t % 4 == 1 or t == 59:  # block boundaries of 16 fall in between; the last block is partial
            ours = nc.next_logits(ids[:, :t])
            assert _rel(ours, logits) <= 1e-5, t
            assert _rel(ours, full[:, t - 1]) <= 1e-5, t
        assert _rel(logits, full[:, t - 1]) <= 1e-5, t
        logits = kv.step(ids[:, t])


def test_nocache_generate_matches_kv_greedy(ar):
    sm = ar.softmax
    torch.manual_seed(1)
    model = sm.TinyTransformer(vocab=40, dim=32, n_layers=2, n_heads=2, max_len=64).eval()
    prompt = torch.randint(0, 40, (1, 7))
    out = sm.NoCacheDecoder(model, block_size=8).generate(prompt, 12)
    kv = sm.KVCacheDecoder(model, batch=1, max_len=64)
    ids, logits = prompt, kv.prefill(prompt)
    for _ in range(12):
        nxt = logits.argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], 1)
        logits = kv.step(nxt)
    assert torch.equal(out, ids)


def test_nocache_recomputes_superlinearly(ar):
    """The number of block evaluations grows like (T / block)^N: the price of keeping no cache."""
    sm = ar.softmax
    torch.manual_seed(2)
    model = sm.TinyTransformer(vocab=20, dim=16, n_layers=2, n_heads=2, max_len=512).eval()
    calls = []
    for T in (64, 128, 256):
        nc = sm.NoCacheDecoder(model, block_size=16)
        nc.next_logits(torch.randint(0, 20, (1, T)))
        calls.append(nc.calls)
    assert calls[1] / calls[0] > 2.5 and calls[2] / calls[1] > 3  # -> 4 (quadratic in T) for N = 2


@pytest.mark.parametrize("block_size,error", [(0, ValueError), (-4, ValueError), (2.5, TypeError)],
                         ids=["zero", "negative", "float"])
def test_nocache_rejects_a_bad_block_size(ar, block_size, error):
    model = ar.softmax.TinyTransformer(vocab=11, dim=16, n_layers=1, n_heads=2, n_kv_heads=1)
    with pytest.raises(error, match="block_size"):
        ar.softmax.NoCacheDecoder(model, block_size=block_size)


def test_tiny_transformer_rejects_heads_that_do_not_divide(ar):
    with pytest.raises(ValueError, match="n_heads"):
        ar.softmax.TinyTransformer(vocab=11, dim=16, n_layers=1, n_heads=3, n_kv_heads=1)


def test_kv_cache_decoder_follows_its_lengths_without_reading_them(ar, device):
    """The position of the next token comes from a host copy kept by prefill and step; a length
    written from outside is read again (here: rewinding one token and decoding it again)."""
    sm = ar.softmax
    torch.manual_seed(3)
    model = sm.TinyTransformer(vocab=30, dim=32, n_layers=2, n_heads=2, max_len=32).to(device).eval()
    ids = torch.randint(0, 30, (1, 9), device=device)
    with torch.no_grad():
        full = model(ids)
    kv = sm.KVCacheDecoder(model, batch=1, max_len=32)
    kv.prefill(ids[:, :4])
    for t in range(4, 8):
        logits = kv.step(ids[:, t])
    assert _rel(logits, full[:, 7]) <= 1e-5
    kv.lens -= 1  # rewind: token 7 again
    assert _rel(kv.step(ids[:, 7]), full[:, 7]) <= 1e-5
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = kv.step(ids[:, 8])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert _rel(logits, full[:, 8]) <= 1e-5
