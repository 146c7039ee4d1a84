"""attnrnn.integrations.fla: fla's LinearAttention layers and LinearAttentionForCausalLM on
attnrnn's kernels.

flash-linear-attention (fla) is optional: every test that needs it skips when
fla.layers.linear_attn cannot be imported (fla, its triton or its transformers missing), as in CI;
the two tests of fla's absence run always. On the CPU the reference is fla's own torch-only
naive_recurrent_linear_attn, brought to what fla's kernels return (`fla_reference`); fla's Triton
kernels run on CUDA only, so the comparisons with them are the CUDA tests at the end.
"""
import copy
import importlib
import inspect
import os
import subprocess
import sys

import pytest
import torch

from conftest import HAS_CUDA

MODES = ("chunk", "fused_chunk", "fused_recurrent")
NAMES = {mode: f"{mode}_linear_attn" for mode in MODES}


def import_fla():
    """fla.layers.linear_attn (the module whose functions use_attnrnn patches), or a skip."""
    return pytest.importorskip("fla.layers.linear_attn", reason="flash-linear-attention (fla) is not importable",
                               exc_type=ImportError)


@pytest.fixture(scope="module")
def fla_layer_module():
    return import_fla()


@pytest.fixture(scope="module")
def integ(fla_layer_module):
    import attnrnn.integrations.fla as integ
    return integ


def fla_reference(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                  cu_seqlens=None, reverse=False):
    """What fla's linear-attention kernels return, from fla's naive_recurrent_linear_attn, which
    covers one batch of equal-length sequences scanned forward; the rest is fla's kernel code
    (fla/ops/linear_attn/utils.py, StatefulNormalizeFunction.forward): packed sequences each on
    their own, an empty one keeping its state; reverse scans each sequence backward; S None in an
    (S, z) tuple is S0 = 0; with normalize=True the state (S or None, z) whatever
    output_final_state says."""
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn
    if normalize and isinstance(initial_state, tuple):
        S0, z0 = initial_state
    else:
        S0, z0 = initial_state, None
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    if cu_seqlens is None:
        pieces = [(slice(None), 0, q.shape[1])]
    else:
        bounds = cu_seqlens.tolist()
        pieces = [(slice(n, n + 1), bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    outs, Ss, zs = [], [], []
    for rows, start, end in pieces:
        qs, ks, vs = (x[:, start:end] for x in (q, k, v))
        if reverse:
            qs, ks, vs = (x.flip(1) for x in (qs, ks, vs))
        n = qs.shape[0] if cu_seqlens is None else 1
        S = torch.zeros(n, H, K, V) if S0 is None else S0[rows].float()
        z = None if z0 is None else z0[rows].float()
        if end == start:
            outs.append(vs)
            Ss.append(S)
            zs.append(torch.zeros(n, 1, H, K) if z is None else z)
            continue
        init = (S, z) if z is not None else (S if S0 is not None or z0 is not None else None)
        o, state = naive_recurrent_linear_attn(qs, ks, vs, scale, init, True, normalize)
        outs.append(o.flip(1) if reverse else o)
        Ss.append(state[0] if normalize else state)
        if normalize:
            zs.append(state[1])
    o = torch.cat(outs, 1)
    S = torch.cat(Ss, 0) if output_final_state else None
    return (o, (S, torch.cat(zs, 0))) if normalize else (o, S)


def reference_functions():
    """fla_reference behind fla's three function signatures (each mode's own defaults)."""
    def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                          cu_seqlens=None):
        return fla_reference(q, k, v, scale, initial_state, output_final_state, normalize, cu_seqlens)

    def fused_recurrent_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False,
                                    normalize=False, cu_seqlens=None):
        return fla_reference(q, k, v, scale, initial_state, output_final_state, normalize, cu_seqlens, reverse)

    return {"chunk_linear_attn": chunk_linear_attn, "fused_chunk_linear_attn": chunk_linear_attn,
            "fused_recurrent_linear_attn": fused_recurrent_linear_attn}


def call_fla_reference_in_layers(fla_layer_module, monkeypatch):
    """Has fla.layers.linear_attn call fla_reference, the stand-in for fla's kernels on the CPU,
    until the test ends."""
    for name, fn in reference_functions().items():
        monkeypatch.setattr(fla_layer_module, name, fn)


def inputs(B=2, T=37, H=3, K=16, V=8, dtype=torch.float32, requires_grad=False):
    """q, k after a positive feature map (as fla's layers give them: the denominators stay away
    from 0), v of either sign."""
    q, k = (torch.rand(B, T, H, K, dtype=dtype) + 0.05 for _ in range(2))
    v = torch.randn(B, T, H, V, dtype=dtype)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def initial_state(kind, N, H=3, K=16, V=8, requires_grad=False):
    """fla's initial states: None, a tensor S, (S, z) with z [N, 1, H, K], (None, z)."""
    S = torch.randn(N, H, K, V).requires_grad_(requires_grad)
    z = (torch.rand(N, 1, H, K) + 0.5).requires_grad_(requires_grad)
    return {"none": None, "S": S, "S,z": (S, z), "None,z": (None, z)}[kind]


def close(a, b, tol=2e-5):
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            close(x, y, tol)
    elif a is None or b is None:
        assert a is None and b is None
    else:
        assert a.shape == b.shape, (a.shape, b.shape)
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


# --- fla is optional --------------------------------------------------------------------------


def test_importing_attnrnn_and_its_fla_integration_does_not_import_fla():
    code = ("import sys, attnrnn, attnrnn.integrations.fla; "
            "loaded = [m for m in sys.modules if m == 'fla' or m.startswith('fla.')]; "
            "assert not loaded, loaded")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


def test_use_attnrnn_without_fla_raises_an_import_error_naming_the_extra(monkeypatch):
    import attnrnn.integrations.fla as integ
    monkeypatch.setitem(sys.modules, "fla.layers.linear_attn", None)  # import raises as if absent
    with pytest.raises(ImportError, match=r"flash-linear-attention.*attnrnn\[fla\]"):
        integ.use_attnrnn()


# --- the routing --------------------------------------------------------------------------------


def test_use_attnrnn_routes_the_three_functions_fla_linear_attention_calls_and_restores_them_on_exit(
        fla_layer_module, integ):
    fla_ops = importlib.import_module("fla.ops.linear_attn")
    originals = {name: getattr(fla_layer_module, name) for name in NAMES.values()}
    assert all(originals[name] is getattr(fla_ops, name) for name in NAMES.values())
    assert not integ.is_routed()
    with integ.use_attnrnn():
        assert integ.is_routed()
        for name in NAMES.values():
            assert getattr(fla_layer_module, name) is getattr(integ, name)
            assert getattr(fla_ops, name) is originals[name]  # fla.ops itself is left alone
    for name in NAMES.values():
        assert getattr(fla_layer_module, name) is originals[name]
    assert not integ.is_routed()


def test_use_attnrnn_called_alone_keeps_the_routing_until_restore(fla_layer_module, integ):
    routing = integ.use_attnrnn()
    try:
        assert integ.is_routed()
    finally:
        routing.restore()
    assert not integ.is_routed()
    routing.restore()  # a second restore changes nothing
    assert not integ.is_routed()


def test_use_attnrnn_false_inside_a_routed_block_calls_fla_and_its_exit_routes_back(fla_layer_module, integ):
    fla_ops = importlib.import_module("fla.ops.linear_attn")
    with integ.use_attnrnn():
        with integ.use_attnrnn(False):
            assert not integ.is_routed()
            assert all(getattr(fla_layer_module, n) is getattr(fla_ops, n) for n in NAMES.values())
        assert integ.is_routed()
    assert not integ.is_routed()


def test_routed_functions_take_fla_signatures_with_each_modes_defaults(integ):
    fla_ops = importlib.import_module("fla.ops.linear_attn")
    for name in NAMES.values():
        ours = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(integ, name)).parameters.values()]
        theirs = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(fla_ops, name)).parameters.values()]
        assert ours == theirs, name
    # fused_recurrent alone does not normalize by default (fla/ops/linear_attn/fused_recurrent.py)
    assert inspect.signature(integ.fused_recurrent_linear_attn).parameters["normalize"].default is False
    assert inspect.signature(integ.chunk_linear_attn).parameters["normalize"].default is True


# --- the argument and state mapping against fla's naive reference (CPU, fp32) ----------------


# (S, z) tuples only with normalize=True, as fla takes them; a tensor S there means z0 = 0
STATES = [(False, "none"), (False, "S"), (True, "none"), (True, "S"), (True, "S,z"), (True, "None,z")]


@pytest.mark.parametrize("normalize, state", STATES,
                         ids=[f"{'normalized' if n else 'unnormalized'}-{s}" for n, s in STATES])
@pytest.mark.parametrize("mode", MODES)
def test_forward_and_final_state_match_fla_naive(integ, mode, normalize, state):
    q, k, v = inputs()
    init = initial_state(state, N=2)
    got = getattr(integ, NAMES[mode])(q, k, v, initial_state=init, output_final_state=True, normalize=normalize)
    close(got, fla_reference(q, k, v, initial_state=init, output_final_state=True, normalize=normalize))


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_normalizes_by_default_as_fla_does(integ, mode):
    q, k, v = inputs()
    fn = getattr(integ, NAMES[mode])
    default = inspect.signature(fn).parameters["normalize"].default
    close(fn(q, k, v), fla_reference(q, k, v, normalize=default))


@pytest.mark.parametrize("scale", [0.3, 1])
def test_a_given_scale_multiplies_q_as_in_fla(integ, scale):
    q, k, v = inputs()
    for normalize in (False, True):
        close(integ.chunk_linear_attn(q, k, v, scale=scale, normalize=normalize),
              fla_reference(q, k, v, scale=scale, normalize=normalize))


def test_the_normalizer_adds_fla_eps_1e_10_after_the_scale(integ):
    q, k, v = inputs()
    q = q * 1e-9  # q'.z near 1e-10: another eps, or one added before the scale, changes o
    for mode in MODES:
        close(getattr(integ, NAMES[mode])(q, k, v, normalize=True), fla_reference(q, k, v, normalize=True))
    plain = fla_reference(q, k, v, normalize=False)[0] / (torch.einsum("bthk,bthk->bth", q * 16 ** -0.5, k.cumsum(1))
                                                          + integ.FLA_EPS)[..., None]
    close(integ.chunk_linear_attn(q, k, v, normalize=True)[0], plain)


@pytest.mark.parametrize("mode", MODES)
def test_without_output_final_state_normalized_calls_still_return_none_and_z_as_fla_does(integ, mode):
    q, k, v = inputs()
    fn = getattr(integ, NAMES[mode])
    o, state = fn(q, k, v, normalize=True)
    assert isinstance(state, tuple) and state[0] is None
    close((o, state), fla_reference(q, k, v, normalize=True))
    assert fn(q, k, v, normalize=False)[1] is None


@pytest.mark.parametrize("normalize", [False, True], ids=["unnormalized", "normalized"])
@pytest.mark.parametrize("mode", MODES)
def test_gradients_into_inputs_and_initial_state_match_fla_naive(integ, mode, normalize):
    q, k, v = inputs(requires_grad=True)
    init = initial_state("S,z" if normalize else "S", N=2, requires_grad=True)
    leaves = [q, k, v, *(init if normalize else (init,))]

    def grads(fn):
        o, state = fn(q, k, v, initial_state=init, output_final_state=True, normalize=normalize)
        S, z = state if normalize else (state, None)
        loss = (o * torch.linspace(-1, 1, o.shape[-1])).sum() + S.square().sum() * 0.1
        if z is not None:
            loss = loss + z.sum() * 0.1
        return torch.autograd.grad(loss, leaves)

    close(grads(getattr(integ, NAMES[mode])), grads(fla_reference), tol=1e-4)


@pytest.mark.parametrize("normalize", [False, True], ids=["unnormalized", "normalized"])
@pytest.mark.parametrize("mode", MODES)
def test_packed_sequences_with_cu_seqlens_and_an_empty_one_match_each_sequence_alone(integ, mode, normalize):
    q, k, v = inputs(B=1, T=45)
    cu_seqlens = torch.tensor([0, 17, 17, 40, 45])
    init = initial_state("S,z" if normalize else "S", N=4)
    got = getattr(integ, NAMES[mode])(q, k, v, initial_state=init, output_final_state=True, normalize=normalize,
                                       cu_seqlens=cu_seqlens)
    close(got, fla_reference(q, k, v, initial_state=init, output_final_state=True, normalize=normalize,
                             cu_seqlens=cu_seqlens))


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
@pytest.mark.parametrize("normalize", [False, True], ids=["unnormalized", "normalized"])
def test_fused_recurrent_reverse_scans_each_sequence_from_its_last_token(integ, normalize, packed):
    q, k, v = inputs(B=1 if packed else 2, T=29)
    cu_seqlens = torch.tensor([0, 11, 11, 29]) if packed else None
    init = initial_state("S,z" if normalize else "S", N=3 if packed else 2)
    got = integ.fused_recurrent_linear_attn(q, k, v, initial_state=init, output_final_state=True, reverse=True,
                                            normalize=normalize, cu_seqlens=cu_seqlens)
    close(got, fla_reference(q, k, v, initial_state=init, output_final_state=True, normalize=normalize,
                             cu_seqlens=cu_seqlens, reverse=True))


def test_returned_state_has_fla_dtypes_float32_S_and_z_in_ks_dtype_promoted_with_z_init(integ):
    q, k, v = inputs(dtype=torch.bfloat16)
    o, S = integ.chunk_linear_attn(q, k, v, output_final_state=True, normalize=False)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32 and S.shape == (2, 3, 16, 8)
    o, (S, z) = integ.chunk_linear_attn(q, k, v, output_final_state=True, normalize=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32 and z.dtype == torch.bfloat16
    assert z.shape == (2, 1, 3, 16)
    _, (_, z_next) = integ.fused_recurrent_linear_attn(q, k, v, initial_state=(S, z), normalize=True)
    assert z_next.dtype == torch.bfloat16
    _, (_, z_next) = integ.fused_recurrent_linear_attn(q, k, v, initial_state=(S, z.float()), normalize=True)
    assert z_next.dtype == torch.float32


def test_a_tuple_state_without_normalize_raises_a_type_error_naming_the_layout(integ):
    q, k, v = inputs()
    with pytest.raises(TypeError, match=r"initial_state must be a tensor S \[N, H, K, V\] with normalize=False"):
        integ.chunk_linear_attn(q, k, v, initial_state=initial_state("S,z", N=2), normalize=False)


def test_z_without_fla_singleton_axis_raises_a_value_error(integ):
    q, k, v = inputs()
    S, z = initial_state("S,z", N=2)
    with pytest.raises(ValueError, match=r"z must be \[N, 1, H, K\]"):
        integ.chunk_linear_attn(q, k, v, initial_state=(S, z[:, 0]), normalize=True)


# --- fla's LinearAttention layer on the CPU ---------------------------------------------------


def layer(mode, normalize, num_kv_heads=None):
    """fla.layers.LinearAttention with the elu + 1 feature map; its output RMSNorm is fla's Triton
    kernel, so on the CPU it has none ('identity')."""
    from fla.layers import LinearAttention
    torch.manual_seed(1)
    return LinearAttention(mode=mode, hidden_size=64, num_heads=4, num_kv_heads=num_kv_heads, feature_map="elu",
                           output_norm="identity", do_feature_map_norm=normalize, layer_idx=0)


def run_layer(attn, x, grad):
    with torch.set_grad_enabled(grad):
        return attn(x)[0]


@pytest.mark.parametrize("gqa", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("normalize", [False, True], ids=["unnormalized", "normalized"])
@pytest.mark.parametrize("mode", MODES)
def test_linear_attention_layer_routed_matches_the_layer_on_fla_naive(fla_layer_module, integ, monkeypatch, mode,
                                                                      normalize, gqa):
    attn = layer(mode, normalize, gqa)
    x = torch.randn(2, 80, 64)
    # grad on: fla's layer calls chunk; off with 80 tokens: its mode; off with <= 64: fused_recurrent
    cases = [(x, True), (x, False), (x[:, :40], False)]
    with integ.use_attnrnn():
        got = [run_layer(attn, *c) for c in cases]
    call_fla_reference_in_layers(fla_layer_module, monkeypatch)
    for g, c in zip(got, cases):
        close(g, run_layer(attn, *c), tol=1e-4)


@pytest.mark.parametrize("normalize", [False, True], ids=["unnormalized", "normalized"])
@pytest.mark.parametrize("mode", MODES)
def test_layer_decoding_through_fla_cache_matches_its_full_sequence_output(integ, mode, normalize):
    from fla.models.utils import Cache
    attn = layer(mode, normalize)
    x = torch.randn(2, 76, 64)
    with integ.use_attnrnn(), torch.no_grad():
        full = attn(x)[0]
        cache = Cache()
        steps = [attn(x[:, :70], past_key_values=cache, use_cache=True)[0]]  # prefill in the layer's mode
        for t in range(70, 76):  # then fused_recurrent, one token at a time
            steps.append(attn(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
    close(torch.cat(steps, 1), full, tol=1e-4)


def test_padded_batch_with_an_attention_mask_matches_each_sequence_alone(integ):
    attn = layer("chunk", True)
    x = torch.randn(2, 30, 64)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :9] = 0  # left padding: fla's layer packs the rest with cu_seqlens
    for grad in (True, False):  # chunk, then fused_recurrent (30 tokens)
        with integ.use_attnrnn(), torch.set_grad_enabled(grad):
            padded = attn(x, attention_mask=mask)[0]
            alone = [attn(x[:1])[0][0], attn(x[1:, 9:])[0][0]]
        close(padded[0], alone[0], tol=1e-4)
        close(padded[1, 9:], alone[1], tol=1e-4)


# --- fla's LinearAttentionForCausalLM: CPU against fla's naive, CUDA against fla's kernels -----


def tiny_lm(device, dtype, **overrides):
    """A small LinearAttentionForCausalLM (fixed seed; fla's defaults otherwise: the Hadamard
    feature map, no normalizer, fused_chunk). The fused norms and cross entropy are off: Triton
    kernels that are not what is tested here and would only add compile time on the GPU."""
    from fla.models import LinearAttentionConfig, LinearAttentionForCausalLM
    config = {"hidden_size": 256, "num_hidden_layers": 2, "num_heads": 4, "vocab_size": 1000, "fuse_norm": False,
              "fuse_swiglu": False, "fuse_cross_entropy": False, **overrides}
    torch.manual_seed(0)
    return LinearAttentionForCausalLM(LinearAttentionConfig(**config)).to(device=device, dtype=dtype)


CPU_LM = {"hidden_size": 64, "vocab_size": 128, "feature_map": "elu", "norm_feature_map": True}


@pytest.fixture
def torch_for_fla_triton_on_cpu(monkeypatch):
    """fla's RMSNorm and swiglu are Triton kernels only; on the CPU the model gets torch's
    RMSNorm (same weight and eps) and silu(x) * y instead, the linear attention being under test."""
    import fla.modules.mlp

    monkeypatch.setattr(fla.modules.mlp, "swiglu", lambda x, y: torch.nn.functional.silu(x) * y)

    def swap_norms(model):
        for block in model.model.layers:
            norm = block.attn.norm
            torch_norm = torch.nn.RMSNorm(norm.hidden_size, eps=norm.eps).to(norm.weight)
            torch_norm.weight.data.copy_(norm.weight.data)
            block.attn.norm = torch_norm
        return model

    return swap_norms


def train_losses(model, batch, steps, lr=1e-3):
    """Losses of `steps` AdamW steps on one batch: next-token cross entropy in fp32 (the model's
    own loss has the logits' dtype, whose rounding, 0.03 at 7 in bf16, would hide the differences)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        logits = model(input_ids=batch).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def pattern_batch(device, B=4, T=128, vocab=1000, period=23):
    """Sequences that repeat a random cycle of `period` tokens, from different offsets: fla's
    default model learns to continue them within ~10 steps, so that its greedy choices are clear-cut."""
    cycle = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:period]
    idx = (torch.arange(T)[None] + 5 * torch.arange(B)[:, None]) % period
    return cycle[idx].to(device)


def left_padded_prompts(batch, pad=10, length=80):
    """Two prompts of `length` tokens (prefilled in the model's mode: past fla's 64-token cut to
    fused_recurrent), the second left-padded by `pad` (fla's layer packs the batch by cu_seqlens)."""
    prompt = batch[:2, :length].clone()
    mask = torch.ones_like(prompt)
    prompt[1, :pad], mask[1, :pad] = 0, 0
    return prompt, mask


def greedy(model, prompt, mask, new_tokens=16):
    """Greedy generation through fla's cache: the tokens and the logits of each new one."""
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, use_cache=True, output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores, 1).float()


def test_causal_lm_training_steps_on_cpu_match_fla_naive(fla_layer_module, integ, torch_for_fla_triton_on_cpu,
                                                         monkeypatch):
    batch = pattern_batch("cpu", B=2, T=64, vocab=CPU_LM["vocab_size"])
    model = torch_for_fla_triton_on_cpu(tiny_lm("cpu", torch.float32, **CPU_LM))
    twin = copy.deepcopy(model)
    with integ.use_attnrnn():
        routed = train_losses(model, batch, steps=3)
    call_fla_reference_in_layers(fla_layer_module, monkeypatch)
    reference = train_losses(twin, batch, steps=3)
    assert max(abs(a - b) for a, b in zip(routed, reference)) <= 1e-4, (routed, reference)


def test_causal_lm_greedy_generation_through_fla_cache_on_cpu_matches_fla_naive(
        fla_layer_module, integ, torch_for_fla_triton_on_cpu, monkeypatch):
    batch = pattern_batch("cpu", vocab=CPU_LM["vocab_size"])
    model = torch_for_fla_triton_on_cpu(tiny_lm("cpu", torch.float32, attn_mode="chunk", **CPU_LM))
    prompt, mask = left_padded_prompts(batch)
    with integ.use_attnrnn():
        train_losses(model, batch, steps=2)
        tokens, scores = greedy(model, prompt, mask)
    call_fla_reference_in_layers(fla_layer_module, monkeypatch)
    ref_tokens, ref_scores = greedy(model, prompt, mask)
    assert torch.equal(tokens, ref_tokens)
    close(scores, ref_scores, tol=1e-4)


cuda_only = pytest.mark.requires_cuda


@cuda_only
@pytest.mark.parametrize("normalize", [False, True], ids=["unnormalized", "normalized"])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_bf16_routed_functions_match_fla_kernels_with_initial_and_final_state(integ, mode, normalize):
    """fla's own kernels against the routed functions, both in bf16 (the CPU tests compare with
    fla's naive form in fp32). fla rounds the normalizer's running key sum and the output to bf16
    (2**-8 relative) and sums in another order: 2e-2 relative RMS allows a few such steps."""
    from numerics import relative_rms
    fla_ops = importlib.import_module("fla.ops.linear_attn")
    q, k, v = (x.to("cuda", torch.bfloat16) for x in inputs(B=2, T=100, H=4, K=64, V=64))
    S, z = (x.cuda() for x in initial_state("S,z", N=2, H=4, K=64, V=64))
    init = (S, z.bfloat16()) if normalize else S
    got = getattr(integ, NAMES[mode])(q, k, v, initial_state=init, output_final_state=True, normalize=normalize)
    want = getattr(fla_ops, NAMES[mode])(q, k, v, initial_state=init, output_final_state=True, normalize=normalize)
    flat = lambda r: [r[0], *r[1]] if normalize else list(r)  # noqa: E731
    for name, a, b in zip(("o", "S", "z"), flat(got), flat(want)):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert relative_rms(a, b) <= 2e-2, (name, relative_rms(a, b))


@cuda_only
def test_cuda_bf16_training_losses_with_attnrnn_kernels_match_fla_kernels_within_bf16_noise(integ):
    """Six AdamW steps of the same bf16 model on the same batch, once on fla's kernels and once on
    attnrnn's. Both round their outputs to bf16 (8 significant bits: 2**-8 = 0.4% relative) at
    different points and sum in different orders. As a gauge: on the CPU, moving every attention
    output of this model by -1, 0 or +1 bf16 step at random moved its six fp32 losses (7.0 down to
    1.7) by at most 0.0015. 0.05 (0.7% of the first loss) leaves room for fla's coarser rounding
    inside its kernels and still catches a wrong scale, a missing normalizer or a lost state, each
    of which moves the loss by far more."""
    batch = pattern_batch("cuda")
    model = tiny_lm("cuda", torch.bfloat16)
    twin = copy.deepcopy(model)
    with integ.use_attnrnn(False):
        fla_losses = train_losses(model, batch, steps=6)
    with integ.use_attnrnn():
        attnrnn_losses = train_losses(twin, batch, steps=6)
    diff = max(abs(a - b) for a, b in zip(fla_losses, attnrnn_losses))
    assert diff <= 0.05, (fla_losses, attnrnn_losses)


@cuda_only
def test_cuda_greedy_generation_through_fla_cache_gives_fla_kernels_tokens(integ):
    """fla's default bf16 model trained 12 steps on fla's kernels to continue a repeating cycle;
    16 new tokens for a left-padded batch of 80-token prompts through fla's cache (prefill in
    fused_chunk, then fused_recurrent token by token), on fla's kernels and on attnrnn's. The
    tokens must be the same; the logits agree within bf16 noise (5% relative RMS, where a lost or
    misread state is of the logits' own size)."""
    from numerics import relative_rms
    batch = pattern_batch("cuda")
    model = tiny_lm("cuda", torch.bfloat16)
    with integ.use_attnrnn(False):
        train_losses(model, batch, steps=12, lr=3e-3)
    prompt, mask = left_padded_prompts(batch)
    with integ.use_attnrnn(False):
        fla_tokens, fla_scores = greedy(model, prompt, mask)
    with integ.use_attnrnn():
        tokens, scores = greedy(model, prompt, mask)
    assert torch.equal(tokens, fla_tokens)
    assert relative_rms(scores, fla_scores) <= 5e-2
