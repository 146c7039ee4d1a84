"""The GPU's side of one forward+backward call as bench/ times it (gradients reset), with the host
out of the way: each call is enqueued behind a sleep kernel, so everything is launched before the
GPU gets to it (bench.timing.gpu_ms's method). Lists, for a typical call, every GPU operation
(kernels, memsets, copies) in order with its start after the sleep ended, its duration and the idle
time before it, then the call's GPU span against the sum of its operations.

    PYTHONPATH=.:python:scripts python scripts/gpu_timeline.py [--shapes B4-T8192-H16-D128,...] [--normalize] [--calls 10]
"""
import json
import os
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import attnrnn
from bench.timing import AHEAD_SLEEP_CYCLES
from kernel_times import label, shape_name, shapes_of

GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def calls_after_sleeps(events):
    """Per call: the GPU operations between one sleep kernel's end and the next sleep's start."""
    ops = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    sleeps = [i for i, e in enumerate(ops) if "sleep" in e["name"]]
    out = []
    for n, i in enumerate(sleeps):
        end = sleeps[n + 1] if n + 1 < len(sleeps) else len(ops)
        start = ops[i]["ts"] + ops[i]["dur"]
        out.append((start, ops[i + 1:end]))
    return out


def measure(B, T, H, D, normalize, calls):
    gen = torch.Generator(device="cpu").manual_seed(0)
    make = lambda: torch.randn(B, T, H, D, generator=gen).to("cuda", torch.bfloat16)
    q, k, v, do = make(), make(), make(), make()
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def call():
        for t in (q, k, v):
            t.grad = None
        attnrnn.chunk_linear_attn(q, k, v, normalize=normalize)[0].backward(do)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.cuda._sleep(AHEAD_SLEEP_CYCLES)
            call()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return calls_after_sleeps(json.load(f)["traceEvents"])


def main():
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 10
    normalize = "--normalize" in sys.argv
    for shape in shapes_of(sys.argv):
        per_call = measure(*shape, normalize, calls)
        spans = [ops[-1]["ts"] + ops[-1]["dur"] - start for start, ops in per_call if ops]
        busy = [sum(o["dur"] for o in ops) for _, ops in per_call if ops]
        typical = sorted(range(len(spans)), key=lambda i: spans[i])[len(spans) // 2]
        start, ops = per_call[typical]
        print(f"{shape_name(*shape)} norm={int(normalize)}  GPU span after the sleep {statistics.median(spans):7.1f} us"
              f"  operations {statistics.median(busy):7.1f} us  (median of {len(spans)} calls)", flush=True)
        edge = start
        for o in ops:
            print(f"    +{o['ts'] - start:7.1f} us  {o['dur']:7.1f} us  idle before {o['ts'] - edge:5.1f}  "
                  f"{o['cat']:10s} {label(o['name'])}")
            edge = max(edge, o["ts"] + o["dur"])


if __name__ == "__main__":
    main()
