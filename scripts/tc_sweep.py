"""Tile-table measurements of the tensor-core chunk scan on the GPU: forward and forward+backward
times of chunk_linear_attn at the training shapes of design.md §5, for a given segment split
(ATTNRNN_TC_SEGMENTS, read once per process; 0 = the library's own choice).

    ATTNRNN_TC_SEGMENTS=0 PYTHONPATH=python:. python scripts/tc_sweep.py --out sweep_auto.json
"""
import argparse
import json
import os

import torch

import attnrnn
from bench.timing import median_ms

SHAPES = [(8, 2048, 16, 64), (4, 8192, 16, 128), (1, 65536, 16, 128), (8, 4096, 32, 64)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for B, T, H, D in SHAPES:
        make = lambda: torch.randn(B, T, H, D, generator=gen).to("cuda", torch.bfloat16)
        q, k, v, do = make().sigmoid(), make().sigmoid(), make() * 0.5, make()
        for normalize in (False, True):
            fwd = median_ms(lambda: attnrnn.chunk_linear_attn(q, k, v, normalize=normalize), "cuda")
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

            def fwdbwd():
                for t in leaves:
                    t.grad = None
                attnrnn.chunk_linear_attn(*leaves, normalize=normalize)[0].backward(do)

            both = median_ms(fwdbwd, "cuda")
            floor_ms = 4 * q.numel() * 2 / 4.0e12 * 1e3
            rows.append(dict(shape=[B, T, H, D], normalize=normalize, fwd_ms=fwd, fwdbwd_ms=both,
                             fwd_pct_floor=100 * floor_ms / fwd,
                             segments=os.environ.get("ATTNRNN_TC_SEGMENTS", "0")))
            print(f"B{B}-T{T}-H{H}-D{D} norm={int(normalize)}  fwd {fwd * 1e3:8.1f} us "
                  f"({rows[-1]['fwd_pct_floor']:4.1f}% floor)  fwd+bwd {both * 1e3:8.1f} us", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
