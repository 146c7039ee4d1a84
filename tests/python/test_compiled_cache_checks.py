"""A CausalLM compiled with torch.compile(fullgraph=True) and the inductor backend checks a decoding
call's cache arguments and token ids inside the graph, and a bad call changes nothing in the cache
(states, KV caches, lengths, last tokens, allocator):

* on the CPU it raises the eager call's ValueError;
* on CUDA it raises nothing (that would need a device sync on every call): its logits are all NaN,
  and the cache goes on as if the call had not been made.

One compiled model per device serves every case (one graph: a hybrid model, batch 2, one token),
each case on a cache of its own.
"""
import copy

import pytest
import torch
import torch._dynamo

from attnrnn.lm import CausalLM, LMConfig
from conftest import HAS_CUDA

VOCAB, MAX_LEN, SLOTS = 11, 8, 3
TOKENS = torch.tensor([[1], [2]])


@pytest.fixture(scope="module")
def models():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2,
                              layer_types="hybrid")).eval()
    return model, torch.compile(model, fullgraph=True, backend="inductor", dynamic=False)


@pytest.fixture(scope="module")
def cuda_models(models):
    model = copy.deepcopy(models[0]).cuda()
    return model, torch.compile(model, fullgraph=True, backend="inductor", dynamic=False)


def _snapshot(cache):
    tensors = [t.clone() for pool in cache.layers for t in pool.tensors()]
    allocator = [cache._allocated.clone()]
    if cache._allocated_on_device is not None:
        allocator.append(cache._allocated_on_device.clone())
    return tensors + [t.clone() for t in cache.extras.values()] + allocator, list(cache._free)


def _assert_untouched(cache, snap, name):
    tensors, free = _snapshot(cache)
    assert all(torch.equal(a, b) for a, b in zip(tensors, snap[0])), f"{name}: the cache changed"
    assert free == snap[1], f"{name}: the allocator changed"


def _cache_with(model, allocated, steps=0):
    cache = model.make_cache(SLOTS, max_len=MAX_LEN)
    idx = cache.allocate(allocated)
    with torch.no_grad():
        for _ in range(steps):
            model(TOKENS.to(cache.device), cache, idx[:2])
    return cache


# (id, slots allocated, decoding steps before the bad call, its tokens, its state_indices, message)
CASES = [
    ("duplicate-slots", 3, 0, TOKENS, [1, 1], r"state_indices must be distinct, got \[1, 1\]"),
    ("unallocated-slot", 1, 0, TOKENS, [0, 2], r"state_indices addresses slots \[2\] that are not allocated"),
    ("slot-out-of-range", 3, 0, TOKENS, [0, 3], r"state_indices has indices \[3\] out of range \[0, 3\)"),
    ("token-out-of-vocab", 2, 0, torch.tensor([[1], [VOCAB]]), [0, 1],
     r"input_ids must lie in \[0, vocab_size=11\), got values in \[1, 11\]"),
    ("decode-past-max_len", 2, MAX_LEN, TOKENS, [0, 1],
     r"input_ids: 1 more token\(s\) do not fit in the KV cache of layer 1 \(max_len=8\) for slots \[0, 1\]"),
]
PARAMS = [pytest.param(*c[1:], id=c[0]) for c in CASES]
CUDA = pytest.mark.requires_cuda


@pytest.mark.parametrize("allocated,steps,tokens,slots,message", PARAMS)
def test_compiled_decoding_step_rejects_a_bad_call_and_leaves_the_cache_untouched(
        models, allocated, steps, tokens, slots, message):
    model, compiled = models
    for name, fn in (("eager", model), ("compiled", compiled)):
        cache = _cache_with(model, allocated, steps)
        snap = _snapshot(cache)
        with torch.no_grad(), pytest.raises(ValueError, match=message):
            fn(tokens, cache, torch.tensor(slots))
        _assert_untouched(cache, snap, name)


def test_compiled_decoding_steps_match_the_eager_ones(models):
    model, compiled = models
    caches = [_cache_with(model, 2), _cache_with(model, 2)]
    idx = torch.tensor([0, 1])
    with torch.no_grad():
        for _ in range(MAX_LEN):
            torch.testing.assert_close(compiled(TOKENS, caches[1], idx), model(TOKENS, caches[0], idx))
    for a, b in zip(_snapshot(caches[1])[0], _snapshot(caches[0])[0]):
        torch.testing.assert_close(a, b)


@CUDA
@pytest.mark.parametrize("allocated,steps,tokens,slots,message", PARAMS)
def test_compiled_decoding_step_on_cuda_returns_nan_for_a_bad_call_and_leaves_the_cache_untouched(
        cuda_models, allocated, steps, tokens, slots, message):
    model, compiled = cuda_models
    cache = _cache_with(model, allocated, steps)
    snap = _snapshot(cache)
    with torch.no_grad():
        logits = compiled(tokens.cuda(), cache, torch.tensor(slots, device="cuda"))
    _assert_untouched(cache, snap, "compiled on CUDA")
    assert logits.shape == (2, 1, VOCAB) and logits.isnan().all()


@CUDA
def test_compiled_decoding_on_cuda_goes_on_after_bad_calls_as_eager(cuda_models):
    """Bad calls between good ones (a repeated slot, an unallocated one, one out of range, a token
    out of the vocabulary) change nothing: the good steps give the eager model's logits and cache."""
    model, compiled = cuda_models
    caches = [_cache_with(model, 2), _cache_with(model, 2)]  # slot 2 is never allocated
    idx = torch.tensor([0, 1], device="cuda")
    tokens = TOKENS.cuda()
    bad = [(tokens, [1, 1]), (tokens, [0, 2]), (tokens, [3, 0]), (torch.tensor([[VOCAB], [0]], device="cuda"), [0, 1])]
    with torch.no_grad():
        for step in range(MAX_LEN):
            if step < len(bad):
                ids, slots = bad[step]
                assert compiled(ids, caches[1], torch.tensor(slots, device="cuda")).isnan().all()
            torch.testing.assert_close(compiled(tokens + step % 3, caches[1], idx),
                                       model(tokens + step % 3, caches[0], idx))
    for a, b in zip(_snapshot(caches[1])[0], _snapshot(caches[0])[0]):
        torch.testing.assert_close(a, b)
