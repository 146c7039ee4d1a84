"""Fake kernels of the torch.ops.attnrnn operators (defined in csrc/torch), and the eager calls
the public functions use (chunk_fwd, step: attnrnn._C's typed call, else the operator).

The linear-attention ops' autograd is in C++ (csrc/torch/autograd.cpp, at the Autograd key), so
that a training step runs no Python between its kernels; the softmax ops' autograd is in
attnrnn/softmax/_ops.py and uses no_double_backward below.

The fake kernels check what they index (ranks of q, k, v; cu_seqlens) and raise the ValueError
of the real op, so that tracing fails as eager does instead of with an unpacking error.
"""
import torch

from . import _C  # loads the operator registrations; holds the eager calls

ops = torch.ops.attnrnn


def _eager(op, typed_call):
    """op's call for the public functions: attnrnn._C's typed call of the same operator (less host
    time per call than torch.ops' boxing, csrc/torch/module.cpp), or op itself while torch.compile
    traces and for whatever the typed call returns NotImplemented (tensor subclasses,
    __torch_function__ modes)."""
    def call(*args):
        if not torch.compiler.is_compiling():
            out = typed_call(*args)
            if out is not NotImplemented:
                return out
        return op(*args)
    return call


chunk_fwd = _eager(ops.chunk_fwd.default, _C.chunk_fwd)
step = _eager(ops.step.default, _C.step)


def state_dtype(q):
    """The state and accumulator dtype of an op on q: float64 for float64 inputs, else float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _num_states(q, cu_seqlens):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


_LAYOUTS = {"q": "[B, T, H, K]", "k": "[B, T, Hkv, K]", "v": "[B, T, Hkv, V]"}


def fake_check_rank(t, rank, op, name, layout):
    """The ValueError of csrc/torch/checks.h check_rank, for fake kernels."""
    if t.dim() != rank:
        raise ValueError(f"{op}: {name} must be a {rank}-D tensor {layout}, got shape {list(t.shape)}")


def fake_check_cu_seqlens(cu_seqlens, op):
    """The shape part of csrc/torch/checks.h checked_cu_seqlens, for fake kernels."""
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1):
        raise ValueError(f"{op}: cu_seqlens must be a 1-D tensor [N + 1], got shape {list(cu_seqlens.shape)}")


def fake_check_devices(op, q, tensors):
    """The ValueError of csrc/torch/checks.h check_same_device for each {name: tensor or None}, for
    fake kernels: a meta tensor among real ones dispatches to the fake kernel, which would otherwise
    hand back uninitialized memory where the real op refuses the mix."""
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{op}: {name} must be on the device of q ({q.device}), got {t.device}")


def _check_sequence_args(q, k, v, cu_seqlens, op, others=None):
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        fake_check_rank(t, 4, op, name, _LAYOUTS[name])
    fake_check_cu_seqlens(cu_seqlens, op)
    fake_check_devices(op, q, {"k": k, "v": v, "cu_seqlens": cu_seqlens, **(others or {})})


def _fake_forward(q, k, v, initial_S, initial_z, cu_seqlens, normalize, output_final_state, op):
    _check_sequence_args(q, k, v, cu_seqlens, op, {"initial_state.S": initial_S, "initial_state.z": initial_z})
    B, T, H, K = q.shape
    Hkv, V = v.shape[2], v.shape[3]
    N = _num_states(q, cu_seqlens)
    dt = state_dtype(q)
    o = q.new_empty((B, T, H, V))
    S = q.new_empty((N, Hkv, K, V) if output_final_state else (0,), dtype=dt)
    z = q.new_empty((N, Hkv, K) if output_final_state and normalize else (0,), dtype=dt)
    return o, S, z


def _round256(n):
    return (n + 255) // 256 * 256


def _split_segments(blocks, per_sm, seqlen, sm_count, forced):
    """tiles.h's split_segments, on sizes that may be symbolic (torch.compile's dynamic shapes), for the
    K = V = 128 sweeps saved_bytes asks about (their sparse_slots is false)."""
    chunks = (seqlen + 63) // 64
    want = forced if forced > 0 else (sm_count * per_sm // blocks if 2 * blocks <= sm_count else 1)
    want = torch.sym_min(want, torch.sym_max(1, chunks // 16))
    seg_chunks = (chunks + want - 1) // want
    return (chunks + seg_chunks - 1) // seg_chunks


def saved_bytes(q, k, v, cu_seqlens, normalize, chunk_size):
    """Bytes of the saved tensor chunk_fwd(for_backward=True) returns: the layout of the CUDA plan's
    saved buffer (csrc/cuda/linear/plan.cu, Rules::saved_layout), for the fake kernel, whose shapes
    may be symbolic. On CUDA with bf16/fp16/fp32, 64-token chunks and K, V in {64, 128}, or padded
    dims: K, V multiples of 8 up to 256 on the wgmma sweeps (bf16/fp16 on sm_90a), up to 128 on the
    mma.sync ones (tiles.h's padded_dims): the forward's
    w = scale / den per (token, query head) with normalize; without it, bf16/fp16 at K = V = 128 on
    sm_90a where the forward's sweep splits the sequences, its segment states for the backward's dq
    sweep."""
    B, T, H, K = q.shape
    Hkv, V = v.shape[2], v.shape[3]
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or chunk_size not in (0, 64):
        return 0
    mma_sync, forced_segments, pairing, _ = _C._plan_override()
    props = torch.cuda.get_device_properties(q.device)
    # fp32 takes the mma.sync sweeps' dims everywhere (its TF32 wgmma sweeps take a subset of them)
    wgmma = _C.built_with_wgmma() and props.major == 9 and not mma_sync and q.dtype != torch.float32
    exact = K in (64, 128) and V in (64, 128)
    largest = 256 if wgmma else 128
    padded = 0 < K <= largest and K % 8 == 0 and 0 < V <= largest and V % 8 == 0
    if not (exact or padded):
        return 0
    if normalize:
        return _round256(B * T * H * 4)
    paired = pairing == 1 and chunk_size == 0  # testing.h's Pairing::kAlways: no 64-token forward
    if K != 128 or V != 128 or not wgmma or paired:
        return 0
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    blocks = N * Hkv * 2  # (sequence, kv head, 64-column tile): the forward's and dq's alike
    segments = _split_segments(blocks, 2, T, props.multi_processor_count, forced_segments)
    if segments <= 1:
        return 0
    return _round256(segments * blocks * (128 * 64 + 128) * 4)


def _fake_backward(q, k, v, initial_S, initial_z, cu_seqlens, op, dout, o, d_final_S, d_final_z, **others):
    _check_sequence_args(q, k, v, cu_seqlens, op, {
        "initial_state.S": initial_S, "initial_state.z": initial_z, "grad of o": dout, "o": o,
        "grad of final_state.S": d_final_S, "grad of final_state.z": d_final_z, **others})
    dt = state_dtype(q)
    dS0 = initial_S.new_empty(initial_S.shape) if initial_S is not None else q.new_empty((0,), dtype=dt)
    dz0 = initial_z.new_empty(initial_z.shape) if initial_z is not None else q.new_empty((0,), dtype=dt)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dS0, dz0


@torch.library.register_fake("attnrnn::chunk_fwd")
def _(q, k, v, initial_S, initial_z, cu_seqlens, scale, eps, feature_map, normalize, output_final_state,
      chunk_size, for_backward=False):
    o, S, z = _fake_forward(q, k, v, initial_S, initial_z, cu_seqlens, normalize, output_final_state,
                            "chunk_linear_attn")
    size = saved_bytes(q, k, v, cu_seqlens, normalize, chunk_size) if for_backward else 0
    return o, S, z, q.new_empty((size,), dtype=torch.uint8)


@torch.library.register_fake("attnrnn::recurrent_fwd")
def _(q, k, v, initial_S, initial_z, cu_seqlens, scale, eps, feature_map, normalize, output_final_state):
    return _fake_forward(q, k, v, initial_S, initial_z, cu_seqlens, normalize, output_final_state,
                         "recurrent_linear_attn")


@torch.library.register_fake("attnrnn::chunk_bwd")
def _(dout, q, k, v, o, saved, d_final_S, d_final_z, initial_S, initial_z, cu_seqlens, scale, eps, feature_map,
      normalize, chunk_size):
    return _fake_backward(q, k, v, initial_S, initial_z, cu_seqlens, "chunk_linear_attn backward", dout, o, d_final_S,
                          d_final_z, saved=saved)


@torch.library.register_fake("attnrnn::recurrent_bwd")
def _(dout, q, k, v, o, d_final_S, d_final_z, initial_S, initial_z, cu_seqlens, scale, eps, feature_map, normalize):
    return _fake_backward(q, k, v, initial_S, initial_z, cu_seqlens, "recurrent_linear_attn backward", dout, o,
                          d_final_S, d_final_z)


@torch.library.register_fake("attnrnn::step")
def _(q, k, v, S, z, state_indices, scale, eps, feature_map, normalize):
    op = "linear_attn_step"
    fake_check_rank(q, 3, op, "q", "[B, H, K]")
    fake_check_rank(k, 3, op, "k", "[B, Hkv, K]")
    fake_check_rank(v, 3, op, "v", "[B, Hkv, V]")
    fake_check_devices(op, q, {"k": k, "v": v, "state.S": S, "state.z": z, "state_indices": state_indices})
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


def no_double_backward(op_name):
    """A backward for a backward op: the first-order gradient may be built with
    create_graph=True, but differentiating it again raises instead of silently treating the op's
    results as constants (which would give zero second-order gradients)."""

    def backward(ctx, *grads):
        raise NotImplementedError(
            f"double backward of {op_name} is not supported (the gradient of the attnrnn backward op is "
            "not implemented); differentiate the reference implementation for higher-order gradients")

    return backward
