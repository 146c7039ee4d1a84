"""Feature maps phi for linear attention, as modules.

The names ``"elu1"``, ``"relu"`` and ``"identity"`` are fused into the kernels (no module, no
extra memory traffic). A module is applied to q ``[B, T, H, K]`` and k ``[B, T, Hkv, K]`` in
Python before the kernels and may be learnable; it maps the last dimension K to
``feature_dim`` (which becomes the K of the state).
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["HedgehogFeatureMap", "ELU1FeatureMap", "ReLUFeatureMap"]


class HedgehogFeatureMap(nn.Module):
    """Learnable softmax feature map (Zhang et al. 2024, "The Hedgehog & the Porcupine").

    ``phi(x) = [softmax(x W + b), softmax(-(x W + b))]`` over the last dimension, with ``W [K, F]``
    shared by all heads (so the same module serves H query heads and Hkv key heads under GQA).
    Initialised with ``W = I`` (F = K), so it starts as a symmetric softmax of x.

    Shapes: ``x [..., K]`` -> ``[..., 2 F]``; ``feature_dim = 2 F``.
    """

    def __init__(self, head_dim: int, proj_dim: int = None):
        super().__init__()
        proj_dim = head_dim if proj_dim is None else proj_dim
        self.head_dim, self.proj_dim = head_dim, proj_dim
        self.feature_dim = 2 * proj_dim
        self.proj = nn.Linear(head_dim, proj_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W = I (first min(K, F) rows), b = 0."""
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(self.proj_dim, self.head_dim))
            self.proj.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.proj(x)
        return torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, feature_dim={self.feature_dim}"


class ELU1FeatureMap(nn.Module):
    """``elu(x) + 1`` in Python (the fused ``"elu1"`` is faster; this is for composition)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.elu(x) + 1


class ReLUFeatureMap(nn.Module):
    """``relu(x)`` in Python (the fused ``"relu"`` is faster; this is for composition)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)
