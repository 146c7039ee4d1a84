"""Runs chunk_linear_attn forward (and forward+backward with --backward) a few times at one shape,
for profiling the tensor-core scan with ncu:

    ncu --kernel-name regex:chunk_tc --launch-skip 2 --launch-count 1 python scripts/tc_profile.py 8 4096 32 64
"""
import sys

import torch

import attnrnn

B, T, H, D = (int(x) for x in sys.argv[1:5])
backward = "--backward" in sys.argv
normalize = "--normalize" in sys.argv
gen = torch.Generator(device="cpu").manual_seed(0)
make = lambda: torch.randn(B, T, H, D, generator=gen).to("cuda", torch.bfloat16)
q, k, v, do = make().sigmoid().requires_grad_(), make().sigmoid().requires_grad_(), make().requires_grad_(), make()
for _ in range(3):
    o = attnrnn.chunk_linear_attn(q, k, v, normalize=normalize)[0]
    if backward:
        o.backward(do)
torch.cuda.synchronize()
