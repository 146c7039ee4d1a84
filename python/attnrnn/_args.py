"""Argument helpers shared by the public functions, layers and models: an option of the wrong type
raises TypeError, one of the right type but out of range ValueError, each naming the argument."""
import math
import numbers

import torch

#: The largest head dimension (K of q and k, V of v) the linear-attention kernels take.
MAX_HEAD_DIM = 256


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


def as_finite(x, name, minimum=None):
    """A finite real option (>= minimum when given) as float."""
    value = as_real(x, name)
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" and >= {minimum}"
        raise ValueError(f"{name} must be finite{bound}, got {x!r}")
    return value


def as_scale(scale, name="scale"):
    """The scale option of a layer or function: None (the default for the head dim) or a finite real."""
    return None if scale is None else as_finite(scale, name)


def as_flag(x, name):
    """A boolean option: True or False (a NumPy bool too). Anything else raises TypeError naming it:
    None or the string 'False' would otherwise read as a truth value."""
    if x is True or x is False:
        return x
    if type(x).__module__ == "numpy" and type(x).__name__ in ("bool_", "bool"):
        return bool(x)
    raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")


def as_int(x, name, minimum, maximum=None, allow_none=False):
    """An integer option in [minimum, maximum] (None too when allow_none); bools are not ints."""
    if x is None and allow_none:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        none = " or None" if allow_none else ""
        raise TypeError(f"{name} must be an int{none}, got {type(x).__name__} {x!r}")
    x = int(x)
    if x < minimum or (maximum is not None and x > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {bound}, got {x}")
    return x


def as_head_dim(x, name):
    """A head dimension of the linear-attention kernels: an int in [1, MAX_HEAD_DIM]."""
    return as_int(x, name, 1, MAX_HEAD_DIM)


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


def check_feature_map_output(fx, x, name):
    """The result fx of a callable feature map applied to x (``name``, e.g. 'feature_map(q)'): a
    tensor with x's leading dimensions and unit stride in its last one, as the kernels read it."""
    check_tensor(fx, name)
    if fx.dim() != x.dim() or fx.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"{name} must keep the leading dimensions {list(x.shape[:-1])} of its input, got shape "
                         f"{list(fx.shape)}")
    if fx.numel() and fx.shape[-1] > 1 and fx.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {list(fx.stride())}")
