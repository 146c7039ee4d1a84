"""Decoding state for stacks of attention layers, shared by many sequences (batched serving).

An :class:`AttentionCache` holds one *pool* per layer with ``P`` rows ("slots"), one per sequence
being served, and a slot allocator (a free list):

* :class:`LinearStatePool` (a :class:`~attnrnn.nn.LinearAttention` layer): ``S [P, Hkv, K, V]`` and
  ``z [P, Hkv, K]`` (``None`` when the layer does not normalize), float32 (float64 for a float64
  layer). Its size does not depend on the number of tokens seen: O(1) per sequence.
* :class:`KVPool` (a :class:`~attnrnn.nn.SoftmaxAttention` layer): ``k [P, L, Hkv, D]``,
  ``v [P, L, Hkv, Dv]`` and ``lengths [P]`` (tokens written per slot), ``L = max_len``: O(N).

A forward with a cache takes ``state_indices [B]`` (int, distinct, each an allocated slot): batch
entry ``b`` reads and writes row ``state_indices[b]`` of every pool, and no other row is read,
written or copied. Adding a sequence is :meth:`AttentionCache.allocate` (zeroes only its rows),
dropping one is :meth:`AttentionCache.free`, and reordering or regrouping the batch is just
passing other ``state_indices``.

Models build their cache (``model.make_cache(num_slots, ...)``); the cache records the layer
specification of the model that built it so that a cache from another model is refused.
"""
from __future__ import annotations

import numbers
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .._args import as_int
from .._host_copy import HostCopy, version_of

__all__ = ["LinearStatePool", "KVPool", "AttentionCache"]


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ---- the checks on values held in tensors ------------------------------------------------------------
# Eager calls read the values on the host (once per tensor, see check_indices) and raise ValueError
# before anything is written. Under torch.compile the same checks run inside the graph:
#
# * On the CPU they are the two operators below, which raise the eager call's ValueError: each
#   returns a copy of the slots that every later write of the cache takes as its index, so no write
#   can run before the check that guards it.
# * On CUDA (any device but the CPU) raising would need the verdict on the host, a sync on every
#   step, so the checks are computed on the device and never raise (_device_checked_slots,
#   KVPool.check_room; CausalLM checks its token ids the same way). A bad call's slots come back
#   *poisoned*: every entry -1. Whatever reads or writes the cache takes guard(slots): the rows
#   slots.clamp(min=0) (in range, so nothing indexes out of bounds) and a 0-dim bool `bad`. Every
#   write stores torch.where(bad, the rows' old values, the new ones) (kept(): a select over the
#   rows written, never a copy of a pool), linear_attn_step skips rows -1 by itself, and the call's
#   outputs are NaN where bad (nan_if()). So a bad call changes nothing in the cache and returns
#   NaN; a good one computes what it would without these checks (the selects pick the new values,
#   the clamps change nothing). Poisoned slots stay poisoned through later checks (-1 is out of
#   range), so a model's checks before its first layer cover every layer.

def _check_slot_values(values: List[int], allocated: List[bool], name: str) -> None:
    """values: the slots one call addresses; allocated: the allocator's state of every slot."""
    num_slots = len(allocated)
    out = [i for i in values if not 0 <= i < num_slots]
    if out:
        raise ValueError(f"{name} has indices {out} out of range [0, {num_slots}) (num_slots={num_slots})")
    if len(set(values)) != len(values):
        raise ValueError(f"{name} must be distinct, got {values}")
    unallocated = [i for i in values if not allocated[i]]
    if unallocated:
        raise ValueError(f"{name} addresses slots {unallocated} that are not allocated; call cache.allocate() first")


def _check_room_values(slots: List[int], lengths: List[int], max_len: int, count: int, layer: int, arg: str) -> None:
    full = [s for s in slots if lengths[s] + count > max_len]
    if full:
        raise ValueError(f"{arg}: {count} more token(s) do not fit in the KV cache of layer {layer} (max_len={max_len}) "
                         f"for slots {full}; build the cache with a larger max_len")


@torch.library.custom_op("attnrnn_nn::checked_slots", mutates_args=())
def _checked_slots(slots: torch.Tensor, allocated: torch.Tensor, name: str) -> torch.Tensor:
    """slots (int64) after _check_slot_values against allocated (the allocator's CPU mirror)."""
    _check_slot_values(slots.tolist(), allocated.tolist(), name)
    return slots.clone()


@torch.library.custom_op("attnrnn_nn::checked_room", mutates_args=())
def _checked_room(slots: torch.Tensor, lengths: torch.Tensor, max_len: int, count: int, layer: int,
                  arg: str) -> torch.Tensor:
    """slots (int64, checked) after _check_room_values against a KV pool's lengths."""
    _check_room_values(slots.tolist(), lengths.tolist(), max_len, count, layer, arg)
    return slots.clone()


@_checked_slots.register_fake
def _(slots, allocated, name):
    return torch.empty_like(slots)


@_checked_room.register_fake
def _(slots, lengths, max_len, count, layer, arg):
    return torch.empty_like(slots)


def checks_on_device(device: torch.device) -> bool:
    """Whether a call's checks run on the device without raising (compiled, not on the CPU)."""
    return torch.compiler.is_compiling() and device.type != "cpu"


def poison(slots: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """slots, or every entry -1 where the 0-dim bool ``bad`` is set (a call that must change nothing)."""
    return torch.where(bad, -1, slots)


def _device_checked_slots(slots: torch.Tensor, allocated: torch.Tensor) -> torch.Tensor:
    """_check_slot_values on the device: slots (int64), poisoned unless every entry is in range,
    distinct and allocated (``allocated``: the allocator's device mirror)."""
    num_slots = allocated.shape[0]
    if num_slots == 0:
        return torch.full_like(slots, -1)
    rows = slots.clamp(0, num_slots - 1)
    bad = ((slots < 0) | (slots >= num_slots) | ~allocated[rows]).any()
    bad = bad | ((rows[:, None] == rows[None, :]).sum() != rows.shape[0])  # distinct: B equal pairs
    return poison(slots, bad)


def guard(idx: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """From the slots the checks returned: (the rows to read and write, bad). ``(idx, None)``
    unless the checks ran on the device; then the rows are ``idx.clamp(min=0)`` and ``bad`` is a
    0-dim bool tensor, set when the slots are poisoned."""
    if not checks_on_device(idx.device):
        return idx, None
    return idx.clamp(min=0), (idx < 0).any()


def kept(bad: Optional[torch.Tensor], new: torch.Tensor, old: Callable[[], torch.Tensor]) -> torch.Tensor:
    """What a write stores: ``new``, or ``old()`` (the rows' values now) where ``bad`` is set."""
    return new if bad is None else torch.where(bad, old(), new)


def nan_if(bad: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """A call's output: ``out``, or NaN everywhere where ``bad`` is set."""
    return out if bad is None else torch.where(bad, float("nan"), out)


class _Checked(NamedTuple):
    """What check_indices last passed: the tensors that hold its values (the one given and the int64
    one returned) with their versions then, the allocator's epoch then, and the slots as ints."""
    tensors: Tuple[Tuple[torch.Tensor, Optional[int]], ...]
    idx: torch.Tensor
    epoch: int
    slots: List[int]

    def holds(self, t: torch.Tensor) -> bool:
        return any(t is x for x, _ in self.tensors)

    def unwritten(self) -> bool:
        """No in-place write since (as far as version counters tell; inference tensors have none)."""
        return all(v is not None and version_of(x) == v for x, v in self.tensors)


class LinearStatePool:
    """Per-layer state pool of a linear-attention layer.

    Attributes:
        S: ``[P, Hkv, K, V]`` float32 (float64 for float64 layers), K the feature dimension.
        z: ``[P, Hkv, K]`` of the same dtype, or ``None`` when ``normalize=False``.
    """

    kind = "linear"

    def __init__(self, num_slots: int, num_kv_heads: int, feature_dim: int, value_dim: int, normalize: bool,
                 device=None, dtype=torch.float32):
        self.S = torch.zeros(num_slots, num_kv_heads, feature_dim, value_dim, device=device, dtype=dtype)
        self.z = torch.zeros(num_slots, num_kv_heads, feature_dim, device=device, dtype=dtype) if normalize else None

    @property
    def spec(self) -> tuple:
        """What a layer must match: ``("linear", Hkv, K, V, normalize, dtype)``."""
        return ("linear",) + tuple(self.S.shape[1:]) + (self.z is not None, self.S.dtype)

    def describe(self) -> str:
        z = f", z {list(self.z.shape)}" if self.z is not None else ", no z"
        return f"linear-attention state S {list(self.S.shape)}{z} ({self.S.dtype})"

    def tensors(self) -> List[torch.Tensor]:
        return [self.S] + ([self.z] if self.z is not None else [])

    def reset_(self, slots: torch.Tensor, host_slots: Optional[Sequence[int]] = None) -> None:
        for t in self.tensors():
            t.index_fill_(0, slots, 0)

    def nbytes_per_slot(self) -> int:
        return _nbytes(*self.tensors()) // max(self.S.shape[0], 1)


class KVPool:
    """Per-layer KV cache of a softmax-attention layer.

    Attributes:
        k: ``[P, L, Hkv, D]``; v: ``[P, L, Hkv, Dv]`` in the layer's dtype; L = ``max_len``.
        lengths: ``[P]`` int64, tokens written in each slot (positions ``0 .. lengths-1`` are valid).
    """

    kind = "softmax"

    def __init__(self, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int, value_dim: int,
                 device=None, dtype=torch.float32):
        self.k = torch.zeros(num_slots, max_len, num_kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros(num_slots, max_len, num_kv_heads, value_dim, device=device, dtype=dtype)
        self.lengths = torch.zeros(num_slots, device=device, dtype=torch.long)
        # A host copy of lengths, so that a decoding step finds how many keys to read without reading
        # the device tensor back (a sync per layer and token).
        self._host = HostCopy()

    def __getstate__(self):  # a copy (deepcopy, pickle) reads its lengths again
        return dict(self.__dict__, _host=HostCopy())

    def host_lengths(self) -> List[int]:
        """``lengths`` as a list of ints, read from the device only when something other than this
        pool's own methods wrote it since the last read."""
        return self._host.get(self.lengths, torch.Tensor.tolist)

    def end_after(self, slots: Sequence[int], count: int) -> int:
        """The longest of the lengths at ``slots`` (not empty) once ``count`` more tokens are in, from
        the host copy."""
        lengths = self.host_lengths()
        return max(lengths[s] for s in slots) + count

    def check_room(self, idx: torch.Tensor, count: int, layer: int, arg: str,
                   slots: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Raises ValueError naming ``arg`` when ``count`` more tokens do not fit in the slots ``idx``
        (checked slots; ``slots``: the same as ints). Returns the slots the writes must use: ``idx``,
        or under torch.compile the checked copy (see ``_checked_room``); compiled on CUDA, ``idx``
        poisoned when the tokens do not fit, without raising (see "the checks on values held in
        tensors")."""
        if checks_on_device(idx.device):
            return poison(idx, (self.lengths[idx.clamp(min=0)] + count > self.max_len).any())
        if torch.compiler.is_compiling():
            return torch.ops.attnrnn_nn.checked_room(idx, self.lengths, self.max_len, count, layer, arg)
        _check_room_values(list(slots), self.host_lengths(), self.max_len, count, layer, arg)
        return idx

    def _write_lengths(self, write, slots: Optional[Sequence[int]], value) -> None:
        """write() changes lengths at slots; the host copy follows (value(old) per slot) if it was
        trusted, without a device read."""
        copy = self._host.trusted(self.lengths) if slots is not None else None
        write()
        if copy is not None:
            for s in slots:
                copy[s] = value(copy[s])
            self._host.set(self.lengths, copy)

    def append_(self, slots: torch.Tensor, start: torch.Tensor, count: int,
                host_slots: Optional[Sequence[int]] = None, bad: Optional[torch.Tensor] = None) -> None:
        """``lengths[slots] = start + count`` (start: ``lengths[slots]`` as read before the write);
        ``host_slots``: slots as ints, for the host copy; ``bad`` (see ``guard``): ``start`` is
        written back where set."""
        self._write_lengths(lambda: self.lengths.index_copy_(0, slots, kept(bad, start + count, lambda: start)),
                            host_slots, lambda old: old + count)

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    @property
    def spec(self) -> tuple:
        """What a layer must match: ``("softmax", Hkv, D, Dv, dtype)`` (any max_len)."""
        return ("softmax", self.k.shape[2], self.k.shape[3], self.v.shape[3], self.k.dtype)

    def describe(self) -> str:
        return f"softmax KV cache k {list(self.k.shape)}, v {list(self.v.shape)} ({self.k.dtype})"

    def tensors(self) -> List[torch.Tensor]:
        return [self.k, self.v, self.lengths]

    def reset_(self, slots: torch.Tensor, host_slots: Optional[Sequence[int]] = None) -> None:
        # Only the lengths need resetting: positions >= length are never read.
        self._write_lengths(lambda: self.lengths.index_fill_(0, slots, 0), host_slots, lambda old: 0)

    def nbytes_per_slot(self) -> int:
        return _nbytes(self.k, self.v) // max(self.k.shape[0], 1)


Pool = Union[LinearStatePool, KVPool]


class AttentionCache:
    """Per-layer state pools of a stack of attention layers plus a slot allocator.

    Args:
        layers: one pool per layer (``LinearStatePool`` or ``KVPool``), all with the same number of
            slots ``P``.
        extras: optional per-slot tensors ``[P, ...]`` a model keeps next to the layer states
            (e.g. the last token of each sequence); zeroed on allocation.
        signature: what built the cache (a model's layer specification); models compare it.

    Typical use (see :class:`attnrnn.lm.CausalLM`)::

        cache = model.make_cache(num_slots=8, max_len=4096)
        a = cache.allocate(2)                          # two new sequences -> slots tensor([0, 1])
        logits = model(prompts, cache=cache, state_indices=a)     # prefill (chunk kernel)
        b = cache.allocate(1)                          # a third joins
        logits = model(next_tokens, cache=cache, state_indices=torch.cat([b, a]))  # decode step
        cache.free(a[:1])                              # one leaves; the others are not touched
    """

    def __init__(self, layers: Sequence[Pool], extras: Optional[Dict[str, torch.Tensor]] = None,
                 signature=None):
        layers = list(layers)
        if not layers:
            raise ValueError("layers must hold at least one pool")
        sizes = {p.tensors()[0].shape[0] for p in layers}
        extras = dict(extras or {})
        sizes |= {t.shape[0] for t in extras.values()}
        if len(sizes) != 1:
            raise ValueError(f"every pool and extra must have the same number of slots, got {sorted(sizes)}")
        self.layers: List[Pool] = layers
        self.extras: Dict[str, torch.Tensor] = extras
        self.signature = signature
        self.num_slots: int = sizes.pop()
        self._free: List[int] = list(range(self.num_slots))
        self._allocated = torch.zeros(self.num_slots, dtype=torch.bool)  # CPU mirror of the allocator
        # and one on the device for the checks compiled there (None on the CPU)
        self._allocated_on_device = (torch.zeros(self.num_slots, dtype=torch.bool, device=self.device)
                                     if self.device.type != "cpu" else None)
        # The last state_indices check_indices passed: the same tensor again, unwritten, while no
        # slot was allocated or freed (the epoch counts both), needs no device read.
        self._epoch = 0
        self._checked: Optional[_Checked] = None

    def __getstate__(self):  # a copy (deepcopy, pickle) checks its indices again
        return dict(self.__dict__, _checked=None)

    # -- allocator -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.layers[0].tensors()[0].device

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def allocated_slots(self) -> List[int]:
        return [int(i) for i in self._allocated.nonzero().flatten()]

    def allocate(self, n: int = 1) -> torch.Tensor:
        """Takes ``n`` free slots, zeroes their rows in every pool and returns them (int64 ``[n]``
        on the cache's device). Raises ``ValueError`` when fewer than ``n`` slots are free."""
        as_int(n, "n", 0)
        if n > len(self._free):
            raise ValueError(f"n={n} slots requested but only {len(self._free)} of {self.num_slots} are free; "
                             "free some slots or build a larger cache")
        taken, self._free = self._free[:n], self._free[n:]
        slots = torch.tensor(taken, dtype=torch.long, device=self.device)
        self._epoch += 1
        for pool in self.layers:
            pool.reset_(slots, taken)
        for t in self.extras.values():
            t.index_fill_(0, slots, 0)
        self._allocated[taken] = True
        self._mirror_allocator()
        return slots

    def free(self, slots: Union[torch.Tensor, Iterable[int]]) -> None:
        """Returns ``slots`` to the free list (their rows are zeroed when allocated again)."""
        idx = self._as_list(slots, "slots")
        bad = [i for i in idx if not 0 <= i < self.num_slots or not self._allocated[i]]
        if bad:
            raise ValueError(f"slots {bad} are not allocated slots of this cache (num_slots={self.num_slots})")
        if len(set(idx)) != len(idx):
            raise ValueError(f"slots must be distinct, got {idx}")
        self._allocated[idx] = False
        self._free.extend(idx)
        self._epoch += 1
        self._mirror_allocator()

    def _mirror_allocator(self) -> None:
        # non_blocking: PyTorch does not wait for the stream; from pageable memory CUDA takes the values
        # before copy_ returns, so the host may write _allocated again at once.
        if self._allocated_on_device is not None:
            self._allocated_on_device.copy_(self._allocated, non_blocking=True)

    def nbytes_per_slot(self) -> int:
        """Bytes of layer state one sequence occupies (all layers)."""
        return sum(p.nbytes_per_slot() for p in self.layers)

    # -- validation ------------------------------------------------------------------------------
    @staticmethod
    def _as_list(slots, name) -> List[int]:
        if isinstance(slots, torch.Tensor):
            if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {slots.dtype} {list(slots.shape)}")
            return [int(i) for i in slots.tolist()]
        if isinstance(slots, str):
            raise TypeError(f"{name} must be a 1-D int tensor or an iterable of ints, got str {slots!r}")
        idx = list(slots)
        bad = [i for i in idx if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
        if bad:
            raise TypeError(f"{name} must hold ints, got {bad}")
        return [int(i) for i in idx]

    def check_indices(self, state_indices: Optional[torch.Tensor], batch: int, name: str = "state_indices"
                      ) -> torch.Tensor:
        """Validates ``state_indices`` for a batch of ``batch`` sequences and returns it as int64 on
        the cache's device (``arange(batch)`` when None). Raises ``ValueError`` naming ``name``.

        Reading the values is a device read (a sync on CUDA), done once for a given tensor: the same
        tensor again (or the one returned), unwritten as far as their version counters tell (writes
        through NumPy, DLPack or ``.data`` are not seen: pass a new tensor after them), with no slot
        allocated or freed since, is returned as checked. Under ``torch.compile`` only the shape and
        dtype are checked on the host; the values are checked inside the graph: on the CPU raising
        this ValueError (see ``_checked_slots``), on CUDA on the device without raising, returning
        the slots poisoned when bad (see "the checks on values held in tensors"). Raises
        ``RuntimeError`` while a CUDA graph is being captured."""
        compiling = torch.compiler.is_compiling()
        if not compiling and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decoding through attnrnn.nn layers cannot be captured in a CUDA graph: the cache's "
                               "host-side bookkeeping (slots, KV lengths) would not follow the replays; use "
                               "torch.compile, or capture the attnrnn ops themselves")
        if state_indices is None:
            if batch > self.num_slots:
                raise ValueError(f"{name}=None addresses slots 0..{batch - 1} but the cache has "
                                 f"num_slots={self.num_slots}")
            idx = torch.arange(batch, device=self.device)
            values = list(range(batch))
        else:
            if not isinstance(state_indices, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(state_indices).__name__}")
            if state_indices.dtype not in (torch.int32, torch.int64) or state_indices.shape != (batch,):
                raise ValueError(f"{name} must be an int32/int64 tensor of shape [{batch}] (one slot per batch "
                                 f"entry), got {state_indices.dtype} {list(state_indices.shape)}")
            if state_indices.device != self.device:
                raise ValueError(f"{name} is on {state_indices.device} but the cache is on {self.device}")
            memo = self._checked
            if (not compiling and memo is not None and memo.holds(state_indices) and memo.epoch == self._epoch
                    and memo.unwritten()):
                return memo.idx
            idx = state_indices.long()
            values = None if compiling else idx.tolist()
        if checks_on_device(idx.device):
            return _device_checked_slots(idx, self._allocated_on_device)
        if compiling:
            return torch.ops.attnrnn_nn.checked_slots(idx, self._allocated, name)
        _check_slot_values(values, self._allocated.tolist(), name)
        held = [idx] if state_indices is None or state_indices is idx else [state_indices, idx]
        self._checked = _Checked(tuple((t, version_of(t)) for t in held), idx, self._epoch, values)
        return idx

    def _slots_of(self, idx: torch.Tensor) -> List[int]:
        """The slots of ``idx`` as ints, right after check_indices returned it: from its check,
        without a device read."""
        memo = self._checked
        return memo.slots if memo is not None and idx is memo.idx else idx.tolist()

    def __repr__(self) -> str:
        pools = "\n".join(f"  [{i}] {p.describe()}" for i, p in enumerate(self.layers))
        return (f"AttentionCache(num_slots={self.num_slots}, free={self.num_free}, "
                f"{self.nbytes_per_slot()} bytes per slot)\n{pools}")
