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


def writes_den(q, normalize):
    """Whether chunk_fwd(save_den=True) returns the denominators (linear_attn_chunk_fwd_writes_den)."""
    return normalize and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


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
      chunk_size, save_den=False):
    o, S, z = _fake_forward(q, k, v, initial_S, initial_z, cu_seqlens, normalize, output_final_state,
                            "chunk_linear_attn")
    saved = save_den and writes_den(q, normalize)
    den = q.new_empty(q.shape[:3] if saved else (0,), dtype=torch.float32)
    return o, S, z, den


@torch.library.register_fake("attnrnn::chunk_fwd_with_segment_states")
def _(q, k, v, initial_S, initial_z, cu_seqlens, scale, eps, feature_map, normalize, output_final_state,
      chunk_size, save_den, segment_states):
    # The C++ autograd kernel calls this op on plain CUDA tensors only (never while tracing); as
    # chunk_fwd, plus segment_states written in place.
    o, S, z = _fake_forward(q, k, v, initial_S, initial_z, cu_seqlens, normalize, output_final_state,
                            "chunk_linear_attn")
    saved = save_den and writes_den(q, normalize)
    den = q.new_empty(q.shape[:3] if saved else (0,), dtype=torch.float32)
    return o, S, z, den


@torch.library.register_fake("attnrnn::recurrent_fwd")
def _(q, k, v, initial_S, initial_z, cu_seqlens, scale, eps, feature_map, normalize, output_final_state):
    return _fake_forward(q, k, v, initial_S, initial_z, cu_seqlens, normalize, output_final_state,
                         "recurrent_linear_attn")


@torch.library.register_fake("attnrnn::chunk_bwd")
def _(dout, o, d_final_S, d_final_z, q, k, v, initial_S, initial_z, cu_seqlens, scale, eps, feature_map,
      normalize, chunk_size, den=None, segment_states=None, phi_given=False):
    return _fake_backward(q, k, v, initial_S, initial_z, cu_seqlens, "chunk_linear_attn backward", dout, o, d_final_S,
                          d_final_z, den=den, segment_states=segment_states)


@torch.library.register_fake("attnrnn::features")
def _(q, k, feature_map):
    # The checks of attnrnn::aten::features, so that a traced call fails where the op would.
    op = "linear_attn features"
    fake_check_rank(q, 4, op, "q", _LAYOUTS["q"])
    fake_check_rank(k, 4, op, "k", _LAYOUTS["k"])
    fake_check_devices(op, q, {"k": k})
    if k.dtype != q.dtype:
        raise ValueError(f"{op}: k must have the dtype of q")  # the op names them as c10 does
    if (k.shape[0], k.shape[1], k.shape[3]) != (q.shape[0], q.shape[1], q.shape[3]):
        raise ValueError(f"{op}: k must have the batch, length and head dim of q "
                         f"({q.shape[0]}, {q.shape[1]}, {q.shape[3]}), got shape {list(k.shape)}")
    if feature_map not in ("identity", "elu1", "relu"):
        raise ValueError(f"{op}: feature_map must be 'identity', 'elu1' or 'relu', got '{feature_map}'")
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.register_fake("attnrnn::recurrent_bwd")
def _(dout, o, d_final_S, d_final_z, q, k, v, initial_S, initial_z, cu_seqlens, scale, eps, feature_map,
      normalize):
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
