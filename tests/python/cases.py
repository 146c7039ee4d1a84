"""Test cases (shapes and options), input generation and a forward+backward driver.

A :class:`Case` names itself (``B2-T1000-H4-K64-bf16``); :func:`make_inputs` builds the leaves and
the upstream gradients for it; :func:`run` calls one implementation (ours or the reference) on
leaves cast to a chosen dtype and returns every output and gradient by name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16",
               torch.bfloat16: "bf16"}


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    K: int
    dtype: torch.dtype = torch.float32
    Hkv: Optional[int] = None  # default H
    V: Optional[int] = None  # default K
    feature_map: Optional[str] = "elu1"
    normalize: bool = True
    initial_state: bool = False
    final_state: bool = False
    seqlens: Optional[Tuple[int, ...]] = None  # packed sequences (B must be 1, T = sum)
    noncontig: bool = False  # strided q/k/v and upstream gradients

    def __post_init__(self):
        if self.Hkv is None:
            object.__setattr__(self, "Hkv", self.H)
        if self.V is None:
            object.__setattr__(self, "V", self.K)
        if self.seqlens is not None:
            assert self.B == 1 and self.T == sum(self.seqlens), self

    @property
    def N(self) -> int:
        return self.B if self.seqlens is None else len(self.seqlens)

    def replace(self, **kw) -> "Case":
        return dataclasses.replace(self, **kw)

    @property
    def id(self) -> str:
        s = f"B{self.B}-T{self.T}-H{self.H}"
        if self.Hkv != self.H:
            s += f"-Hkv{self.Hkv}"
        s += f"-K{self.K}"
        if self.V != self.K:
            s += f"-V{self.V}"
        s += f"-{DTYPE_NAMES[self.dtype]}"
        s += f"-{self.feature_map or 'identity'}"
        if not self.normalize:
            s += "-unnorm"
        if self.initial_state:
            s += "-h0"
        if self.final_state:
            s += "-hT"
        if self.seqlens is not None:
            s += "-varlen" + "_".join(map(str, self.seqlens))
        if self.noncontig:
            s += "-strided"
        return s

    def kwargs(self) -> dict:
        return dict(feature_map=self.feature_map, normalize=self.normalize,
                    output_final_state=self.final_state)


def _strided(shape, dtype, device, gen, kind: int, positive=False) -> torch.Tensor:
    """A [B, T, H, D] tensor with unit last-dim stride but non-contiguous (3 different layouts)."""
    B, T, H, D = shape

    def rnd(*s):
        x = torch.randn(*s, generator=gen, dtype=torch.float64)
        return (x.abs() + 0.1 if positive else x).to(device=device, dtype=dtype)

    if kind == 0:  # [B, H, T, D] storage, time and head axes swapped
        return rnd(B, H, T, D).transpose(1, 2)
    if kind == 1:  # padded last dim
        return rnd(B, T, H, D + 8)[..., :D]
    return rnd(B, T, 2 * H, D)[:, :, ::2]  # every other head


def make_inputs(case: Case, device, seed: int = 0, positive: bool = False) -> Dict[str, torch.Tensor]:
    """Leaves (q, k, v in the case dtype; S0, z0 in the state dtype) and upstream gradients.

    Values are generated in float64 and rounded to the case dtype, so the float64 reference sees
    exactly the same numbers. ``positive`` makes q, k > 0 (for identity maps with normalize).
    """
    gen = torch.Generator().manual_seed(seed)
    B, T, H, Hkv, K, V, dt = case.B, case.T, case.H, case.Hkv, case.K, case.V, case.dtype
    sdt = state_dtype(dt)

    def rnd(*s, pos=False, scale=1.0):
        x = torch.randn(*s, generator=gen, dtype=torch.float64) * scale
        return (x.abs() + 0.1 if pos else x)

    inp = {}
    if case.noncontig:
        inp["q"] = _strided((B, T, H, K), dt, device, gen, 0, positive)
        inp["k"] = _strided((B, T, Hkv, K), dt, device, gen, 1, positive)
        inp["v"] = _strided((B, T, Hkv, V), dt, device, gen, 2)
    else:
        inp["q"] = rnd(B, T, H, K, pos=positive).to(device=device, dtype=dt)
        inp["k"] = rnd(B, T, Hkv, K, pos=positive).to(device=device, dtype=dt)
        inp["v"] = rnd(B, T, Hkv, V).to(device=device, dtype=dt)
    N = case.N
    if case.initial_state:
        inp["S0"] = rnd(N, Hkv, K, V, scale=2.0).to(device=device, dtype=sdt)
        if case.normalize:
            # Positive, like a sum of positive features, so denominators stay away from zero.
            inp["z0"] = (rnd(N, Hkv, K).abs() * 4 + 1).to(device=device, dtype=sdt)
    if case.seqlens is not None:
        cu = [0]
        for n in case.seqlens:
            cu.append(cu[-1] + n)
        inp["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
    # Upstream gradients.
    if case.noncontig:
        inp["do"] = rnd(B, H, T, 2 * V).to(device=device, dtype=dt)[..., ::2].transpose(1, 2)
    else:
        inp["do"] = rnd(B, T, H, V).to(device=device, dtype=dt)
    if case.final_state:
        inp["dS"] = rnd(N, Hkv, K, V).to(device=device, dtype=sdt)
        if case.normalize:
            inp["dz"] = rnd(N, Hkv, K).to(device=device, dtype=sdt)
    return inp


LEAVES = ("q", "k", "v", "S0", "z0")
GRAD_NAMES = {"q": "dq", "k": "dk", "v": "dv", "S0": "dS0", "z0": "dz0"}


def run(fn: Callable, case: Case, inp: Dict[str, torch.Tensor], *, dtype=None,
        backward: bool = True, **extra) -> Dict[str, torch.Tensor]:
    """Call ``fn`` (attnrnn.chunk_linear_attn, a reference form, ...) on the case.

    ``dtype``: cast q/k/v/do to it and the states/state gradients to its state dtype (None: as
    generated). Returns ``o`` (and ``S``, ``z`` with a final state) and, with ``backward``, the
    gradient of every leaf (``dq``, ``dk``, ``dv``, ``dS0``, ``dz0``) for the upstream gradients
    ``do`` (and ``dS``, ``dz``).
    """
    def cast(x, state=False):
        if dtype is None:
            return x
        return x.to(state_dtype(dtype) if state else dtype)

    leaves = {}
    for name in LEAVES:
        if name in inp:
            # Keep strides (a cast of a strided tensor would make it contiguous).
            x = inp[name]
            y = cast(x, state=name in ("S0", "z0"))
            y = _clone_strided(x) if y is x else y
            leaves[name] = y.detach().requires_grad_(backward)
    initial_state = None
    if "S0" in leaves:
        initial_state = (leaves["S0"], leaves.get("z0"))
    kw = case.kwargs()
    kw.update(extra)
    o, st = fn(leaves["q"], leaves["k"], leaves["v"], initial_state=initial_state,
               cu_seqlens=inp.get("cu_seqlens"), **kw)
    res = {"o": o}
    outs, grads = [o], [cast(inp["do"])]
    if case.final_state:
        assert st is not None, "output_final_state=True returned no state"
        res["S"] = st.S if hasattr(st, "S") else st[0]
        z = st.z if hasattr(st, "z") else st[1]
        outs.append(res["S"])
        grads.append(inp["dS"].to(res["S"].dtype))
        if case.normalize:
            res["z"] = z
            outs.append(z)
            grads.append(inp["dz"].to(z.dtype))
    else:
        assert st is None, "output_final_state=False returned a state"
    if backward:
        names = list(leaves)
        gs = torch.autograd.grad(outs, [leaves[n] for n in names], grads, allow_unused=False)
        for n, g in zip(names, gs):
            res[GRAD_NAMES[n]] = g
    return {k: v.detach() for k, v in res.items()}


def _clone_strided(x: torch.Tensor) -> torch.Tensor:
    """A copy of x with the same strides (non-contiguous stays non-contiguous)."""
    if x.is_contiguous():
        return x.clone()
    span = x.storage_offset() + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1
    base = torch.empty(span if x.numel() else 0, dtype=x.dtype, device=x.device)
    y = base.as_strided(x.size(), x.stride(), x.storage_offset())
    y.copy_(x)
    return y


def assert_fake_kernel_raises_like_the_op(name, build, regex):
    """torch.ops.attnrnn.<name>(*build()) raises a ValueError matching regex, and its fake kernel
    (under FakeTensorMode, as torch.compile traces it) raises the same message."""
    import pytest
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = getattr(torch.ops.attnrnn, name)
    with pytest.raises(ValueError, match=regex) as eager:
        op(*build())
    with FakeTensorMode():
        args = build()
        with pytest.raises(ValueError, match=regex) as fake:
            op(*args)
    assert str(fake.value) in str(eager.value)
