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


# What the forward keeps for its backward (chunk_fwd's saved tensor): the autograd kernel asks for it
# only where a gradient is recorded, so the recorder above sees it empty. On CUDA at a split shape
# (B1-T8192-H2-D128: on Hopper the unnormalized forward keeps its segment states there) and with
# normalize (its w per token and head), the forward asked for it and the backward reading it.
@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
def test_opcheck_forward_keeping_saved_and_the_backward_reading_it(ar, device, normalize):
    T = 8192 if device == "cuda" else 64  # nothing is kept on the CPU: a short sequence checks the schema
    q, k, v = (torch.randn(1, T, 2, 128, device=device, dtype=torch.bfloat16) for _ in range(3))
    scale = 128 ** -0.5
    fwd_args = (q, k, v, None, None, None, scale, 1e-6, "identity", normalize, False, 0, True)
    torch.library.opcheck(torch.ops.attnrnn.chunk_fwd.default, fwd_args)
    o, _, _, saved = torch.ops.attnrnn.chunk_fwd(*fwd_args)
    bwd_args = (torch.randn_like(o), q, k, v, o, saved, None, None, None, None, None, scale, 1e-6, "identity",
                normalize, 0)
    torch.library.opcheck(torch.ops.attnrnn.chunk_bwd.default, bwd_args)
