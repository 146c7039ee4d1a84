"""Outputs and gradients of chunk_linear_attn on fixed cases, saved for a bitwise comparison of two
builds (scripts/ab_forward.sh with BITWISE=1): a change that only moves work between a kernel's
phases must leave every bit of them alone.

    PYTHONPATH=<tree>/python:tests/python python3 scripts/outputs_of.py OUT.pt      (saves)
    python3 scripts/outputs_of.py --compare A.pt B.pt                                (compares)
The cases run the tensor-core sweeps with K, V in {64, 128}: normalize on and off, states, GQA,
varlen, two-pass splits, fp16 with a feature map (ATTNRNN_TC_WGMMA=127 pairs the D = 128 sweeps).
"""
import sys

import torch

bf16, fp16 = torch.bfloat16, torch.float16


def cases():
    from cases import Case
    return [
        Case(16, 130, 4, 128, bf16, initial_state=True, final_state=True),
        Case(1, 2048, 2, 128, bf16, Hkv=1, initial_state=True, final_state=True),
        Case(1, 5000, 4, 128, bf16, Hkv=2, initial_state=True, final_state=True),
        Case(1, 333, 4, 128, bf16, Hkv=2, seqlens=(0, 64, 1, 200, 68)),
        Case(2, 300, 4, 64, bf16, Hkv=2, initial_state=True, final_state=True),
        Case(1, 3000, 2, 64, bf16, initial_state=True, final_state=True),
        Case(2, 190, 2, 128, fp16, feature_map="relu", initial_state=True, final_state=True),
        Case(2, 190, 2, 64, fp16, V=128),
        Case(1, 3000, 2, 128, bf16, V=64, feature_map=None, normalize=False),
        Case(1, 4200, 2, 128, bf16, normalize=False),  # elu1 through the fused dk + dv sweep, a ragged last chunk
    ]


def save(path):
    import attnrnn
    from cases import make_inputs, run
    out = {}
    for case in cases():
        got = run(attnrnn.chunk_linear_attn, case, make_inputs(case, "cuda"))
        out.update({f"{case.id}:{name}": t.cpu() for name, t in got.items()})
    torch.save(out, path)


def same_bits(x, y):
    """Equal shapes, dtypes and bits (NaNs with the same payload count as equal)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return torch.equal(x.contiguous().view(as_int), y.contiguous().view(as_int))


def compare(a_path, b_path):
    a, b = torch.load(a_path), torch.load(b_path)
    missing = sorted(set(a) ^ set(b))
    common = [k for k in a if k in b]
    differ = [k for k in common if not same_bits(a[k], b[k])]
    verdict = "BITWISE EQUAL" if not differ and not missing else "BITWISE DIFFERENT"
    print(f"{verdict}: {a_path} vs {b_path}: {len(common) - len(differ)} of {len(common)} tensors equal"
          + (f"; differ: {', '.join(differ[:8])}" if differ else "") + (f"; in one file only: {missing}" if missing else ""))
    for k in differ:  # how far apart: for a change that moves roundings on purpose
        x, y = a[k].double(), b[k].double()
        if x.shape == y.shape:
            print(f"  {k}: max |a - b| / max |a| = {((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item():.3e}")
    return not differ and not missing


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(0 if compare(sys.argv[2], sys.argv[3]) else 1)
    save(sys.argv[1])
