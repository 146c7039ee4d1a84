"""Argument helpers shared by the public functions."""
import numbers

import torch


def check_tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def last_dim(x):
    """x's last dimension, 0 for a 0-D tensor (whose rank the op then refuses by name)."""
    return x.shape[-1] if x.dim() > 0 else 0


def as_real(x, name):
    """A real-number option as float: Python and NumPy reals; anything else raises, naming it."""
    if type(x) is float:  # the common call: no ABC check on the host's path
        return x
    if isinstance(x, (torch.Tensor, str, bool, complex)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    return float(x)


def as_flag(x, name):
    """A boolean option: a string ('False' would be true) raises instead, naming it."""
    if x is True or x is False:
        return x
    if isinstance(x, str):
        raise TypeError(f"{name} must be a bool, got str {x!r}")
    return bool(x)


def resolve_scale(scale, head_dim):
    """The scale option: a real number, or head_dim ** -0.5 when None."""
    if scale is None:
        return head_dim ** -0.5 if head_dim > 0 else 1.0
    return as_real(scale, "scale")


def scale_of(scale, x):
    """resolve_scale for inputs x: their last dimension is read only when scale is None."""
    if type(scale) is float:  # the common call
        return scale
    return resolve_scale(scale, last_dim(x))
