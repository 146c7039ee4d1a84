"""Timing: medians over repeats after warm-up; CUDA events on the GPU, perf_counter on the CPU.
Memory: peak CUDA memory of one call, from torch's caching allocator."""
import gc
import statistics
import time

import torch

# Set by `python -m bench --quick` (a smoke run: fewer repeats, no minimum duration).
QUICK = False


def median_ms(fn, device, warmup=3, repeats=15, min_seconds=0.5):
    if QUICK:
        warmup, repeats, min_seconds = 1, 3, 0.0
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


# ~2 ms at the H200's 1.98 GHz: longer than the host's path through any call measured here.
AHEAD_SLEEP_CYCLES = 4_000_000


def gpu_ms(fn, repeats=20):
    """The GPU's own time for fn(): fn enqueued behind a sleep kernel, so that the host has launched
    all of it (the autograd engine's hand-off included) before the GPU gets there, minus the
    sleep's own time; median_ms(fn) minus this is the host's share the GPU waited for."""
    sleep = lambda: torch.cuda._sleep(AHEAD_SLEEP_CYCLES)
    ahead = lambda call: median_ms(call, "cuda", warmup=1, repeats=repeats, min_seconds=0.0)
    return ahead(lambda: (sleep(), fn())) - ahead(sleep)


def _settle():
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def resident_growth_bytes(fn):
    """CUDA memory still allocated after fn() that was not before (fn must drop what it returns):
    workspaces or caches an op keeps across calls. Run it on the op's first (warm-up) call."""
    before = _settle()
    fn()
    return _settle() - before


def peak_cuda_bytes(make_inputs, run):
    """Peak CUDA memory of run(*make_inputs()), the inputs included, in bytes.

    The inputs are made first and the allocator's peak is reset once they exist, so the peak is
    max(allocated during run) - allocated before the inputs: inputs + everything run allocates at
    its highest point (outputs, saved tensors, gradients, temporaries). Call it after a warm-up
    call of the same op (autotuning, lazy workspaces), never before.
    """
    before = _settle()
    inputs = make_inputs()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del inputs
    _settle()
    return peak


def host_us(fn, calls=2000, batch=50, busy=False):
    """Median host time (µs) until fn() returns, in batches with the GPU waited for between them, so
    that no launch queues behind earlier ones; busy: a sleep kernel keeps the GPU occupied through
    each batch (no launch waits for an idle GPU either)."""
    for _ in range(batch):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls // batch):
        if busy:
            torch.cuda._sleep(50_000_000)
        for _ in range(batch):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def host_probe_us():
    """The host's speed in this run: host_us of torch.empty(0) on the GPU and of one tiny kernel
    launch (x.add_(1)). Small calls of every implementation (fla's Triton launches most of all)
    scale with it, so runs on different hosts compare only with it at hand."""
    x = torch.zeros(64, device="cuda")
    probes = {"empty_us": lambda: torch.empty(0, device="cuda"), "launch_us": lambda: x.add_(1)}
    return {name: round(host_us(fn), 2) for name, fn in probes.items()}
