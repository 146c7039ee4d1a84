"""Bridges from other libraries' models to attnrnn's kernels.

Each bridge is a submodule that imports its library only when used, so that importing attnrnn
never imports it: ``attnrnn.integrations.fla`` runs flash-linear-attention's linear-attention
layers (and the HF models built on them) on attnrnn's ops.
"""
