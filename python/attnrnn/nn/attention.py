"""Attention layers: :class:`LinearAttention` (attnrnn's kernels) and :class:`SoftmaxAttention`
(``scaled_dot_product_attention`` with a KV cache) for pure and hybrid stacks.

Both map ``x [B, T, hidden_size]`` to ``[B, T, hidden_size]`` and have three modes:

* ``layer(x)``: training / full forward, causal over the T tokens (chunk kernel or SDPA);
* ``layer(x, cache=cache, state_indices=idx)`` with T > 1: prefill (or continue) sequences
  ``idx [B]`` of the cache: the chunk kernel starts from the cached state and writes the final
  state back into rows ``idx`` (softmax: keys and values appended at each slot's length);
* the same with T == 1: one decoding step, ``linear_attn_step`` updating rows ``idx`` of the pool
  in place (softmax: one query over the slot's cached keys).

``state_indices`` must be distinct allocated slots of the cache (``cache.allocate``); None means
slots ``0 .. B-1``. The layer reads ``cache.layers[layer_idx]``. All checks happen before the
cache is written, so a bad call leaves it untouched: it raises ValueError, except compiled on
CUDA, where it returns NaN instead (raising would need a device sync; see ``attnrnn.nn.cache``).
The outputs of the cached modes are differentiable (the cache itself is not: states are written
detached).
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .._args import as_finite, as_flag, as_head_dim, as_int, as_scale, check_feature_map_output
from ..linear_attn import FEATURE_MAPS, chunk_linear_attn, linear_attn_step
from .cache import AttentionCache, KVPool, LinearStatePool, guard, kept, nan_if

__all__ = ["LinearAttention", "SoftmaxAttention"]


class _Attention(nn.Module):
    """Projections and argument checks shared by both layers."""

    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, value_dim, qk_norm, bias, layer_idx,
                 device, dtype):
        super().__init__()
        as_int(hidden_size, "hidden_size", 1)
        as_int(num_heads, "num_heads", 1)
        num_kv_heads = num_heads if num_kv_heads is None else as_int(num_kv_heads, "num_kv_heads", 1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads={num_heads}, got {num_kv_heads}")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}; pass head_dim")
            head_dim = hidden_size // num_heads
        as_int(head_dim, "head_dim", 1)
        value_dim = head_dim if value_dim is None else as_int(value_dim, "value_dim", 1)
        qk_norm, bias = as_flag(qk_norm, "qk_norm"), as_flag(bias, "bias")
        as_int(layer_idx, "layer_idx", 0)
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim, self.value_dim, self.layer_idx = head_dim, value_dim, layer_idx
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, **kw)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * value_dim, **kw)
        self.o_proj = nn.Linear(num_heads * value_dim, hidden_size, **kw)
        if qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, device=device, dtype=dtype)
            self.k_norm = nn.RMSNorm(head_dim, device=device, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def _project(self, x):
        """x [B, T, hidden] -> q [B, T, H, D], k [B, T, Hkv, D], v [B, T, Hkv, Dv]."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [B, T, hidden_size={self.hidden_size}], got shape {list(x.shape)}")
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.value_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _param_dtype(self):
        return self.q_proj.weight.dtype

    def _pool(self, cache, expected_spec):
        """This layer's pool of ``cache``, checked against what the layer needs."""
        if not isinstance(cache, AttentionCache):
            raise TypeError(f"cache must be an attnrnn.nn.AttentionCache, got {type(cache).__name__}")
        if not 0 <= self.layer_idx < len(cache.layers):
            raise ValueError(f"cache has {len(cache.layers)} layer(s) but this layer has layer_idx={self.layer_idx}; "
                             "the cache was built for another model")
        pool = cache.layers[self.layer_idx]
        if pool.spec != expected_spec:
            raise ValueError(f"cache.layers[{self.layer_idx}] is a {pool.describe()}, but layer {self.layer_idx} "
                             f"({type(self).__name__}) needs {self._expected(cache.num_slots)}; the cache was built "
                             "for another model")
        return pool

    def make_cache(self, num_slots: int, max_len: Optional[int] = None, device=None) -> AttentionCache:
        """A one-layer cache for using this layer on its own (requires ``layer_idx == 0``)."""
        if self.layer_idx != 0:
            raise ValueError(f"make_cache of a single layer needs layer_idx=0, got {self.layer_idx}; "
                             "build the cache from the model")
        return AttentionCache([self.make_state(num_slots, max_len=max_len, device=device)],
                              signature=(self.spec(),))


class LinearAttention(_Attention):
    """Multi-head causal linear attention with attnrnn's kernels.

    Args:
        hidden_size: model width; ``x [B, T, hidden_size]``.
        num_heads: query heads H. num_kv_heads: key/value heads Hkv (GQA; divides H; default H).
        head_dim: K of q and k (default hidden_size // num_heads). value_dim: V (default head_dim).
        feature_map: ``"elu1"``, ``"relu"``, ``"identity"``/None (fused in the kernels), or an
            ``nn.Module``/callable applied to q ``[B, T, H, K]`` and k ``[B, T, Hkv, K]`` (learnable,
            e.g. :class:`~attnrnn.nn.HedgehogFeatureMap`); its ``feature_dim`` attribute (or a probe)
            gives the state's K.
        normalize: divide by ``q'.z + eps`` (Katharopoulos et al.); otherwise no z is kept.
        scale: multiplies phi(q); default feature_dim ** -0.5.
        qk_norm: RMSNorm over head_dim of q and k before the feature map.
        output_norm: RMSNorm over V of each head's output before ``o_proj``.
        chunk_size: chunk of the chunk kernel (None: the kernel's choice).
        layer_idx: which pool of a cache this layer uses.

    State per sequence: ``S [Hkv, K_feat, V]`` and ``z [Hkv, K_feat]``, float32 (float64 for a
    float64 layer), independent of the number of tokens.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, feature_map: Union[None, str, nn.Module, Callable] = "elu1",
                 normalize: bool = True, *, value_dim: Optional[int] = None, scale: Optional[float] = None,
                 eps: float = 1e-6, qk_norm: bool = False, output_norm: bool = False, bias: bool = False,
                 chunk_size: Optional[int] = None, layer_idx: int = 0, device=None, dtype=None):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, value_dim, qk_norm, bias, layer_idx,
                         device, dtype)
        if feature_map is None or isinstance(feature_map, str):
            name = "identity" if feature_map is None else feature_map
            if name not in FEATURE_MAPS:
                raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, an nn.Module or a callable, "
                                 f"got {feature_map!r}")
            self.feature_map, self._fused_map = None, name
            self.feature_dim = as_head_dim(self.head_dim, "head_dim")
        elif callable(feature_map):
            self.feature_map, self._fused_map = feature_map, "identity"  # a Module registers as a child
            self.feature_dim = as_head_dim(self._probe_feature_dim(feature_map, device, dtype),
                                           "feature_map's feature_dim")
        else:
            raise TypeError(f"feature_map must be one of {FEATURE_MAPS}, an nn.Module or a callable, got "
                            f"{type(feature_map).__name__} {feature_map!r}")
        as_head_dim(self.value_dim, "value_dim")
        self.normalize, self.scale = as_flag(normalize, "normalize"), as_scale(scale)
        self.eps = as_finite(eps, "eps", minimum=0)
        self.chunk_size = as_int(chunk_size, "chunk_size", 1, 1024, allow_none=True)
        output_norm = as_flag(output_norm, "output_norm")
        self.o_norm = nn.RMSNorm(self.value_dim, device=device, dtype=dtype) if output_norm else None

    def _probe_feature_dim(self, fm, device, dtype):
        dim = getattr(fm, "feature_dim", None)
        if isinstance(dim, int):
            return dim
        with torch.no_grad():
            return int(fm(torch.zeros(1, 1, 1, self.head_dim, device=device, dtype=dtype)).shape[-1])

    def _state_dtype(self):
        return torch.float64 if self._param_dtype() == torch.float64 else torch.float32

    def spec(self) -> tuple:
        """The state this layer needs: ``("linear", Hkv, K_feat, V, normalize, state dtype)``."""
        return ("linear", self.num_kv_heads, self.feature_dim, self.value_dim, self.normalize, self._state_dtype())

    def _expected(self, num_slots):
        z = f", z [{num_slots}, {self.num_kv_heads}, {self.feature_dim}]" if self.normalize else ", no z"
        return (f"a linear-attention state S [{num_slots}, {self.num_kv_heads}, {self.feature_dim}, "
                f"{self.value_dim}]{z} ({self._state_dtype()})")

    def make_state(self, num_slots: int, max_len: Optional[int] = None, device=None) -> LinearStatePool:
        """A state pool of ``num_slots`` rows for this layer (``max_len`` is ignored: O(1) state)."""
        device = self.q_proj.weight.device if device is None else device
        return LinearStatePool(num_slots, self.num_kv_heads, self.feature_dim, self.value_dim, self.normalize,
                               device=device, dtype=self._state_dtype())

    def forward(self, x: torch.Tensor, cache: Optional[AttentionCache] = None,
                state_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x ``[B, T, hidden_size]`` -> ``[B, T, hidden_size]``; see the module docstring for
        ``cache`` and ``state_indices`` (int ``[B]``)."""
        q, k, v = self._project(x)
        pool = idx = rows = bad = None
        if cache is not None:
            pool = self._pool(cache, self.spec())
            idx = cache.check_indices(state_indices, x.shape[0])
            rows, bad = guard(idx)  # compiled on CUDA: a bad call's rows are read, and written unchanged
        elif state_indices is not None:
            raise ValueError("state_indices needs a cache")
        if self.feature_map is not None:
            fq, fk = self.feature_map(q), self.feature_map(k)
            check_feature_map_output(fq, q, "feature_map(q)")
            check_feature_map_output(fk, k, "feature_map(k)")
            q, k = fq, fk
        opts = dict(scale=self.scale, normalize=self.normalize, feature_map=self._fused_map, eps=self.eps)
        if pool is None:
            o, _ = chunk_linear_attn(q, k, v, chunk_size=self.chunk_size, **opts)
        elif x.shape[1] == 1 and not (torch.is_grad_enabled() and (q.requires_grad or v.requires_grad)):
            # Decode: one token per sequence, rows idx of the pool updated in place (poisoned
            # slots, all -1, are skipped).
            o = linear_attn_step(q, k, v, (pool.S, pool.z), state_indices=idx, **opts)
        else:
            # Prefill / continue (and differentiable decode): start from rows idx, write the end back.
            init = (pool.S[rows], pool.z[rows] if pool.z is not None else None)
            o, state = chunk_linear_attn(q, k, v, chunk_size=self.chunk_size, initial_state=init,
                                         output_final_state=True, **opts)
            pool.S.index_copy_(0, rows, kept(bad, state.S.detach(), lambda: init[0]))
            if pool.z is not None:
                pool.z.index_copy_(0, rows, kept(bad, state.z.detach(), lambda: init[1]))
        if self.o_norm is not None:
            o = self.o_norm(o)
        B, T = x.shape[:2]
        return nan_if(bad, self.o_proj(o.reshape(B, T, self.num_heads * self.value_dim)))

    def extra_repr(self) -> str:
        fm = self._fused_map if self.feature_map is None else "module"
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, value_dim={self.value_dim}, feature_map={fm}, "
                f"feature_dim={self.feature_dim}, normalize={self.normalize}, layer_idx={self.layer_idx}")


class SoftmaxAttention(_Attention):
    """Multi-head causal softmax attention (``F.scaled_dot_product_attention``) with a KV cache,
    for hybrid stacks. No positional encoding of its own (causal masking gives the order).

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim, value_dim, qk_norm, bias, layer_idx: as in
            :class:`LinearAttention`. scale: default head_dim ** -0.5.

    Cache per sequence: ``k [L, Hkv, D]``, ``v [L, Hkv, Dv]`` with L = ``max_len`` of
    :meth:`make_state`: it grows with the context (O(N) memory and time per decoded token).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, *, value_dim: Optional[int] = None, scale: Optional[float] = None,
                 qk_norm: bool = False, bias: bool = False, layer_idx: int = 0, device=None, dtype=None):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, value_dim, qk_norm, bias, layer_idx,
                         device, dtype)
        self.scale = as_scale(scale)

    def spec(self) -> tuple:
        """The cache this layer needs: ``("softmax", Hkv, D, Dv, dtype)``."""
        return ("softmax", self.num_kv_heads, self.head_dim, self.value_dim, self._param_dtype())

    def _expected(self, num_slots):
        return (f"a softmax KV cache k [{num_slots}, max_len, {self.num_kv_heads}, {self.head_dim}], "
                f"v [{num_slots}, max_len, {self.num_kv_heads}, {self.value_dim}] ({self._param_dtype()})")

    def make_state(self, num_slots: int, max_len: Optional[int] = None, device=None) -> KVPool:
        """A KV cache of ``num_slots`` sequences of up to ``max_len`` tokens (required)."""
        if max_len is None:
            raise ValueError("max_len is required for a softmax-attention layer (its KV cache grows with the context)")
        as_int(max_len, "max_len", 1)
        device = self.q_proj.weight.device if device is None else device
        return KVPool(num_slots, max_len, self.num_kv_heads, self.head_dim, self.value_dim, device=device,
                      dtype=self._param_dtype())

    def _sdpa(self, q, k, v, mask=None, causal=False):
        # [B, T, H, D] -> [B, H, T, D] for SDPA and back.
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           is_causal=causal, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o.transpose(1, 2)

    def forward(self, x: torch.Tensor, cache: Optional[AttentionCache] = None,
                state_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x ``[B, T, hidden_size]`` -> ``[B, T, hidden_size]``; with a cache, the T tokens are
        appended to each slot's keys and values and attend to everything cached before them."""
        q, k, v = self._project(x)
        B, T = x.shape[:2]
        bad = None
        if cache is None:
            if state_indices is not None:
                raise ValueError("state_indices needs a cache")
            o = self._sdpa(q, k, v, causal=True)
        else:
            pool = self._pool(cache, self.spec())
            idx = cache.check_indices(state_indices, B)
            compiling = torch.compiler.is_compiling()
            slots = None if compiling else cache._slots_of(idx)  # from the check: no device read per layer and token
            if B:
                idx = pool.check_room(idx, T, self.layer_idx, "x", slots)
            end = pool.end_after(slots, T) if not compiling and B else 0
            idx, bad = guard(idx)  # compiled on CUDA: a bad call's rows are read, and written unchanged
            start = pool.lengths[idx]                                         # [B]
            pos = start[:, None] + torch.arange(T, device=x.device)          # [B, T] positions of the new tokens
            if bad is not None:  # a call without room must not write past the end either
                pos = pos.clamp(max=pool.max_len - 1)
            at = (idx[:, None], pos)
            pool.k[at] = kept(bad, k.detach().to(pool.k.dtype), lambda: pool.k[at])
            pool.v[at] = kept(bad, v.detach().to(pool.v.dtype), lambda: pool.v[at])
            pool.append_(idx, start, T, None if compiling else slots, bad)
            L = pool.max_len if compiling else end                           # keys to read
            if not compiling and B == 1:
                s = slots[0]
                kc, vc = pool.k[s:s + 1, :L], pool.v[s:s + 1, :L]            # views, no copy
            else:
                kc, vc = pool.k[idx, :L], pool.v[idx, :L]                    # [B, L, Hkv, D]
            if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
                # Splice the live keys/values in (out of place) so that gradients reach them; the
                # earlier cached ones are constants.
                bidx = torch.arange(B, device=x.device)[:, None]
                kc = kc.index_put((bidx, pos), k)
                vc = vc.index_put((bidx, pos), v)
            mask = torch.arange(L, device=x.device)[None, None, :] <= pos[:, :, None]   # [B, T, L]
            o = self._sdpa(q, kc, vc, mask=mask[:, None])
        return nan_if(bad, self.o_proj(o.reshape(B, T, self.num_heads * self.value_dim)))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, value_dim={self.value_dim}, layer_idx={self.layer_idx}")
