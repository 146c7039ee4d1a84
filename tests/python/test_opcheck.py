"""torch.library.opcheck on every attnrnn op (schema, fake kernel, autograd registration,
dynamic shapes), on the arguments the public functions really pass to them: the calls are
recorded with a dispatch mode while the public API runs forward, backward and a decode step."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cases import Case, make_inputs, run

OPS = ["chunk_fwd", "chunk_bwd", "recurrent_fwd", "recurrent_bwd", "step"]


def _copy(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "attnrnn":
            self.calls.append((func, tuple(map(_copy, args)), {k: _copy(v) for k, v in kwargs.items()}))
        return func(*args, **kwargs)


def _record(ar, device):
    """Samples {op name: [(op, args, kwargs), ...]} from a few public calls."""
    rec = _Recorder()
    with rec:
        for op in ("chunk", "recurrent"):
            for case in (Case(2, 19, 4, 8, torch.float32, Hkv=2, V=4, initial_state=True,
                              final_state=True),
                         Case(1, 13, 2, 8, torch.float32, V=4, feature_map="relu", normalize=False,
                              seqlens=(5, 0, 8), final_state=True),
                         Case(1, 9, 2, 8, torch.bfloat16, feature_map=None, normalize=False)):
                run(getattr(ar, f"{op}_linear_attn"), case, make_inputs(case, device))
        S = torch.zeros(3, 2, 8, 4, device=device)
        z = torch.ones(3, 2, 8, device=device)
        q, k, v = torch.randn(2, 2, 8, device=device), torch.randn(2, 2, 8, device=device), \
            torch.randn(2, 2, 4, device=device)
        ar.linear_attn_step(q, k, v, (S, z), feature_map="elu1")
        ar.linear_attn_step(q, k, v, (S, z), feature_map="elu1",
                            state_indices=torch.tensor([2, -1], device=device))
    samples = {}
    for func, args, kwargs in rec.calls:
        samples.setdefault(func._opname, []).append((func, args, kwargs))
    return samples


@pytest.fixture(scope="module")
def recorded():
    cache = {}

    def get(ar, device):
        if device not in cache:
            cache[device] = _record(ar, device)
        return cache[device]
    return get


@pytest.mark.parametrize("name", OPS)
def test_opcheck(ar, recorded, device, name):
    samples = recorded(ar, device).get(name, [])
    assert samples, f"the public API never called torch.ops.attnrnn.{name}"
    for func, args, kwargs in samples:
        if name.endswith("_fwd"):
            # Inputs that require grad exercise the autograd registration.
            args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                         else a for a in args)
        torch.library.opcheck(func, args, kwargs)


@pytest.mark.parametrize("dtype,normalize", [(torch.bfloat16, True), (torch.float32, True), (torch.bfloat16, False)],
                         ids=["bf16-norm", "fp32-norm", "bf16-unnorm"])
def test_chunk_fwd_saves_denominators_only_where_its_backward_reads_them(ar, device, dtype, normalize):
    q, k, v = (torch.randn(1, 10, 2, 16, device=device, dtype=dtype) for _ in range(3))
    den = torch.ops.attnrnn.chunk_fwd(q, k, v, None, None, None, 0.25, 1e-6, "elu1", normalize, False, 0, True)[3]
    saved = device == "cuda" and normalize and dtype == torch.bfloat16
    assert den.dtype == torch.float32
    assert den.shape == ((1, 10, 2) if saved else (0,))


# The forward's segment states for dq (chunk_fwd_with_segment_states, chunk_bwd's segment_states):
# the autograd kernel passes them only outside dispatch modes, so the recorder above never sees them.
# B1-T8192-H2-D128 without normalize is a split shape on the H200 (test_cuda's state-pass test).
def _split_inputs(device):
    return [torch.randn(1, 8192, 2, 128, device=device, dtype=torch.bfloat16) for _ in range(3)]


def _saves_segment_states(device, normalize):
    return device == "cuda" and not normalize and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
def test_segment_state_buffer_is_empty_where_the_forward_saves_none(ar, device, normalize):
    q, k, v = _split_inputs(device)
    floats = ar._C.chunk_fwd_segment_state_floats(q, k, v, None, "identity", normalize, 0)
    assert (floats > 0) == _saves_segment_states(device, normalize), floats


def test_segment_state_buffer_size_takes_the_operator_arguments(ar):
    q, k, v = _split_inputs("cpu")
    with pytest.raises(TypeError, match="takes 7 positional arguments"):
        ar._C.chunk_fwd_segment_state_floats(q, k, v, None, "identity", False)
    with pytest.raises(TypeError, match="expects"):
        ar._C.chunk_fwd_segment_state_floats(q, k, None, None, "identity", False, 0)


def test_opcheck_forward_with_segment_states_and_the_backward_reading_them(ar, device):
    if not _saves_segment_states(device, False):
        pytest.skip("the forward saves segment states on sm_90a only (the test above checks that it saves none)")
    q, k, v = _split_inputs(device)
    states = torch.empty(ar._C.chunk_fwd_segment_state_floats(q, k, v, None, "identity", False, 0), device=device)
    fwd_args = (q, k, v, None, None, None, 128 ** -0.5, 1e-6, "identity", False, False, 0, False, states)
    torch.library.opcheck(torch.ops.attnrnn.chunk_fwd_with_segment_states.default, fwd_args)
    o = torch.ops.attnrnn.chunk_fwd_with_segment_states(*fwd_args)[0]
    bwd_args = (torch.randn_like(o), None, None, None, q, k, v, None, None, None, 128 ** -0.5, 1e-6, "identity",
                False, 0)
    torch.library.opcheck(torch.ops.attnrnn.chunk_bwd.default, bwd_args, {"segment_states": states})
