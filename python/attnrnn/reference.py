"""Pure-PyTorch reference implementations of causal linear attention.

These functions import nothing but torch and the package's argument helpers (``_args``, themselves
torch-only), so they work without the compiled extension. They check their options as the ops do
(a wrong type raises TypeError, a value out of range ValueError) but take any head dim. They
compute in the dtype of their inputs (state included): given float64 tensors they are the float64
reference of the test suite; given bf16/fp16/fp32 tensors they are the "PyTorch in the same
precision" baseline of the numerics rules (design.md §4, R1). All of them except
:func:`linear_attn_step` are differentiable by autograd, with respect to q, k, v and the initial
state.

Math (the same as ``include/attnrnn/attnrnn.h``), with ``q' = scale * phi(q)``, ``k' = phi(k)``::

    S_t = S_{t-1} + k'_t^T v_t          # [K, V] per sequence and kv head
    z_t = z_{t-1} + k'_t                # [K]
    o_t = q'_t S_t / (q'_t . z_t + eps) # normalize=True
    o_t = q'_t S_t                      # normalize=False

Shapes:

* ``q``: ``[B, T, H, K]``, ``k``: ``[B, T, Hkv, K]``, ``v``: ``[B, T, Hkv, V]``, ``H % Hkv == 0``;
  query head ``h`` reads kv head ``h // (H // Hkv)``.
* ``o``: ``[B, T, H, V]``, dtype of ``q``.
* state ``S``: ``[N, Hkv, K, V]``, ``z``: ``[N, Hkv, K]`` (``None`` when ``normalize=False``),
  dtype of the inputs. ``N = B``, or the number of sequences when ``cu_seqlens`` (``[N + 1]``
  int32/int64 offsets into T, ``B == 1``) packs several sequences along T. An empty sequence
  leaves its state unchanged.

Three forms of the same function:

* :func:`parallel_linear_attn`: ``((Q' K'^T) * M) V`` with the causal mask M (O(T^2));
* :func:`recurrent_linear_attn`: the token-by-token RNN;
* :func:`chunk_linear_attn`: chunks of C tokens, the parallel form inside a chunk, the recurrent
  state between chunks.

A NaN or Inf in q, k or v at token t reaches, in the recurrent and chunk forms, only what depends
on token t (the outputs and dq of tokens >= t; dk and dv as the README states); the parallel form
multiplies masked zeros by every token's row, so there it reaches earlier tokens too.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from ._args import as_finite, as_flag, as_int, as_scale

__all__ = [
    "LinearAttnState",
    "apply_feature_map",
    "parallel_linear_attn",
    "recurrent_linear_attn",
    "chunk_linear_attn",
    "linear_attn_step",
]

FeatureMap = Union[None, str, Callable[[torch.Tensor], torch.Tensor]]


class LinearAttnState(NamedTuple):
    """Recurrent state: ``S`` ``[N, Hkv, K, V]`` and ``z`` ``[N, Hkv, K]`` (None if unnormalized)."""

    S: torch.Tensor
    z: Optional[torch.Tensor]


def apply_feature_map(x: torch.Tensor, feature_map: FeatureMap) -> torch.Tensor:
    """phi(x): ``None``/``"identity"`` -> x, ``"elu1"`` -> elu(x) + 1, ``"relu"`` -> max(x, 0),
    or a callable applied as is."""
    if feature_map is None or (isinstance(feature_map, str) and feature_map == "identity"):
        return x
    if callable(feature_map):
        return feature_map(x)
    if feature_map == "elu1":
        return F.elu(x) + 1
    if feature_map == "relu":
        return F.relu(x)
    error = ValueError if isinstance(feature_map, str) else TypeError
    raise error(f"feature_map must be None, 'identity', 'elu1', 'relu' or a callable, got {feature_map!r}")


# ---- shared preparation --------------------------------------------------------------------------


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D [B, T, H, D], got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if not (q.shape[:2] == k.shape[:2] == v.shape[:2]):
        raise ValueError(f"q, k, v must share B and T, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share the head dim, got {q.shape[3]} and {k.shape[3]}")
    if not all(t.is_floating_point() for t in (q, k, v)):
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}, {k.dtype}, {v.dtype}")
    H, Hkv = q.shape[2], k.shape[2]
    if v.shape[2] != Hkv or Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"k/v heads ({Hkv}, {v.shape[2]}) must be equal and divide q heads ({H})")
    return H // Hkv


def _features(q, k, scale, feature_map):
    scale = as_scale(scale)
    qf = apply_feature_map(q, feature_map)
    kf = apply_feature_map(k, feature_map)
    if scale is None:
        scale = qf.shape[-1] ** -0.5
    return qf * scale, kf


def _sequences(cu_seqlens, B: int, T: int) -> Optional[List[Tuple[int, int]]]:
    """None without cu_seqlens, else the list of (start, end) along T of the packed sequences."""
    if cu_seqlens is None:
        return None
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1, got B = {B}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
        raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor")
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != T or any(
        b < a for a, b in zip(offsets, offsets[1:])
    ):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T}, got {offsets}")
    return list(zip(offsets[:-1], offsets[1:]))


def _initial_state(initial_state, N, Hkv, K, V, normalize, like: torch.Tensor):
    """Initial (S0, z0) in the compute dtype; zeros when absent. z0 is None if not normalize."""
    if initial_state is None:
        S0 = like.new_zeros(N, Hkv, K, V)
        z0 = like.new_zeros(N, Hkv, K) if normalize else None
        return S0, z0
    S0, z0 = initial_state
    if tuple(S0.shape) != (N, Hkv, K, V):
        raise ValueError(f"initial_state S must be {(N, Hkv, K, V)}, got {tuple(S0.shape)}")
    S0 = S0.to(like.dtype)
    if normalize:
        if z0 is None:
            raise ValueError("initial_state z is required when normalize=True")
        if tuple(z0.shape) != (N, Hkv, K):
            raise ValueError(f"initial_state z must be {(N, Hkv, K)}, got {tuple(z0.shape)}")
        z0 = z0.to(like.dtype)
    else:
        z0 = None
    return S0, z0


def _group(x: torch.Tensor, Hkv: int) -> torch.Tensor:
    """[..., H, D] -> [..., Hkv, G, D] (consecutive query heads share one kv head)."""
    return x.unflatten(-2, (Hkv, x.shape[-2] // Hkv))


def _run(core, q, k, v, *, scale, normalize, feature_map, eps, initial_state,
         output_final_state, cu_seqlens, **core_kwargs):
    """Prepare features and state, run ``core`` per batch (or per packed sequence), assemble."""
    normalize, output_final_state = as_flag(normalize, "normalize"), as_flag(output_final_state, "output_final_state")
    eps = as_finite(eps, "eps", minimum=0)
    _check_heads(q, k, v)
    B, T, H, _ = q.shape
    Hkv, V = v.shape[2], v.shape[3]
    qf, kf = _features(q, k, scale, feature_map)
    K = qf.shape[-1]
    # Compute dtype: the inputs' (float64 in -> float64 everywhere).
    dtype = torch.promote_types(torch.promote_types(qf.dtype, kf.dtype), v.dtype)
    qf, kf, vv = qf.to(dtype), kf.to(dtype), v.to(dtype)
    seqs = _sequences(cu_seqlens, B, T)
    N = B if seqs is None else len(seqs)
    S0, z0 = _initial_state(initial_state, N, Hkv, K, V, normalize, qf)

    if seqs is None:
        o, S, z = core(qf, kf, vv, S0, z0, normalize=normalize, eps=eps, **core_kwargs)
    else:
        outs, Ss, zs = [], [], []
        for n, (a, b) in enumerate(seqs):
            o_n, S_n, z_n = core(
                qf[:, a:b], kf[:, a:b], vv[:, a:b], S0[n : n + 1],
                None if z0 is None else z0[n : n + 1],
                normalize=normalize, eps=eps, **core_kwargs,
            )
            outs.append(o_n)
            Ss.append(S_n)
            zs.append(z_n)
        o = torch.cat(outs, dim=1) if outs else qf.new_zeros(B, T, H, V)
        S = torch.cat(Ss, dim=0) if Ss else S0
        z = (torch.cat(zs, dim=0) if zs else z0) if normalize else None
    o = o.to(q.dtype)
    if not output_final_state:
        return o, None
    return o, LinearAttnState(S, z if normalize else None)


# ---- the three forms (cores on [N, L, ...] with state [N, Hkv, ...]) ------------------------------
#
# qf: [N, L, H, K] (scaled features), kf: [N, L, Hkv, K], v: [N, L, Hkv, V],
# S0: [N, Hkv, K, V], z0: [N, Hkv, K] or None. Return o [N, L, H, V], S, z (z None unless normalize).


def _parallel_core(qf, kf, v, S0, z0, *, normalize, eps, query_block=1024):
    N, L, H, K = qf.shape
    Hkv = kf.shape[2]
    qg = _group(qf, Hkv)  # [N, L, Hkv, G, K]
    outs = []
    # Blocks of queries only bound the memory of the [L, L] score matrix; the math is the
    # masked O(L^2) product ((Q' K'^T) * M) V.
    for i in range(0, L, query_block):
        j = min(i + query_block, L)
        A = torch.einsum("nthgk,nshk->nhgts", qg[:, i:j], kf[:, :j]).tril(diagonal=i)
        num = torch.einsum("nhgts,nshv->nthgv", A, v[:, :j])
        num = num + torch.einsum("nthgk,nhkv->nthgv", qg[:, i:j], S0)
        if normalize:
            den = A.sum(-1).permute(0, 3, 1, 2)  # [N, t, Hkv, G]
            den = den + torch.einsum("nthgk,nhk->nthg", qg[:, i:j], z0) + eps
            num = num / den.unsqueeze(-1)
        outs.append(num.flatten(2, 3))
    o = torch.cat(outs, dim=1) if outs else qf.new_zeros(N, 0, H, v.shape[-1])
    S = S0 + torch.einsum("nshk,nshv->nhkv", kf, v)
    z = z0 + kf.sum(1) if normalize else None
    return o, S, z


def _recurrent_core(qf, kf, v, S0, z0, *, normalize, eps):
    N, L, H, K = qf.shape
    Hkv = kf.shape[2]
    qg = _group(qf, Hkv)
    S, z = S0, z0
    outs = []
    for t in range(L):
        S = S + kf[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        o_t = torch.einsum("nhgk,nhkv->nhgv", qg[:, t], S)
        if normalize:
            z = z + kf[:, t]
            den = torch.einsum("nhgk,nhk->nhg", qg[:, t], z) + eps
            o_t = o_t / den.unsqueeze(-1)
        outs.append(o_t.flatten(1, 2))
    o = torch.stack(outs, dim=1) if outs else qf.new_zeros(N, 0, H, v.shape[-1])
    return o, S, z


def _chunk_core(qf, kf, v, S0, z0, *, normalize, eps, chunk_size):
    N, L, H, K = qf.shape
    Hkv, V = kf.shape[2], v.shape[-1]
    qg = _group(qf, Hkv)
    G = qg.shape[3]
    S, z = S0, z0
    outs = []
    for i in range(0, L, chunk_size):
        j = min(i + chunk_size, L)
        qc, kc, vc = qg[:, i:j], kf[:, i:j], v[:, i:j]
        # Intra-chunk: the scores of the pairs s <= t only, summed into row t. A masked score times
        # a later token's value (or its gradient times a later key) would carry a non-finite value
        # there into earlier rows, since 0 * NaN = NaN.
        t_idx, s_idx = torch.tril_indices(j - i, j - i, device=qf.device)
        a = (qc[:, t_idx] * kc[:, s_idx].unsqueeze(-2)).sum(-1)  # [N, pairs, Hkv, G]
        num = qf.new_zeros(N, j - i, Hkv, G, V).index_add(1, t_idx, a.unsqueeze(-1) * vc[:, s_idx].unsqueeze(-2))
        num = num + torch.einsum("nthgk,nhkv->nthgv", qc, S)  # inter-chunk, through the state
        if normalize:
            rowsum = qf.new_zeros(N, j - i, Hkv, G).index_add(1, t_idx, a)
            den = rowsum + torch.einsum("nthgk,nhk->nthg", qc, z) + eps
            num = num / den.unsqueeze(-1)
            z = z + kc.sum(1)
        S = S + torch.einsum("nshk,nshv->nhkv", kc, vc)  # state update
        outs.append(num.flatten(2, 3))
    o = torch.cat(outs, dim=1) if outs else qf.new_zeros(N, 0, H, v.shape[-1])
    return o, S, z


_DOC_ARGS = """
    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, Hkv, K]`` keys, ``H % Hkv == 0``.
        v: ``[B, T, Hkv, V]`` values.
        scale: multiplies phi(q); default ``K ** -0.5`` (K after the feature map).
        normalize: divide by ``q'_t . z_t + eps``.
        feature_map: None/"identity", "elu1", "relu" or a callable applied to q and k.
        eps: added to the denominator.
        initial_state: ``(S [N, Hkv, K, V], z [N, Hkv, K] or None)``; cast to the compute dtype.
        output_final_state: return the final state.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences along T (B must be 1).

    Returns:
        ``(o [B, T, H, V] in q's dtype, LinearAttnState(S, z) in the inputs' dtype or None)``.
"""


def parallel_linear_attn(q, k, v, *, scale=None, normalize=True, feature_map=None, eps=1e-6,
                         initial_state=None, output_final_state=False, cu_seqlens=None):
    return _run(_parallel_core, q, k, v, scale=scale, normalize=normalize,
                feature_map=feature_map, eps=eps, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def recurrent_linear_attn(q, k, v, *, scale=None, normalize=True, feature_map=None, eps=1e-6,
                          initial_state=None, output_final_state=False, cu_seqlens=None):
    return _run(_recurrent_core, q, k, v, scale=scale, normalize=normalize,
                feature_map=feature_map, eps=eps, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_linear_attn(q, k, v, *, scale=None, normalize=True, feature_map=None, eps=1e-6,
                      initial_state=None, output_final_state=False, cu_seqlens=None,
                      chunk_size=64):
    chunk_size = as_int(chunk_size, "chunk_size", 1)
    return _run(_chunk_core, q, k, v, scale=scale, normalize=normalize,
                feature_map=feature_map, eps=eps, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                chunk_size=chunk_size)


parallel_linear_attn.__doc__ = (
    "Parallel (masked O(T^2)) form: ``o = ((Q' K'^T) * M) V`` (normalized by the masked row sums"
    " plus the initial-state terms).\n" + _DOC_ARGS
)
recurrent_linear_attn.__doc__ = (
    "Recurrent form: a Python loop over tokens updating ``S``/``z``.\n" + _DOC_ARGS
)
chunk_linear_attn.__doc__ = (
    "Chunkwise form: chunks of ``chunk_size`` tokens (default 64); parallel form inside a chunk,"
    " recurrent state between chunks.\n" + _DOC_ARGS + "        chunk_size: tokens per chunk.\n"
)


def linear_attn_step(q, k, v, state, *, scale=None, normalize=True, feature_map=None, eps=1e-6,
                     state_indices=None):
    """One decode step; updates ``state`` IN PLACE and returns the output.

    Args:
        q: ``[B, H, K]`` or ``[B, 1, H, K]``.
        k: ``[B, Hkv, K]`` or ``[B, 1, Hkv, K]``.
        v: ``[B, Hkv, V]`` or ``[B, 1, Hkv, V]``.
        state: ``(S [P, Hkv, K, V], z [P, Hkv, K] or None)``, a pool of ``P`` rows, updated in
            place (``z`` required when ``normalize``).
        state_indices: optional ``[B]`` int rows of the pool for each batch entry (default
            ``arange(B)``, needs ``P >= B``); a negative index skips the entry (output row zero,
            no state change). Out-of-range or duplicate indices raise ``ValueError``.

    The update ``k'^T v`` is computed in the inputs' dtype and added to the state in the state's
    dtype; the output is computed in the state's dtype and returned in q's dtype, with the rank of
    q (``[B, H, V]`` or ``[B, 1, H, V]``). Not differentiable (runs under ``torch.no_grad``).
    """
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [B, H, K] or [B, 1, H, K], got {tuple(q.shape)}")
    four_d = q.dim() == 4
    if four_d:
        if q.shape[1] != 1 or k.dim() != 4 or v.dim() != 4 or k.shape[1] != 1 or v.shape[1] != 1:
            raise ValueError("4-D step inputs must have T == 1 (q, k, v)")
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    if k.dim() != 3 or v.dim() != 3:
        raise ValueError("k and v must have the rank of q")
    S, z = state
    B, H, _ = q.shape
    Hkv = k.shape[1]
    normalize, eps = as_flag(normalize, "normalize"), as_finite(eps, "eps", minimum=0)
    if normalize and z is None:
        raise ValueError("state z is required when normalize=True")
    P = S.shape[0]
    if state_indices is None:
        if P < B:
            raise ValueError(f"state pool has {P} rows < batch {B}; pass state_indices")
        idx = list(range(B))
    else:
        if state_indices.dim() != 1 or state_indices.shape[0] != B or state_indices.is_floating_point():
            raise ValueError(f"state_indices must be an int tensor [B] = [{B}], got {state_indices.dtype} "
                             f"{tuple(state_indices.shape)}")
        idx = [int(i) for i in state_indices.tolist()]
        used = [i for i in idx if i >= 0]
        if any(i >= P for i in used):
            raise ValueError(f"state_indices out of range [0, {P})")
        if len(set(used)) != len(used):
            raise ValueError("state_indices has duplicate rows")
    with torch.no_grad():
        qf, kf = _features(q, k, scale, feature_map)
        dtype = S.dtype
        o = torch.zeros(B, H, v.shape[-1], dtype=dtype, device=q.device)
        for b, row in enumerate(idx):
            if row < 0:
                continue
            kv = (kf[b].unsqueeze(-1) * v[b].unsqueeze(-2)).to(dtype)  # [Hkv, K, V]
            S[row] += kv
            qg = _group(qf[b], Hkv).to(dtype)  # [Hkv, G, K]
            o_b = torch.einsum("hgk,hkv->hgv", qg, S[row])
            if normalize:
                z[row] += kf[b].to(dtype)
                den = torch.einsum("hgk,hk->hg", qg, z[row]) + eps
                o_b = o_b / den.unsqueeze(-1)
            o[b] = o_b.flatten(0, 1)
        o = o.to(q.dtype)
    return o.unsqueeze(1) if four_d else o
