"""One forward call, in its own process, without the profiler (torch.profiler slows a process's
later calls): median per call between CUDA events (bench/'s method), the host time until the call
returns with the GPU idle at its start, and the kernels' GPU time (a CUDA graph of 20 calls,
replayed; decode_probe.py's measure).

    PYTHONPATH=.:python:scripts python scripts/call_host.py B1-T65536-H16-D128 [--normalize] [--no-grad]
"""
import statistics
import sys
import time

import torch

import attnrnn
from decode_probe import one_call_and_kernel_ms
from kernel_times import shapes_of


def main():
    [(B, T, H, D)] = shapes_of(["--shapes", sys.argv[1]])
    normalize = "--normalize" in sys.argv
    torch.set_grad_enabled("--no-grad" not in sys.argv)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).sigmoid() for _ in range(3))
    fn = lambda: attnrnn.chunk_linear_attn(q, k, v, normalize=normalize)
    per_call_ms, kernels_ms = one_call_and_kernel_ms(fn)
    host = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    print(f"{sys.argv[1]} norm={int(normalize)} grad={int(torch.is_grad_enabled())}: events {per_call_ms * 1e3:7.1f} us, "
          f"host {statistics.median(host):6.1f} us (min {min(host):6.1f}), kernels (graph) {kernels_ms * 1e3:7.1f} us",
          flush=True)


if __name__ == "__main__":
    main()
