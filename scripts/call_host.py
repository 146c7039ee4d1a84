"""One call, in its own process, without the profiler (torch.profiler slows a process's later
calls): median per call between CUDA events (bench/'s method), the host time until the call
returns with the GPU idle at its start, and the GPU's own time: for the forward, the kernels of a
CUDA graph of 20 calls replayed (decode_probe.py's measure); with --backward (forward+backward as
bench/ times it, gradients reset), bench.timing.gpu_ms: the call enqueued behind a sleep kernel,
so that the host has launched everything (the autograd engine's hand-off included) before the GPU
gets there.
events - ahead is then the host's share the GPU waited for.

    PYTHONPATH=.:python:scripts python scripts/call_host.py B1-T65536-H16-D128 [--normalize] [--no-grad] [--backward]
"""
import statistics
import sys
import time

import torch

import attnrnn
from bench.timing import gpu_ms
from decode_probe import event_ms, one_call_and_kernel_ms
from kernel_times import shapes_of


def main():
    [(B, T, H, D)] = shapes_of(["--shapes", sys.argv[1]])
    normalize = "--normalize" in sys.argv
    backward = "--backward" in sys.argv
    torch.set_grad_enabled(backward or "--no-grad" not in sys.argv)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).sigmoid() for _ in range(3))
    if backward:
        do = torch.randn_like(q)
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def fn():
            for t in (q, k, v):
                t.grad = None
            attnrnn.chunk_linear_attn(q, k, v, normalize=normalize)[0].backward(do)

        for _ in range(3):
            fn()
        per_call_ms, gpu_time_ms, gpu_label = event_ms(fn, 50), gpu_ms(fn, 30), "GPU ahead"
    else:
        fn = lambda: attnrnn.chunk_linear_attn(q, k, v, normalize=normalize)
        (per_call_ms, gpu_time_ms), gpu_label = one_call_and_kernel_ms(fn), "kernels (graph)"
    host = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    print(f"{sys.argv[1]} norm={int(normalize)} {'fwd+bwd' if backward else f'grad={int(torch.is_grad_enabled())}'}: "
          f"events {per_call_ms * 1e3:7.1f} us, host {statistics.median(host):6.1f} us (min {min(host):6.1f}), "
          f"{gpu_label} {gpu_time_ms * 1e3:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
