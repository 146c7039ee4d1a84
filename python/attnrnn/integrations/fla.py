"""fla's linear-attention layers on attnrnn's kernels.

    from attnrnn.integrations.fla import use_attnrnn

    with use_attnrnn():                      # or use_attnrnn() once, for the rest of the program
        loss = model(input_ids, labels=input_ids).loss   # fla.models.LinearAttentionForCausalLM
        out = model.generate(input_ids, max_new_tokens=16)  # fla's cache works as before

`fla.layers.LinearAttention` (flash-linear-attention 0.6.0) calls three functions that
fla/layers/linear_attn.py imports from fla.ops.linear_attn into its own namespace:
chunk_linear_attn, fused_chunk_linear_attn and fused_recurrent_linear_attn (the layer picks
`chunk` whenever grad is enabled, `fused_recurrent` without grad for at most 64 tokens, its
configured mode otherwise). use_attnrnn() sets those three attributes of fla.layers.linear_attn to
the functions of the same names below, which take fla's arguments and return fla's results,
computed by attnrnn.chunk_linear_attn (both chunk modes) and attnrnn.recurrent_linear_attn
(fused_recurrent). fla.ops.linear_attn itself is not touched, nor are fla's other layers (Based
and ReBased expand K past attnrnn's 256).

fla's conventions, as fla/ops/linear_attn/{chunk,fused_chunk,fused_recurrent,utils}.py define them:
- q, k [B, T, H, K] and v [B, T, H, V], attnrnn's layout (fla 0.6.0 has no head_first); the
  layer applies its feature map and repeats k, v over the query heads of a group (GQA) before the
  call, so attnrnn gets feature_map=None and as many k, v heads as q heads.
- scale: default K ** -0.5 (attnrnn's default); it multiplies q in the numerator and in the
  denominator.
- normalize: default True for chunk and fused_chunk, False for fused_recurrent (the layer always
  passes its do_feature_map_norm, default False). Normalized, fla divides the unnormalized output
  by (q * scale * k_cum).sum(-1) + 1e-10 with k_cum the running sum of k plus z_init
  (StatefulNormalizeFunction.forward in utils.py): attnrnn's q'_t S_t / (q'_t . z_t + eps) with
  eps = 1e-10. fla rounds k_cum and the denominator to the input dtype; attnrnn keeps them in
  float32.
- state: S [N, H, K, V] alone with normalize=False; with normalize=True a tuple (S, z) with
  z [N, 1, H, K]. Only a tuple counts as (S, z) (`normalize and isinstance(initial_state, tuple)`):
  a tensor given with normalize=True is S with z0 = 0, and S None in a tuple is S0 = 0.
- the returned state: S in float32 (fla's kernels allocate it so); z in k's dtype
  (chunk_global_cumsum(..., output_dtype=k.dtype)), promoted with z_init's dtype when one is given
  (k_cum + z_init). With normalize=True fla returns (S, z) whatever output_final_state says, S
  None when it is False: so does this.
- cu_seqlens: B = 1, N packed sequences with N state rows; an empty sequence keeps its state.
- reverse (fused_recurrent only): each sequence scanned from its last token to its first.
"""
import importlib
from typing import Optional, Tuple, Union

import torch

import attnrnn

__all__ = [
    "use_attnrnn",
    "is_routed",
    "chunk_linear_attn",
    "fused_chunk_linear_attn",
    "fused_recurrent_linear_attn",
    "FLA_EPS",
]

#: The constant fla adds to the normalizer (fla/ops/linear_attn/utils.py).
FLA_EPS = 1e-10

_LAYER_MODULE = "fla.layers.linear_attn"
_OPS_MODULE = "fla.ops.linear_attn"

FlaState = Union[torch.Tensor, Tuple[Optional[torch.Tensor], torch.Tensor], None]


def _time_reversal(T, cu_seqlens, device):
    """Indices along T that reverse each packed sequence (the whole T when not packed)."""
    t = torch.arange(T, device=device)
    if cu_seqlens is None:
        return t.flip(0)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    seq = torch.searchsorted(cu[1:], t, right=True)  # the sequence of each token; empty ones hold none
    return cu[seq] + cu[seq + 1] - 1 - t


def _linear_attn(op, q, k, v, scale, initial_state, output_final_state, normalize, cu_seqlens, reverse=False):
    """fla's linear attention (arguments and results of fla.ops.linear_attn) computed by op, an
    attnrnn sequence function."""
    if normalize and isinstance(initial_state, tuple):
        S0, z0 = initial_state
    else:
        S0, z0 = initial_state, None
    if S0 is not None and not isinstance(S0, torch.Tensor):
        expected = "a tensor S [N, H, K, V] or a tuple (S, z [N, 1, H, K])" if normalize else "a tensor S [N, H, K, V]"
        raise TypeError(f"initial_state must be {expected} with normalize={normalize}, got {type(S0).__name__}")
    state = None
    if S0 is not None or z0 is not None:
        state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        Hkv, K, V = k.shape[2], k.shape[3], v.shape[3]
        S = q.new_zeros(N, Hkv, K, V, dtype=state_dtype) if S0 is None else S0.to(state_dtype)
        if normalize:
            if z0 is None:
                z = q.new_zeros(N, Hkv, K, dtype=state_dtype)
            elif z0.dim() != 4 or z0.shape[1] != 1:
                raise ValueError(f"initial_state's z must be [N, 1, H, K] (fla's layout), got shape {list(z0.shape)}")
            else:
                z = z0[:, 0].to(state_dtype)
            state = (S, z)
        else:
            state = S
    if reverse:
        order = _time_reversal(q.shape[1], cu_seqlens, q.device)
        q, k, v = (x.index_select(1, order) for x in (q, k, v))
    # normalize=True returns z even without output_final_state (fla does), so the op gives its state
    o, final = op(q, k, v, scale=scale, normalize=normalize, eps=FLA_EPS, initial_state=state,
                  output_final_state=output_final_state or normalize, cu_seqlens=cu_seqlens)
    if reverse:
        o = o.index_select(1, order)
    S_out = final.S if output_final_state else None
    if not normalize:
        return o, S_out
    z_dtype = k.dtype if z0 is None else torch.promote_types(k.dtype, z0.dtype)
    return o, (S_out, final.z.unsqueeze(1).to(z_dtype))


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: FlaState = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: Optional[torch.LongTensor] = None,
) -> Tuple[torch.Tensor, FlaState]:
    """fla.ops.linear_attn.chunk_linear_attn (same signature and results) on attnrnn.chunk_linear_attn."""
    return _linear_attn(attnrnn.chunk_linear_attn, q, k, v, scale, initial_state, output_final_state, normalize,
                        cu_seqlens)


# fla's fused_chunk computes what its chunk does (one kernel instead of two): both are
# attnrnn.chunk_linear_attn here.
fused_chunk_linear_attn = chunk_linear_attn


def fused_recurrent_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: FlaState = None,
    output_final_state: bool = False,
    reverse: bool = False,
    normalize: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
) -> Tuple[torch.Tensor, FlaState]:
    """fla.ops.linear_attn.fused_recurrent_linear_attn (same signature and results; normalize
    defaults to False, as there) on attnrnn.recurrent_linear_attn."""
    return _linear_attn(attnrnn.recurrent_linear_attn, q, k, v, scale, initial_state, output_final_state, normalize,
                        cu_seqlens, reverse)


_ROUTED = {
    "chunk_linear_attn": chunk_linear_attn,
    "fused_chunk_linear_attn": fused_chunk_linear_attn,
    "fused_recurrent_linear_attn": fused_recurrent_linear_attn,
}


def _import_fla(name):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            f"attnrnn.integrations.fla needs flash-linear-attention 0.6 ({name} could not be imported: {e}); "
            "install it with `pip install 'attnrnn[fla]'`") from e


class use_attnrnn:
    """Routes fla's LinearAttention layers to attnrnn's kernels (enabled=True) or to fla's own
    (enabled=False) from this call on.

    Used as a context manager, it puts back on exit the functions fla.layers.linear_attn held
    before the call (so contexts nest); called alone, the routing stays until ``restore()``.
    Raises ImportError when fla cannot be imported.
    """

    def __init__(self, enabled: bool = True):
        self._module = _import_fla(_LAYER_MODULE)
        missing = [name for name in _ROUTED if not hasattr(self._module, name)]
        if missing:
            raise ImportError(f"{_LAYER_MODULE} has no {', '.join(missing)}: this fla is not the 0.6 line that "
                              "attnrnn.integrations.fla maps")
        self._saved = {name: getattr(self._module, name) for name in _ROUTED}
        if enabled:
            routed = _ROUTED
        else:
            fla_ops = _import_fla(_OPS_MODULE)
            routed = {name: getattr(fla_ops, name) for name in _ROUTED}
        for name, fn in routed.items():
            setattr(self._module, name, fn)

    def restore(self) -> None:
        """Puts back what fla.layers.linear_attn held before this call (once; later calls do nothing)."""
        if self._saved is not None:
            for name, fn in self._saved.items():
                setattr(self._module, name, fn)
            self._saved = None

    def __enter__(self) -> "use_attnrnn":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def is_routed() -> bool:
    """Whether fla's LinearAttention layers call attnrnn's kernels now (all three modes)."""
    module = _import_fla(_LAYER_MODULE)
    return all(getattr(module, name, None) is fn for name, fn in _ROUTED.items())
