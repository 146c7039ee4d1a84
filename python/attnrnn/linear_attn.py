"""Causal linear attention as an RNN: the public functions over torch.ops.attnrnn.

Shapes: q [B, T, H, K], k [B, T, Hkv, K], v [B, T, Hkv, V] (Hkv divides H: query head h reads
key/value head h // (H // Hkv)); any strides with unit stride on the last dimension; float64,
float32, float16 or bfloat16, all three the same. The state is S [N, Hkv, K, V] and z [N, Hkv, K]
in float32 (float64 for float64 inputs), N = B or the number of packed sequences.

With q' = scale * phi(q) and k' = phi(k):
    S_t = S_{t-1} + k'_t^T v_t,   z_t = z_{t-1} + k'_t,
    o_t = q'_t S_t / (q'_t . z_t + eps)   (normalize=True)   or   q'_t S_t.
"""
from typing import Callable, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import _ops
from ._ops import ops
from ._args import as_flag as _flag, as_int as _int, as_real as _real, check_feature_map_output
from ._args import check_tensor as _check_tensor, scale_of as _scale_of

FEATURE_MAPS = ("identity", "elu1", "relu")
FeatureMapArg = Union[None, str, Callable[[torch.Tensor], torch.Tensor]]


class LinearAttnState(NamedTuple):
    """The recurrent state: S [N, Hkv, K, V] and z [N, Hkv, K] (None when normalize=False)."""

    S: torch.Tensor
    z: Optional[torch.Tensor] = None


StateArg = Union[None, LinearAttnState, Tuple[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def _feature_map(q, k, feature_map):
    """Applies a callable feature map in Python; returns (q, k, the fused map's name)."""
    if feature_map is None:
        return q, k, "identity"
    if isinstance(feature_map, str):
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, a callable or None, got '{feature_map}'")
        return q, k, feature_map
    if callable(feature_map):
        fq, fk = feature_map(q), feature_map(k)
        check_feature_map_output(fq, q, "feature_map(q)")
        check_feature_map_output(fk, k, "feature_map(k)")
        return fq, fk, "identity"
    raise TypeError(f"feature_map must be one of {FEATURE_MAPS}, a callable or None, got {type(feature_map).__name__} "
                    f"{feature_map!r}")


def _split_state(state, normalize, name):
    if state is None:
        return None, None
    if isinstance(state, torch.Tensor):
        S, z = state, None
    elif (type(state) is LinearAttnState or type(state) is tuple  # the common call: no ABC check
          or isinstance(state, Sequence)) and len(state) == 2:
        S, z = state
    else:
        raise ValueError(f"{name} must be a LinearAttnState (S, z), a tuple (S, z) or a tensor S")
    if not isinstance(S, torch.Tensor):
        _check_tensor(S, f"{name}.S")
    if normalize and z is None:
        raise ValueError(f"{name}.z [N, Hkv, K] is required with normalize=True")
    if not normalize and z is not None:
        raise ValueError(f"{name}.z must be None with normalize=False")
    if z is not None and not isinstance(z, torch.Tensor):
        _check_tensor(z, f"{name}.z")
    return S, z


def _sequence_op(fwd, q, k, v, scale, normalize, feature_map, eps, initial_state, output_final_state,
                 cu_seqlens, *extra):
    # The common call (plain tensors, no state, no feature map) takes no helper: on an idle GPU the
    # host's time before the launch is part of the call's time.
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        for x, name in ((q, "q"), (k, "k"), (v, "v")):
            _check_tensor(x, name)
    if cu_seqlens is not None:
        _check_tensor(cu_seqlens, "cu_seqlens")
    normalize = _flag(normalize, "normalize")
    fm = "identity"
    if feature_map is not None:
        q, k, fm = _feature_map(q, k, feature_map)
    S0 = z0 = None
    if initial_state is not None:
        S0, z0 = _split_state(initial_state, normalize, "initial_state")
    # chunk_fwd also returns what it saved for the backward (empty here: autograd asks for it itself)
    out = fwd(q, k, v, S0, z0, cu_seqlens, _scale_of(scale, q), _real(eps, "eps"), fm, normalize,
              _flag(output_final_state, "output_final_state"), *extra)
    if not output_final_state:
        return out[0], None
    return out[0], LinearAttnState(out[1], out[2] if normalize else None)


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    normalize: bool = True,
    feature_map: FeatureMapArg = None,
    eps: float = 1e-6,
    initial_state: StateArg = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[LinearAttnState]]:
    """Causal linear attention in chunkwise form (training and prefill).

    Args:
        q: [B, T, H, K]; k: [B, T, Hkv, K]; v: [B, T, Hkv, V]; one floating dtype.
        scale: multiplies phi(q); default K ** -0.5.
        normalize: divide by q'_t . z_t + eps (Katharopoulos et al.) or not.
        feature_map: None/"identity", "elu1" (elu(x) + 1), "relu" (fused into the kernels), or a
            callable applied to q and k in Python first.
        eps: added to the denominator in float32 (float64 for float64 inputs).
        initial_state: LinearAttnState or (S, z) with S [N, Hkv, K, V], z [N, Hkv, K] (z only with
            normalize) in the state dtype; gradients flow into it.
        output_final_state: also return the state after the last token (differentiable).
        cu_seqlens: int32/int64 [N + 1] offsets packing N sequences along T (B must be 1).
        chunk_size: tokens per chunk, 1..1024; None lets the kernel choose.

    Returns:
        o [B, T, H, V] in q's dtype, and the final LinearAttnState or None.
    """
    chunk = 0 if chunk_size is None else _int(chunk_size, "chunk_size", 1, 1024)
    return _sequence_op(_ops.chunk_fwd, q, k, v, scale, normalize, feature_map, eps, initial_state,
                        output_final_state, cu_seqlens, chunk, False)


def recurrent_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    normalize: bool = True,
    feature_map: FeatureMapArg = None,
    eps: float = 1e-6,
    initial_state: StateArg = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[LinearAttnState]]:
    """Causal linear attention as the RNN computes it, every product in fp32 (fp64 for float64); same
    arguments and results as :func:`chunk_linear_attn` without ``chunk_size``. For short sequences
    and exact fp32 products; at long T, :func:`chunk_linear_attn` is the fast form on CUDA."""
    return _sequence_op(ops.recurrent_fwd.default, q, k, v, scale, normalize, feature_map, eps, initial_state,
                        output_final_state, cu_seqlens)


def linear_attn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: Union[LinearAttnState, Tuple[torch.Tensor, Optional[torch.Tensor]]],
    *,
    scale: Optional[float] = None,
    normalize: bool = True,
    feature_map: FeatureMapArg = None,
    eps: float = 1e-6,
    state_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One decoding step per sequence; updates ``state`` in place.

    Args:
        q: [B, H, K] or [B, 1, H, K]; k: [B, Hkv, K] or [B, 1, Hkv, K]; v likewise with V.
        state: (S, z) with S [P, Hkv, K, V] and z [P, Hkv, K] (z only with normalize), contiguous,
            float32 (float64 for float64 inputs): a pool of P >= B rows.
        state_indices: optional int32/int64 [B]: the pool row of each batch entry; a negative
            index skips the entry (its output is zero and no row changes). Indices must be
            distinct and < P. On CPU a duplicate raises ValueError; on CUDA (where checking would
            need a host sync) the rows sharing an index get NaN outputs and the pool row is
            updated once, by the first of them. Likewise an index >= P raises ValueError on CPU
            and gives NaN outputs, changing no row, on CUDA. Without it, entry b uses row b.
        scale, normalize, feature_map, eps: as in :func:`chunk_linear_attn`.

    Returns:
        o [B, H, V] (or [B, 1, H, V] for 4-D inputs) in q's dtype.

    The step is an inference op: it is not differentiable (use recurrent_linear_attn with
    initial_state for gradients through decoding).
    """
    # The common call (plain tensors, a state tuple, no feature map) takes the fewest Python steps:
    # on an idle GPU the host's time before the launch is part of each decoding step's time.
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        for x, name in ((q, "q"), (k, "k"), (v, "v")):
            _check_tensor(x, name)
    grad = torch.is_grad_enabled()
    if grad and (q.requires_grad or k.requires_grad or v.requires_grad):
        name = "q" if q.requires_grad else "k" if k.requires_grad else "v"
        raise ValueError(
            f"{name} requires grad, but linear_attn_step updates the state in place and is not differentiable; "
            "run it under torch.no_grad(), or use recurrent_linear_attn or chunk_linear_attn with initial_state "
            "for gradients")
    rank = q.dim()
    four_d = rank == 4
    if four_d:
        for x, name in ((q, "q"), (k, "k"), (v, "v")):
            if x.dim() != 4 or x.shape[1] != 1:
                raise ValueError(f"{name} must be [B, 1, heads, dim] (one token) when q is 4-D, got shape "
                                 f"{list(x.shape)}")
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    elif rank != 3:
        raise ValueError(f"q must be [B, H, K] or [B, 1, H, K], got shape {list(q.shape)}")
    if state_indices is not None:
        _check_tensor(state_indices, "state_indices")
    normalize = _flag(normalize, "normalize")
    S, z = _split_state(state, normalize, "state")
    if grad:
        for x, name in ((S, "state.S"), (z, "state.z")):
            if x is not None and x.requires_grad:
                raise ValueError(
                    f"linear_attn_step updates the state in place and is not differentiable, but {name} "
                    "requires grad; pass a detached state (or run under torch.no_grad()), or use "
                    "recurrent_linear_attn or chunk_linear_attn with initial_state for gradients")
    fm = "identity"
    if feature_map is not None:
        q, k, fm = _feature_map(q, k, feature_map)
    o = _ops.step(q, k, v, S, z, state_indices, _scale_of(scale, q), _real(eps, "eps"), fm, normalize)
    return o.unsqueeze(1) if four_d else o
