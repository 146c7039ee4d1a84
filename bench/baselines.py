"""What a user would otherwise run: plain PyTorch written by hand, and fla when it is installed."""
import torch


def torch_chunk(q, k, v, normalize=False, C=64, eps=1e-6):
    """Plain PyTorch chunked linear attention on [B, H, T, D] (T a multiple of C), fp32 state.

    The unnormalized branch is the hand-written version measured in shared/anchors.md.
    """
    B, H, T, D = q.shape
    n = T // C
    qc, kc, vc = (t.reshape(B, H, n, C, t.shape[-1]) for t in (q, k, v))
    kv = (kc.transpose(-1, -2) @ vc).float()
    S = kv.cumsum(2) - kv
    mask = torch.ones(C, C, device=q.device, dtype=torch.bool).tril()
    scores = (qc @ kc.transpose(-1, -2)).masked_fill(~mask, 0)
    o = (qc.float() @ S) + (scores @ vc).float()
    if normalize:
        ksum = kc.float().sum(-2)
        z = ksum.cumsum(2) - ksum
        den = (qc.float() * z.unsqueeze(-2)).sum(-1) + scores.float().sum(-1) + eps
        o = o / den.unsqueeze(-1)
    return o.to(q.dtype).reshape(B, H, T, -1)


def torch_step(S, q, k, v):
    """Eager decode step on [B, H, D] inputs and an fp32 state [B, H, D, D]: S += k^T v; o = q S."""
    S.add_(k.float().unsqueeze(-1) * v.float().unsqueeze(-2))
    return (q.float().unsqueeze(-2) @ S).squeeze(-2)


def load_fla():
    """fla.ops.linear_attn functions, or None when fla is not installed."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn, fused_chunk_linear_attn, fused_recurrent_linear_attn
    except Exception:  # fla is optional: a missing or broken install only drops its rows
        return None
    return {"chunk": chunk_linear_attn, "fused_chunk": fused_chunk_linear_attn,
            "fused_recurrent": fused_recurrent_linear_attn}
