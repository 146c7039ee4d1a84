"""One forward call, in its own process, without the profiler: median per call between CUDA events
(bench/'s method), the host time until the call returns with the GPU idle at its start, and the
kernels' GPU time (CUDA-graph replay of 10 calls / 10).

    PYTHONPATH=python python scripts/call_host.py B1-T65536-H16-D128 [--normalize] [--no-grad]
"""
import statistics
import sys
import time

import torch

import attnrnn


def main():
    B, T, H, D = (int(x[1:]) for x in sys.argv[1].split("-"))
    normalize = "--normalize" in sys.argv
    torch.set_grad_enabled("--no-grad" not in sys.argv)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).sigmoid() for _ in range(3))
    fn = lambda: attnrnn.chunk_linear_attn(q, k, v, normalize=normalize)
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ev, host = [], []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        ev.append(start.elapsed_time(end) * 1e3)
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(10):
                fn()
    torch.cuda.synchronize()
    replay = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        replay.append(start.elapsed_time(end) * 1e3 / 10)
    print(f"{sys.argv[1]} norm={int(normalize)} grad={int(torch.is_grad_enabled())}: events {statistics.median(ev):7.1f} us, "
          f"host {statistics.median(host):6.1f} us (min {min(host):6.1f}), kernels (graph) {statistics.median(replay):7.1f} us",
          flush=True)


if __name__ == "__main__":
    main()
