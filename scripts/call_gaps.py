"""Where a forward+backward call's time goes besides its kernels: per call as the benchmark times it
(CUDA events around one call, gradients reset, synchronized after each call), the GPU's busy time
inside the call, and the idle stretches between its kernels with the CUDA runtime calls the host
made meanwhile (from torch.profiler's trace).

    PYTHONPATH=python python scripts/call_gaps.py [--shapes B4-T8192-H16-D128,...] [--calls 10] [--host-detail]

--host-detail also lists, under each idle stretch, the host's operators and runtime calls that started
inside it and took at least MIN_OP_US (offset from the stretch's start, duration), in order.
"""
import collections
import json
import os
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import attnrnn
from kernel_times import label, shape_name, shapes_of

MIN_GAP_US = 3.0
MIN_OP_US = 2.0


def call_stats(trace_events, calls):
    """Per marked call: its span (first host op to last kernel end), the kernels' busy time, and
    its idle stretches longer than MIN_GAP_US as (length, kernel before or None at the call's start,
    kernel after, runtime calls that started inside the stretch)."""
    marks = sorted((e for e in trace_events if e.get("name") == "call" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])[-calls:]
    kernels = sorted((e for e in trace_events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                     key=lambda e: e["ts"])
    runtime = [e for e in trace_events if e.get("cat") == "cuda_runtime"]
    host_ops = sorted((e for e in trace_events if e.get("cat") in ("cpu_op", "cuda_runtime") and e.get("dur", 0) >= MIN_OP_US),
                      key=lambda e: e["ts"])
    out = []
    for i, mark in enumerate(marks):
        start = mark["ts"]
        end = marks[i + 1]["ts"] if i + 1 < len(marks) else float("inf")
        mine = [k for k in kernels if start <= k["ts"] < end]
        if not mine:
            continue
        busy = sum(k["dur"] for k in mine)
        span = mine[-1]["ts"] + mine[-1]["dur"] - start
        gaps = []
        edge, before = start, None
        for k in mine:
            if k["ts"] - edge > MIN_GAP_US:
                host = collections.Counter(r["name"] for r in runtime if edge <= r["ts"] < k["ts"])
                ops = [(o["ts"] - edge, o["dur"], o["name"]) for o in host_ops if edge <= o["ts"] < k["ts"]]
                gaps.append((k["ts"] - edge, before, k["name"], dict(host), ops))
            edge, before = max(edge, k["ts"] + k["dur"]), k["name"]
        out.append(dict(span=span, busy=busy, gaps=gaps))
    return out


def measure(B, T, H, D, normalize, calls):
    gen = torch.Generator(device="cpu").manual_seed(0)
    make = lambda: torch.randn(B, T, H, D, generator=gen).to("cuda", torch.bfloat16)
    q, k, v, do = make().sigmoid(), make().sigmoid(), make() * 0.5, make()
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def call():
        for t in (q, k, v):
            t.grad = None
        attnrnn.chunk_linear_attn(q, k, v, normalize=normalize)[0].backward(do)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function("call"):
                call()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return statistics.median(per_call), call_stats(events, calls)


def main():
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 10
    for shape in shapes_of(sys.argv):
        name = shape_name(*shape)
        for normalize in (False, True):
            median_us, stats = measure(*shape, normalize, calls)
            busy = statistics.median(s["busy"] for s in stats)
            span = statistics.median(s["span"] for s in stats)
            print(f"{name} norm={int(normalize)}  call {median_us:7.1f} us (events)  span {span:7.1f} us "
                  f"(profiled)  kernels busy {busy:7.1f} us  idle {span - busy:6.1f} us", flush=True)
            typical = stats[len(stats) // 2]
            for length, before, after, host, ops in sorted(typical["gaps"], key=lambda g: -g[0])[:6]:
                calls_in = ", ".join(f"{n} x{c}" for n, c in sorted(host.items(), key=lambda x: -x[1])[:4])
                print(f"    idle {length:6.1f} us  {label(before) if before else '(call start)'} -> {label(after)}  host: {calls_in or '-'}")
                if "--host-detail" in sys.argv:
                    for offset, dur, op in ops[:20]:
                        print(f"        +{offset:6.1f} us  {dur:6.1f} us  {op[:70]}")


if __name__ == "__main__":
    main()
