"""Context parallelism for causal linear attention: one sequence split over the ranks of a group.

Rank r of a ``torch.distributed`` group (NCCL on GPUs, gloo on CPU) holds the contiguous segment r
of the sequence, ``q [B, T_r, H, K]``, ``k [B, T_r, Hkv, K]``, ``v [B, T_r, Hkv, V]`` (T_r may
differ per rank, even 0). Linear attention needs only the state of everything before a segment:

    c_r   = (S_loc(r), z_loc(r)) = (sum_t k'_t^T v_t, sum_t k'_t)      over the segment of rank r
    in_r  = initial_state + sum_{r' < r} c_r'                           (the state entering rank r)
    final = initial_state + sum_{r'} c_r'

and the backward needs only the gradient w.r.t. the state entering every later rank:

    dc_r  = sum_{r' > r} d in_r' + sum_{r'} d final(r')

Schemes (``scheme=``):

* ``"allgather"`` (default): one all-gather of the per-rank contributions c_r, each rank sums the
  prefix it needs; the backward is the adjoint, one reduce-scatter of the suffix gradients. The
  collective is started asynchronously and, with ``combine="local"``, overlaps with the
  intra-segment attention (forward) and its backward.
  The segment's own state is computed first (phi(k)^T v, one [K, T] x [T, V] product per kv
  head, in the state dtype) so that the exchange can start before the attention.
* ``"chain"``: the serial chain: rank r receives in_r from r-1 and sends in_r + c_r to r+1
  (R - 1 hops); the final state is broadcast from the last rank. The backward runs the chain in
  reverse (plus an all-reduce of the final-state gradients). Kept to measure against.

Combining the incoming state with the segment (``combine=``):

* ``"initial_state"`` (default): wait, then run chunk_linear_attn(q, k, v, initial_state=in_r).
  The least work; the exchange is exposed (one all-gather of a state: tens of microseconds on
  NVLink, a few ms on gloo), both forward and backward.
* ``"local"``: while the exchange is in flight, compute the segment's numerator
  n = chunk_linear_attn(q, k, v, normalize=False) with zero initial state; afterwards
  o = (n + q' S_in) / (q' . (z_in + cumsum_t k') + eps) (or n + q' S_in), with q' = scale * phi(q).
  The exchange is hidden behind the segment's attention, forward and backward (the gradient of
  S_in is q'^T do, known before the segment's backward runs), but the correction costs extra
  passes over [T, H, K] and [T, H, V] in the state dtype (+60% forward, +20% forward+backward on
  the CPU kernels): worth it only when the exchange is slower than that (many ranks, across
  nodes).

See docs/context_parallel.md for the cost model and measurements.
"""
from __future__ import annotations

import math
import struct
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._args import MAX_HEAD_DIM, as_finite, as_flag, as_scale, check_feature_map_output
from ._args import resolve_scale as _scale
from .linear_attn import FEATURE_MAPS, FeatureMapArg, LinearAttnState, StateArg, chunk_linear_attn
from .reference import apply_feature_map

__all__ = ["context_parallel_linear_attn", "exchange_bytes", "SCHEMES", "COMBINES"]

SCHEMES = ("allgather", "chain")
COMBINES = ("local", "initial_state")
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

# Fields of the per-rank description exchanged by the validation all-gather (int64 each). "error":
# 0, or one of _ERRORS: what stopped the rank before the state exchange.
_INVALID_ARGUMENTS, _FEATURE_MAP_RAISED = 1, 2
_META = ("error", "B", "T", "H", "Hkv", "K", "V", "dtype", "device_type", "normalize", "feature_map",
         "scale", "eps", "has_initial_state", "output_final_state", "scheme", "combine", "chunk_size",
         "requires_grad")


# ---- collectives (names changed across torch versions) -------------------------------------------

def _all_gather(out, inp, group, async_op):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter(out, inp, group, async_op):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _wait(works):
    for w in works:
        if w is not None:
            w.wait()


# ---- argument checks --------------------------------------------------------------------------------

def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_linear_attn: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group(...) first (group=None means the default group)")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group "
                         "(torch.distributed.new_group returned NON_GROUP_MEMBER here)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group")
    return rank, dist.get_world_size(group)


def _state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _local_check(rank, q, k, v, scale, normalize, feature_map, eps, initial_state, output_final_state,
                 chunk_size, scheme, combine):
    """Validates what one rank can see and applies a callable feature map (whose errors every rank
    must learn of before the state exchange). Returns (the exception or None, meta dict, (S0, z0),
    (q, k, the fused map's name) to run the attention on)."""
    meta = dict.fromkeys(_META, 0)
    S0 = z0 = None
    try:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
        if combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
        for x, name in ((q, "q"), (k, "k"), (v, "v")):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 4:
                raise ValueError(f"{name} must be 4-D [B, T_rank, heads, dim], got shape {list(x.shape)}")
            if x.dtype not in _DTYPES:
                raise ValueError(f"{name} must be float64, float32, float16 or bfloat16, got {x.dtype}")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"q, k, v must have one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
        if k.device != q.device or v.device != q.device:
            raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
        B, T, H, K = q.shape
        if tuple(k.shape[:2]) != (B, T) or tuple(v.shape[:2]) != (B, T):
            raise ValueError(f"k and v must have q's batch and length [B, T_rank] = {[B, T]}, got k "
                             f"{list(k.shape)}, v {list(v.shape)}")
        Hkv, V = v.shape[2], v.shape[3]
        if k.shape[2] != Hkv or Hkv == 0 or H % Hkv != 0:
            raise ValueError(f"k and v heads ({k.shape[2]}, {Hkv}) must be equal and divide q's heads ({H})")
        if k.shape[3] != K:
            raise ValueError(f"k head dim must equal q's (K = {K}), got {k.shape[3]}")
        if feature_map is not None and not callable(feature_map) and feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, a callable or None, got {feature_map!r}")
        for x, name in ((q, "q"), (k, "k"), (v, "v")):
            if x.numel() and x.shape[-1] > 1 and x.stride(-1) != 1:
                raise ValueError(f"{name} must have unit stride in its last dimension, got strides {list(x.stride())}")
        if V > MAX_HEAD_DIM:
            raise ValueError(f"v head dim V must be in [1, {MAX_HEAD_DIM}], got {V}")
        as_scale(scale)
        as_finite(eps, "eps", minimum=0)
        as_flag(normalize, "normalize")
        as_flag(output_final_state, "output_final_state")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or not 1 <= chunk_size <= 1024):
            raise ValueError(f"chunk_size must be an int in [1, 1024] or None, got {chunk_size!r}")
        if not callable(feature_map) and K > MAX_HEAD_DIM:
            raise ValueError(f"q and k head dim K must be in [1, {MAX_HEAD_DIM}], got {K}")
        sdt = _state_dtype(q.dtype)
        if initial_state is not None:
            if rank != 0:
                raise ValueError(f"initial_state is rank 0's input (the state before the whole sequence); "
                                 f"it must be None on rank {rank}")
            if isinstance(initial_state, torch.Tensor):
                S0, z0 = initial_state, None
            elif isinstance(initial_state, Sequence) and len(initial_state) == 2:
                S0, z0 = initial_state
            else:
                raise ValueError("initial_state must be a LinearAttnState (S, z), a tuple (S, z) or a tensor S")
            if normalize and z0 is None:
                raise ValueError("initial_state.z [B, Hkv, K] is required with normalize=True")
            if not normalize and z0 is not None:
                raise ValueError("initial_state.z must be None with normalize=False")
            for x, name, shape in ((S0, "initial_state.S", (B, Hkv, K, V)), (z0, "initial_state.z", (B, Hkv, K))):
                if x is None:
                    continue
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
                if tuple(x.shape) != shape:
                    raise ValueError(f"{name} must be {list(shape)}, got {list(x.shape)}")
                if x.dtype != sdt:
                    raise ValueError(f"{name} must be {sdt} (the state dtype for {q.dtype} inputs), got {x.dtype}")
                if x.device != q.device:
                    raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
        fm = len(FEATURE_MAPS) if callable(feature_map) else FEATURE_MAPS.index(feature_map or "identity")
        meta.update(B=B, T=T, H=H, Hkv=Hkv, K=K, V=V, dtype=_DTYPES.index(q.dtype),
                    device_type=0 if q.device.type == "cpu" else 1, normalize=int(bool(normalize)),
                    feature_map=fm, scale=_float_bits(_scale(scale, K)),
                    eps=_float_bits(eps), has_initial_state=int(initial_state is not None),
                    output_final_state=int(bool(output_final_state)), scheme=SCHEMES.index(scheme),
                    combine=COMBINES.index(combine), chunk_size=chunk_size or 0,
                    requires_grad=int(torch.is_grad_enabled() and any(
                        x is not None and x.requires_grad for x in (q, k, v, S0, z0))))
    except (ValueError, TypeError) as e:
        meta["error"] = _INVALID_ARGUMENTS
        return e, meta, (None, None), None
    if not callable(feature_map):
        return None, meta, (S0, z0), (q, k, feature_map or "identity")
    try:
        fq, fk = feature_map(q), feature_map(k)
    except Exception as e:  # noqa: BLE001  (a user's callable may raise anything; every rank must hear of it)
        meta["error"] = _FEATURE_MAP_RAISED
        return e, meta, (None, None), None
    try:
        check_feature_map_output(fq, q, "feature_map(q)")
        check_feature_map_output(fk, k, "feature_map(k)")
        if fk.shape[-1] != fq.shape[-1] or not 1 <= fq.shape[-1] <= MAX_HEAD_DIM:
            raise ValueError(f"feature_map must map q and k to one feature dim in [1, {MAX_HEAD_DIM}], got "
                             f"{fq.shape[-1]} and {fk.shape[-1]}")
    except (ValueError, TypeError) as e:
        meta["error"] = _INVALID_ARGUMENTS
        return e, meta, (None, None), None
    return None, meta, (S0, z0), (fq, fk, "identity")


def _meta_device(group, q):
    backend = dist.get_backend(group)
    if backend == "nccl" or (backend != "gloo" and isinstance(q, torch.Tensor) and q.is_cuda):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_meta(meta, group, world, device) -> List[dict]:
    local = torch.tensor([meta[f] for f in _META], dtype=torch.int64, device=device)
    out = torch.empty(world * len(_META), dtype=torch.int64, device=device)
    _all_gather(out, local, group, False)
    rows = out.view(world, len(_META)).cpu().tolist()
    return [dict(zip(_META, row)) for row in rows]


_AGREE = (  # field, argument named in the error, what it is
    ("B", "q", "batch size B"), ("H", "q", "number of query heads H"), ("Hkv", "k", "number of kv heads Hkv"),
    ("K", "q", "head dim K"), ("V", "v", "head dim V"), ("dtype", "q", "dtype"),
    ("device_type", "q", "device type"), ("normalize", "normalize", "value"),
    ("feature_map", "feature_map", "kind"), ("scale", "scale", "value"), ("eps", "eps", "value"),
    ("output_final_state", "output_final_state", "value"), ("scheme", "scheme", "value"),
    ("combine", "combine", "value"), ("chunk_size", "chunk_size", "value"),
)


def _check_group(metas, rank, local_error):
    bad = [r for r, m in enumerate(metas) if m["error"]]
    if bad:
        if local_error is not None and metas[rank]["error"] == _FEATURE_MAP_RAISED:
            raise local_error  # the callable's own error, as it raised it
        if local_error is not None:
            raise type(local_error)(f"{local_error} (on rank {rank} of the group)") from None
        invalid = [r for r in bad if metas[r]["error"] == _INVALID_ARGUMENTS]
        raised = [r for r in bad if metas[r]["error"] == _FEATURE_MAP_RAISED]
        what = ([f"invalid arguments on rank(s) {invalid}"] if invalid else []) + (
            [f"feature_map raised on rank(s) {raised}"] if raised else [])
        raise ValueError(f"context_parallel_linear_attn: {' and '.join(what)} of the group (see the error raised "
                         "there); every rank stops")
    for field, arg, what in _AGREE:
        vals = [m[field] for m in metas]
        if len(set(vals)) > 1:
            if field in ("scale", "eps"):
                # scale is compared resolved (None -> K ** -0.5), so None and an equal number agree.
                vals = [struct.unpack("<d", struct.pack("<q", x))[0] for x in vals]
            elif field == "dtype":
                vals = [str(_DTYPES[x]).replace("torch.", "") for x in vals]
            raise ValueError(f"{arg}: the {what} must be the same on every rank of the group, got "
                             f"{vals} on ranks 0..{len(vals) - 1}")
    holders = [r for r, m in enumerate(metas) if m["has_initial_state"]]
    if holders and holders != [0]:
        raise ValueError(f"initial_state must be given on rank 0 only, got it on ranks {holders}")
    return any(m["requires_grad"] for m in metas)


# ---- the state exchange as two autograd nodes: start (forward) / finish ------------------------------
#
# _Start.forward launches the collective on the packed contributions c [P] and returns a token;
# _Finish.forward waits and returns (in_r, final) packed. In the backward the roles swap:
# _Finish.backward launches the collective on the incoming gradients and _Start.backward waits for
# it, so the autograd engine can run the segment's own backward in between (combine="local").

class _Exchange:
    """Shared between the two nodes of one call: group, scheme and the in-flight work."""

    def __init__(self, group, rank, world, scheme, with_final):
        self.group, self.rank, self.world, self.scheme, self.with_final = group, rank, world, scheme, with_final
        self.works: list = []
        self.buf = None
        self.result = None

    def peer(self, r):
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    # forward ------------------------------------------------------------------------------------------
    def start_forward(self, c):
        R, r = self.world, self.rank
        if self.scheme == "allgather":
            self.buf = c.new_empty(R * c.numel())
            self.works = [_all_gather(self.buf, c, self.group, True)]
            return
        incoming = torch.zeros_like(c)
        if r > 0:
            dist.recv(incoming, self.peer(r - 1), group=self.group)
        out = incoming + c
        self.works = []
        if r < R - 1:
            self.works.append(dist.isend(out, self.peer(r + 1), group=self.group))
        final = out if r == R - 1 else torch.empty_like(c)
        if self.with_final:
            self.works.append(dist.broadcast(final, self.peer(R - 1), group=self.group, async_op=True))
        self.buf = (incoming, final, out)

    def finish_forward(self):
        _wait(self.works)
        self.works = []
        if self.scheme == "allgather":
            rows = self.buf.view(self.world, -1)
            incoming = rows[: self.rank].sum(0)
            final = rows.sum(0) if self.with_final else None
        else:
            incoming, final, _ = self.buf
            final = final if self.with_final else None
        self.buf = None
        return incoming, final

    # backward -----------------------------------------------------------------------------------------
    def start_backward(self, g_in, g_fin):
        R, r = self.world, self.rank
        if self.scheme == "allgather":
            # Adjoint of the all-gather + prefix sum: row r' of this rank's gradient is g_in for the
            # ranks before it (r' < r) plus g_fin for all; a reduce-scatter sums the rows of all ranks.
            rows = g_in.new_zeros(R, g_in.numel())
            rows[:r] = g_in
            if g_fin is not None:
                rows += g_fin
            self.result = g_in.new_empty(g_in.numel())
            self.works = [_reduce_scatter(self.result, rows.view(-1), self.group, True)]
            return
        self.works = []
        total_fin = None
        if self.with_final:
            total_fin = g_fin.clone() if g_fin is not None else torch.zeros_like(g_in)
            self.works.append(dist.all_reduce(total_fin, group=self.group, async_op=True))
        after = torch.zeros_like(g_in)  # sum of g_in over the ranks after this one
        if r < R - 1:
            dist.recv(after, self.peer(r + 1), group=self.group)
        if r > 0:
            self.works.append(dist.isend(after + g_in, self.peer(r - 1), group=self.group))
        self.result = (after, total_fin)

    def finish_backward(self):
        _wait(self.works)
        self.works = []
        res, self.result = self.result, None
        if self.scheme == "allgather":
            return res
        after, total_fin = res
        return after if total_fin is None else after + total_fin


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, c, ex):
        ctx.ex = ex
        ex.start_forward(c.detach().contiguous())
        return c.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        return ctx.ex.finish_backward(), None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, ex):
        ctx.ex = ex
        ctx.token_meta = (token.dtype, token.device)
        incoming, final = ex.finish_forward()
        if final is None:
            return incoming, incoming.new_empty(0)
        return incoming, final

    @staticmethod
    def backward(ctx, g_in, g_fin):
        ex = ctx.ex
        g_in = g_in.contiguous()
        g_fin = g_fin.contiguous() if (ex.with_final and g_fin is not None and g_fin.numel()) else None
        ex.start_backward(g_in, g_fin)
        dtype, device = ctx.token_meta
        return torch.empty(0, dtype=dtype, device=device), None


# ---- the op ------------------------------------------------------------------------------------------

# The products of _HalfSegmentState, in one place (tests substitute CPU versions of them):
# fp32 output from bf16/fp16 batches (CUDA only), and c + a @ b in the inputs' dtype.
def _bmm_fp32(a, b):
    return torch.bmm(a, b, out_dtype=torch.float32)


def _bmm_acc(c, a, b):
    return torch.baddbmm(c, a, b)


def _split_half(x, dtype):
    """x (fp32) as hi + lo in `dtype`: the pair carries x to ~2^-16 relative, so products with it
    keep the fp32 state's precision."""
    hi = x.to(dtype)
    return hi, (x - hi.float()).to(dtype)


def _dphi(k, fm):
    """phi'(k) in k's dtype, or None for the identity."""
    if fm == "elu1":
        return torch.where(k > 0, torch.ones((), dtype=k.dtype, device=k.device), torch.exp(k))
    if fm == "relu":
        return (k > 0).to(k.dtype)
    return None


class _HalfSegmentState(torch.autograd.Function):
    """(S_loc, z_loc) = (sum_t k'_t^T v_t, sum_t k'_t), k' = phi(k), of a bf16/fp16 segment on
    CUDA: fp32 state out of tensor-core products (fp32 accumulation), k' recomputed in the
    backward instead of kept. On the H200 (B1 T131072 H16 D128) the fp32 einsum over fp32 copies
    of k' and v cost more than the segment's attention itself.
    Backward: dk = phi'(k) (v dS^T + dz), dv = k' dS, with dS as bf16 hi + lo (two products summed
    by cuBLAS in fp32, one rounding), in the input dtype: no fp32 [T, K] temporaries."""

    @staticmethod
    def forward(ctx, k, v, fm, with_z):
        B, T, Hkv, K = k.shape
        V = v.shape[3]
        kf = apply_feature_map(k, fm)
        S = _bmm_fp32(kf.permute(0, 2, 3, 1).reshape(B * Hkv, K, T),
                      v.permute(0, 2, 1, 3).reshape(B * Hkv, T, V)).view(B, Hkv, K, V)
        z = kf.sum(1, dtype=torch.float32) if with_z else S.new_zeros(())
        ctx.fm = fm
        ctx.save_for_backward(k, v)
        return S, z

    @staticmethod
    def backward(ctx, dS, dz):
        k, v = ctx.saved_tensors
        B, T, Hkv, K = k.shape
        V = v.shape[3]
        hi, lo = _split_half(dS.float().reshape(B * Hkv, K, V), k.dtype)
        dk = dv = None
        if ctx.needs_input_grad[0]:
            vt = v.permute(0, 2, 1, 3).reshape(B * Hkv, T, V)
            g = _bmm_acc(torch.bmm(vt, lo.transpose(1, 2)), vt, hi.transpose(1, 2))  # [BH, T, K]
            dk = g.view(B, Hkv, T, K).permute(0, 2, 1, 3)
            if dz is not None and dz.dim() == 3:
                dk = dk + dz.to(k.dtype).unsqueeze(1)
            d = _dphi(k, ctx.fm)
            if d is not None:
                dk = dk * d
        if ctx.needs_input_grad[1]:
            kt = apply_feature_map(k, ctx.fm).permute(0, 2, 1, 3).reshape(B * Hkv, T, K)
            g = _bmm_acc(torch.bmm(kt, lo), kt, hi)  # [BH, T, V]
            dv = g.view(B, Hkv, T, V).permute(0, 2, 1, 3)
        return dk, dv, None, None


def _segment_state(k, v, fm, normalize):
    """The segment's own state (S_loc, z_loc or None) in the state dtype."""
    if k.is_cuda and k.dtype in (torch.bfloat16, torch.float16):
        S, z = _HalfSegmentState.apply(k, v, fm, normalize)
        return S, (z if normalize else None)
    sdt = _state_dtype(k.dtype)
    kf = apply_feature_map(k.to(sdt), fm)
    return torch.einsum("btjk,btjv->bjkv", kf, v.to(sdt)), (kf.sum(1) if normalize else None)


def context_parallel_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    scale: Optional[float] = None,
    normalize: bool = True,
    feature_map: FeatureMapArg = None,
    eps: float = 1e-6,
    initial_state: StateArg = None,
    output_final_state: bool = False,
    chunk_size: Optional[int] = None,
    scheme: str = "allgather",
    combine: str = "initial_state",
    validate: bool = True,
) -> Tuple[torch.Tensor, Optional[LinearAttnState]]:
    """Causal linear attention over a sequence split along T across the ranks of ``group``.

    Every rank of the group calls this collectively, in the same order, with its own contiguous
    segment (rank order = sequence order). The result equals :func:`attnrnn.chunk_linear_attn` on
    the concatenated sequence, forward and backward.

    Args:
        q: [B, T_rank, H, K]; k: [B, T_rank, Hkv, K]; v: [B, T_rank, Hkv, V] (GQA: Hkv divides H).
            T_rank may differ per rank (even 0); B, H, Hkv, K, V, dtype must agree on all ranks.
        group: the process group (None: the default group). NCCL for CUDA tensors, gloo for CPU.
        scale, normalize, feature_map, eps, chunk_size: as in chunk_linear_attn; the same on
            every rank (a callable feature_map is applied to q and k on each rank).
        initial_state: the state before the whole sequence, (S [B, Hkv, K, V], z [B, Hkv, K]) in
            the state dtype; rank 0's input only (None on the other ranks). Differentiable.
        output_final_state: return the state after the last rank's segment, on **every** rank
            (the same value everywhere). Its gradient is the sum over ranks of the gradients
            that reach it on each rank (the global loss is the sum of the ranks' losses).
        scheme: "allgather" (one all-gather forward, one reduce-scatter backward) or "chain"
            (serial send/recv over the ranks), see the module docstring.
        combine: "initial_state" (chunk_linear_attn with the incoming state after the exchange)
            or "local" (the segment's attention runs while the state is in flight, then a
            correction q' S_in), see the module docstring.
        validate: all-gather a small description of every rank's arguments first, so that a
            mismatch raises the same clear error on every rank instead of hanging or computing
            garbage; a callable feature_map runs before it, so that if it raises on one rank (any
            exception), that rank raises it and every other rank a ValueError naming that rank.
            Costs one tiny collective (and a device-to-host copy on CUDA) per call. With
            validate=False nothing is exchanged first: an error on one rank leaves the others
            waiting in the state exchange until the group's timeout.

    Returns:
        o [B, T_rank, H, V] in q's dtype, and the final LinearAttnState or None.

    Backward: every rank must run the backward of this call (the loss of each rank must depend on
    its o or the final state; add ``0 * o.sum()`` otherwise), in the same order as the forward
    calls, as with DistributedDataParallel: the backward exchanges the state gradients.
    """
    rank, world = _group_info(group)
    err, meta, (S_init, z_init), mapped = _local_check(rank, q, k, v, scale, normalize, feature_map, eps,
                                                       initial_state, output_final_state, chunk_size, scheme,
                                                       combine)
    if validate:
        metas = _gather_meta(meta, group, world, _meta_device(group, q))
        any_grad = _check_group(metas, rank, err)
    else:
        if err is not None:
            raise err
        any_grad = bool(meta["requires_grad"])

    q, k, fm = mapped
    B, T, H, K = q.shape
    Hkv, V = v.shape[2], v.shape[3]
    sdt = _state_dtype(q.dtype)
    sc = _scale(scale, K)
    G = H // Hkv

    # 1. The segment's own state (S_loc, z_loc): one [K, T] x [T, V] product per kv head, in the state dtype.
    S_loc, z_loc = _segment_state(k, v, fm, normalize)
    parts = [S_loc.reshape(-1)]
    if normalize:
        parts.append(z_loc.reshape(-1))
    c = torch.cat(parts)
    init = None
    if S_init is not None:
        init = torch.cat([S_init.reshape(-1)] + ([z_init.reshape(-1)] if normalize else []))
        c = c + init
    if any_grad and not c.requires_grad:
        c = c.detach().requires_grad_()  # keep this rank in the backward exchange

    # 2. Start the exchange.
    ex = _Exchange(group, rank, world, scheme, bool(output_final_state))
    token = _Start.apply(c, ex)

    # 3. While it is in flight: the segment's attention with zero incoming state (combine="local").
    n_loc = None
    if combine == "local":
        n_loc, _ = chunk_linear_attn(q, k, v, scale=sc, normalize=False, feature_map=fm, chunk_size=chunk_size)

    # 4. Finish the exchange: the state entering this rank, and the final state.
    incoming, final = _Finish.apply(token, ex)
    if init is not None:
        incoming = incoming + init
    nS = B * Hkv * K * V
    S_in = incoming[:nS].view(B, Hkv, K, V)
    z_in = incoming[nS:].view(B, Hkv, K) if normalize else None

    # 5. The output.
    if combine == "initial_state":
        o, _ = chunk_linear_attn(q, k, v, scale=sc, normalize=normalize, feature_map=fm, eps=eps,
                                 initial_state=(S_in, z_in), chunk_size=chunk_size)
    else:
        qf = (apply_feature_map(q.to(sdt), fm) * sc).view(B, T, Hkv, G, K)
        num = n_loc.to(sdt).view(B, T, Hkv, G, V) + torch.einsum("btjgk,bjkv->btjgv", qf, S_in)
        if normalize:
            zc = apply_feature_map(k.to(sdt), fm).cumsum(1) + z_in.unsqueeze(1)  # [B, T, Hkv, K]: z_t of the whole sequence
            den = torch.einsum("btjgk,btjk->btjg", qf, zc) + eps
            num = num / den.unsqueeze(-1)
        o = num.reshape(B, T, H, V).to(q.dtype)

    if not output_final_state:
        return o, None
    S_fin = final[:nS].view(B, Hkv, K, V)
    z_fin = final[nS:].view(B, Hkv, K) if normalize else None
    return o, LinearAttnState(S_fin, z_fin)


def exchange_bytes(B: int, Hkv: int, K: int, V: int, world: int, *, normalize: bool = True,
                   output_final_state: bool = True, scheme: str = "allgather", state_bytes: int = 4) -> dict:
    """Bytes each rank sends (payload, ring algorithms) per call, forward and backward.

    P = B * Hkv * (K * V + K) * state_bytes (without z: K * V) is one packed state.
    allgather: forward all-gather (R - 1) * P; backward reduce-scatter (R - 1) * P.
    chain: forward one send of P (not the last rank) + a broadcast of the final state (P on
    average per rank for a ring/tree); backward one send of P (not rank 0) + an all-reduce of the
    final-state gradient (2 (R - 1) / R * P).
    """
    P = B * Hkv * (K * V + (K if normalize else 0)) * state_bytes
    R = world
    if R <= 1:
        return {"state_bytes": P, "forward": 0, "backward": 0}
    if scheme == "allgather":
        fwd = bwd = (R - 1) * P
    else:
        fwd = P * (R - 1) / R + (P * (R - 1) / R if output_final_state else 0)
        bwd = P * (R - 1) / R + (2 * (R - 1) / R * P if output_final_state else 0)
    return {"state_bytes": P, "forward": int(fwd), "backward": int(bwd)}
