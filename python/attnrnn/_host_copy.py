"""Host copies of values held in device tensors, so that a decoding step need not read them back (a
sync on CUDA) when nothing but their owner wrote the tensor since."""
from typing import Any, Callable, Optional

import torch


def version_of(t: torch.Tensor) -> Optional[int]:
    """t's version counter (bumped by every in-place write); None for an inference tensor, which has none."""
    return None if t.is_inference() else t._version


class HostCopy:
    """A value read from a tensor, trusted while the tensor is the same object at the same version:
    any other write (or a replaced tensor, or an inference tensor, which has no version) has it read
    again. Its owner records what it wrote itself with ``set``."""

    def __init__(self):
        self._of = None  # (the tensor, its version then, the value)

    def trusted(self, t: torch.Tensor) -> Any:
        """The value if it still holds for t, else None (no device read)."""
        of = self._of
        if of is not None and of[0] is t and of[1] is not None and version_of(t) == of[1]:
            return of[2]
        return None

    def get(self, t: torch.Tensor, read: Callable[[torch.Tensor], Any]) -> Any:
        """The value, from read(t) only when the copy does not hold."""
        value = self.trusted(t)
        if value is None:
            value = read(t)
            self.set(t, value)
        return value

    def set(self, t: torch.Tensor, value: Any) -> None:
        """value is what t holds now (its owner just wrote it)."""
        self._of = (t, version_of(t), value)
