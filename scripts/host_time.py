"""Host time of one chunk_linear_attn call (forward without grad, forward with grad, forward+backward),
measured without synchronizing at a tiny shape, so that the GPU never holds the host back.

    PYTHONPATH=python python scripts/host_time.py
"""
import time

import torch

import attnrnn


def host_us(fn, calls=500):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    make = lambda: torch.randn(1, 64, 1, 64, device="cuda", dtype=torch.bfloat16)
    q, k, v = (make().requires_grad_() for _ in range(3))
    do = make()
    for normalize in (False, True):
        def forward_no_grad():
            with torch.no_grad():
                attnrnn.chunk_linear_attn(q, k, v, normalize=normalize)

        def forward():
            attnrnn.chunk_linear_attn(q, k, v, normalize=normalize)

        def forward_backward():
            for t in (q, k, v):
                t.grad = None
            attnrnn.chunk_linear_attn(q, k, v, normalize=normalize)[0].backward(do)

        print(f"host us per call, normalize={normalize}: forward without grad {host_us(forward_no_grad):.1f}, "
              f"forward {host_us(forward):.1f}, forward+backward {host_us(forward_backward):.1f}", flush=True)


if __name__ == "__main__":
    main()
