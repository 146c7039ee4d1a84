"""Argument helpers shared by the public functions."""
import torch


def check_tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def resolve_scale(scale, head_dim):
    """The scale option: a Python number, or head_dim ** -0.5 when None."""
    if scale is None:
        return head_dim ** -0.5 if head_dim > 0 else 1.0
    if isinstance(scale, torch.Tensor):
        raise TypeError("scale must be a Python number, got a tensor")
    return float(scale)
