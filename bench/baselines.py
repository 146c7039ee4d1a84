"""What a user would otherwise run: plain PyTorch written by hand, and fla when it is installed."""
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

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


def load_fla(spec="auto"):
    """fla.ops.linear_attn functions (plus "version" and "source"), or None.

    spec: "auto" imports fla if it is installed (None when it is not, or is broken); "none" skips
    it; a path to a wheel (fla_core-*.whl, pure Python) is unpacked once into a cache directory
    and put first on sys.path; a path to a directory (a site dir holding fla/) is put first on
    sys.path. With a path, a failed import raises: fla was asked for.
    """
    if spec is None or str(spec).lower() == "none":
        return None
    if spec != "auto":
        path = Path(spec).expanduser().resolve()
        if path.is_file() and path.suffix == ".whl":
            path = _unpack_wheel(path)
        elif not path.is_dir():
            raise FileNotFoundError(f"--fla: {spec} is neither a wheel (.whl) nor a directory")
        sys.path.insert(0, str(path))
        for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
            del sys.modules[name]  # an fla imported earlier from elsewhere must not shadow this one
    try:
        import fla
        from fla.ops.linear_attn import chunk_linear_attn, fused_chunk_linear_attn, fused_recurrent_linear_attn
    except Exception as e:  # fla is optional: a missing or broken install only drops its rows
        if spec != "auto":
            raise RuntimeError(f"--fla {spec}: importing fla failed: {e!r}") from e
        print(f"fla not loaded ({type(e).__name__}: {e}); its rows are skipped", file=sys.stderr)
        return None
    return {"chunk": chunk_linear_attn, "fused_chunk": fused_chunk_linear_attn,
            "fused_recurrent": fused_recurrent_linear_attn,
            "version": getattr(fla, "__version__", "?"), "source": str(Path(fla.__file__).parent)}


def _unpack_wheel(wheel):
    """Unpack a pure-Python wheel (a zip) into $TMPDIR/attnrnn-bench-wheels/<name>; reused when done."""
    dest = Path(tempfile.gettempdir()) / "attnrnn-bench-wheels" / wheel.stem
    done = dest / ".unpacked"
    if not done.exists():
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(dest)
        done.write_text(str(wheel))
    return dest
