"""Causal softmax attention as an RNN: the public functions over torch.ops.attnrnn.softmax_attn_*.

Per query i, over the keys j it sees, the online-softmax recurrence keeps a running max m, a
numerator y and a denominator z (rescaled as m grows), block by block over the keys:
    s_ij = scale q_i . k_j,   o_i = sum_j exp(s_ij - m_i) v_j / sum_j exp(s_ij - m_i),
    lse_i = m_i + log z_i.
Nothing of size Tq x Tk is formed; the forward keeps only lse per query for the backward, which
recomputes the probabilities.
"""
from typing import Optional, Tuple, Union

import torch

from . import _ops
from ._ops import ops
from .._args import as_flag as _flag, as_int as _int, check_tensor as _check_tensor
from .._args import resolve_scale as _scale, scale_of as _scale_of


def streaming_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    cu_seqlens: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Softmax attention by the blocked online-softmax recurrence (forward and backward).

    Args:
        q: [B, Tq, H, D]; k: [B, Tk, Hkv, D]; v: [B, Tk, Hkv, Dv] (Hkv divides H: query head h
            reads kv head h // (H // Hkv)); float64, float32, float16 or bfloat16, all the same;
            any strides with unit stride on the last dimension.
        scale: multiplies q . k; default D ** -0.5.
        causal: mask aligned bottom-right: query i sees keys j <= i + Tk - Tq (FlashAttention's
            rule when Tq != Tk). A query that sees no key gets o = 0 (and lse = -inf).
        cu_seqlens: int32/int64 [N + 1] offsets packing N sequences along T for q and k alike
            (B == 1, Tq == Tk); empty sequences are allowed.
        return_lse: also return the log-sum-exp per query, [B, H, Tq] in float32 (float64 for
            float64 inputs); it is not differentiable.

    Returns:
        o [B, Tq, H, Dv] in q's dtype (accumulation in float32, float64 for float64), or (o, lse).
    """
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tensor(x, name)
    if cu_seqlens is not None:
        _check_tensor(cu_seqlens, "cu_seqlens")
    o, lse = ops.softmax_attn_fwd(q, k, v, cu_seqlens, _scale_of(scale, q), _flag(causal, "causal"))
    return (o, lse) if return_lse else o


def softmax_attn_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    split_size: Optional[int] = None,
) -> torch.Tensor:
    """One decoding token per sequence over a KV cache (flash-decoding: the cache length is cut
    into splits computed in parallel, then combined).

    Args:
        q: [B, H, D] or [B, 1, H, D].
        k_cache: [B, Lmax, Hkv, D]; v_cache: [B, Lmax, Hkv, Dv]; unit stride on the last dim.
        cache_seqlens: int32 [B]: valid cache length per sequence. It is read, never updated:
            the caller advances it (by one after a step with k_new).
        k_new, v_new: [B, Hkv, D(v)] or [B, 1, Hkv, D(v)]: written in place at row
            cache_seqlens[b] of the caches, then the token attends over cache_seqlens[b] + 1
            keys. Without them it attends over cache_seqlens[b] keys (0 keys: output 0).
            On the CPU a length out of range raises ValueError before anything is written.
        scale: default D ** -0.5.
        split_size: keys per split (None: chosen from B, Hkv and the longest length).

    Returns:
        o [B, H, Dv] (or [B, 1, H, Dv] for 4-D q) in q's dtype.

    An inference op: it writes the caches in place and is not differentiable (streaming_attn
    over the whole sequence is).
    """
    # The common call (plain tensors) takes the fewest Python steps: on an idle GPU the host's time
    # before the launch is part of each decoding step's time.
    if not (isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
            and isinstance(cache_seqlens, torch.Tensor)):
        for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (cache_seqlens, "cache_seqlens")):
            _check_tensor(x, name)
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    if torch.is_grad_enabled():
        for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (k_new, "k_new"), (v_new, "v_new")):
            if x is not None and x.requires_grad:
                raise ValueError(f"{name} requires grad, but softmax_attn_step writes the caches in place and is not "
                                 "differentiable; run it under torch.no_grad(), or use streaming_attn over the whole "
                                 "sequence for gradients")
    four_d = q.dim() == 4
    if four_d:
        if q.shape[1] != 1:
            raise ValueError(f"q must be [B, 1, H, D] (one token) when 4-D, got shape {list(q.shape)}")
        q = q[:, 0]
    if k_new is not None:
        _check_tensor(k_new, "k_new")
        _check_tensor(v_new, "v_new")
        if k_new.dim() == 4:
            if k_new.shape[1] != 1 or v_new.dim() != 4 or v_new.shape[1] != 1:
                raise ValueError("k_new and v_new must be [B, Hkv, D] or [B, 1, Hkv, D], got shapes "
                                 f"{list(k_new.shape)} and {list(v_new.shape)}")
            k_new, v_new = k_new[:, 0], v_new[:, 0]
    split = 0 if split_size is None else _int(split_size, "split_size", 1)
    o = _ops.softmax_attn_step(q, k_cache, v_cache, cache_seqlens, k_new, v_new, _scale_of(scale, q), split)
    return o.unsqueeze(1) if four_d else o


def reference_attn(q, k, v, *, scale=None, causal=True, cu_seqlens=None):
    """The same math in plain PyTorch (explicit Tq x Tk softmax, in the inputs' dtype, any dtype
    including float64): returns (o, lse) with o = 0 and lse = -inf for a query that sees no key.
    A masked matrix product: a NaN or Inf in a key's value reaches the queries before that key too."""
    if cu_seqlens is not None:
        outs, lses = [], []
        cu = cu_seqlens.tolist()
        if q.shape[0] != 1 or not cu or cu[0] < 0 or cu[-1] > q.shape[1] or any(a > b for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing offsets in [0, T={q.shape[1]}] (batch 1), got {cu}")
        for a, b in zip(cu[:-1], cu[1:]):
            o, lse = reference_attn(q[:, a:b], k[:, a:b], v[:, a:b], scale=scale, causal=causal)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs, 1), torch.cat(lses, 2)
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    kk = k.repeat_interleave(G, dim=2).transpose(1, 2)  # [B, H, Tk, D]
    vv = v.repeat_interleave(G, dim=2).transpose(1, 2)
    s = torch.matmul(q.transpose(1, 2), kk.transpose(-1, -2)) * _scale(scale, D)  # [B, H, Tq, Tk]
    if causal:
        i = torch.arange(Tq, device=q.device)[:, None]
        j = torch.arange(Tk, device=q.device)[None, :]
        s = s.masked_fill(j > i + Tk - Tq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # rows with no key: 0 (their softmax is 0 / 0); NaN inputs stay NaN
    p = torch.softmax(s, dim=-1).masked_fill(lse[..., None] == float("-inf"), 0.0)
    o = torch.matmul(p, vv).transpose(1, 2)
    return o, lse
