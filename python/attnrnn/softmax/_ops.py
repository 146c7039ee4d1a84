"""Fake kernels and autograd of the softmax-attention ops (torch.ops.attnrnn.softmax_attn_*,
defined in csrc/torch/registration.cpp).

The forward saves q, k, v, o and the log-sum-exp per query (lse, [B, H, Tq] in the accumulator
dtype); the backward recomputes the probabilities block by block from them. The backward op
has no backward of its own: differentiating through it (create_graph=True, then grad again) raises.
"""
import torch

from .. import _C  # loads the operator registrations; holds the decode step's eager call
from .._ops import _eager, fake_check_cu_seqlens, fake_check_devices, fake_check_rank, no_double_backward, state_dtype

ops = torch.ops.attnrnn


def _check_sequence_args(q, k, v, cu_seqlens, op, others=None):
    fake_check_rank(q, 4, op, "q", "[B, Tq, H, D]")
    fake_check_rank(k, 4, op, "k", "[B, Tk, Hkv, D]")
    fake_check_rank(v, 4, op, "v", "[B, Tk, Hkv, Dv]")
    fake_check_cu_seqlens(cu_seqlens, op)
    fake_check_devices(op, q, {"k": k, "v": v, "cu_seqlens": cu_seqlens, **(others or {})})


@torch.library.register_fake("attnrnn::softmax_attn_fwd")
def _(q, k, v, cu_seqlens, scale, causal):
    _check_sequence_args(q, k, v, cu_seqlens, "streaming_attn")
    B, Tq, H, _ = q.shape
    Dv = v.shape[3]
    return q.new_empty((B, Tq, H, Dv)), q.new_empty((B, H, Tq), dtype=state_dtype(q))


@torch.library.register_fake("attnrnn::softmax_attn_bwd")
def _(dout, q, k, v, o, lse, cu_seqlens, scale, causal):
    _check_sequence_args(q, k, v, cu_seqlens, "streaming_attn backward", {"grad of o": dout, "o": o, "lse": lse})
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("attnrnn::softmax_attn_step")
def _(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, split_size):
    op = "softmax_attn_step"
    fake_check_rank(q, 3, op, "q", "[B, H, D]")
    fake_check_rank(k_cache, 4, op, "k_cache", "[B, Lmax, Hkv, D]")
    fake_check_rank(v_cache, 4, op, "v_cache", "[B, Lmax, Hkv, Dv]")
    fake_check_devices(op, q, {"k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens,
                               "k_new": k_new, "v_new": v_new})
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[3]))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, scale, causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.options = (scale, causal)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv = ops.softmax_attn_bwd(dout, q, k, v, o, lse, cu_seqlens, *ctx.options)
    return dq, dk, dv, None, None, None


torch.library.register_autograd("attnrnn::softmax_attn_fwd", _backward, setup_context=_setup_context)
# The decode step's autograd (it refuses to record a gradient) is in C++ (csrc/torch/autograd.cpp), and its
# eager call attnrnn._C's typed one.
softmax_attn_step = _eager(ops.softmax_attn_step.default, _C.softmax_attn_step)
torch.library.register_autograd("attnrnn::softmax_attn_bwd", no_double_backward("attnrnn::softmax_attn_bwd"))
