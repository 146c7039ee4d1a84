"""Timing: medians over repeats after warm-up; CUDA events on the GPU, perf_counter on the CPU."""
import statistics
import time

import torch


def median_ms(fn, device, warmup=3, repeats=15, min_seconds=0.5):
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        start_all = time.perf_counter()
        while len(times) < repeats or (time.perf_counter() - start_all < min_seconds and len(times) < 1000):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        start_all = time.perf_counter()
        while len(times) < repeats or (time.perf_counter() - start_all < min_seconds and len(times) < 1000):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
