"""GPU time of each kernel of chunk_linear_attn's forward (and forward+backward with --backward) at
the training shapes, from torch.profiler: kernel times without the host's share of a call.

    ATTNRNN_TC_WGMMA=3 PYTHONPATH=python python scripts/kernel_times.py [--backward] [--shapes B1-T65536-H16-D128,...] [--fp16]
(--shapes takes any B-T-H-D names, not only the training shapes; --fp16 times float16 inputs instead of bfloat16;
--feature-map NAME passes feature_map=NAME, e.g. relu or elu1.)
(ATTNRNN_TC_WGMMA: 0 the mma.sync scans, 1 the wgmma forward, 3 the wgmma forward and backward,
7 with dk and dv in one sweep at K = V = 64, 15 also the forward at K = 128, 31 also dq at V = 128
and 63 (default) also dk and dv at inner dim 128 on 128-token chunks, where the shape rule picks
them (127: at every shape);
ATTNRNN_BWD_CONCURRENT=0, the default, keeps the backward's sweeps apart, so that each one's time is its own.)
Sweep kernels are listed by role (chunk_wg_kernel:dk).
"""
import collections
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import attnrnn

SHAPES = [(8, 2048, 16, 64), (4, 8192, 16, 128), (1, 65536, 16, 128), (8, 4096, 32, 64)]
REPS = 20
ROLES = ["fwd", "den", "dq", "dk", "dv", "dkv"]  # TcRole's order (csrc/cuda/chunk_tc_plan.cuh)


def label(kernel_name):
    """The kernel's short name, with its sweep role when it has one (chunk_wg_kernel:dk)."""
    short = kernel_name.split("(")[0].split("<")[0].removeprefix("void ").split("::")[-1][:40]
    role = re.search(r"TcRole\)(\d)", kernel_name)
    return f"{short}:{ROLES[int(role.group(1))]}" if role else short


def shape_name(B, T, H, D):
    return f"B{B}-T{T}-H{H}-D{D}"


def shapes_of(argv):
    """(B, T, H, D) of --shapes B1-T65536-H16-D128,... in argv, else the training shapes."""
    if "--shapes" not in argv:
        return SHAPES
    wanted = argv[argv.index("--shapes") + 1].split(",")
    parsed = [re.fullmatch(r"B(\d+)-T(\d+)-H(\d+)-D(\d+)", name) for name in wanted]
    if not all(parsed):
        sys.exit(f"--shapes: expected names like {shape_name(*SHAPES[0])}, got {','.join(wanted)}")
    return [tuple(int(g) for g in m.groups()) for m in parsed]


def main():
    backward = "--backward" in sys.argv
    shapes = shapes_of(sys.argv)
    dtype = torch.float16 if "--fp16" in sys.argv else torch.bfloat16
    feature_map = sys.argv[sys.argv.index("--feature-map") + 1] if "--feature-map" in sys.argv else None
    gen = torch.Generator(device="cpu").manual_seed(0)
    for B, T, H, D in shapes:
        make = lambda: torch.randn(B, T, H, D, generator=gen).to("cuda", dtype)
        q, k, v, do = make().sigmoid(), make().sigmoid(), make() * 0.5, make()
        if backward:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
        for normalize in (False, True):
            def call():
                o = attnrnn.chunk_linear_attn(q, k, v, normalize=normalize, feature_map=feature_map)[0]
                if backward:
                    o.backward(do)
                    q.grad = k.grad = v.grad = None  # else each rep adds its gradients into .grad
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(REPS):
                    call()
                torch.cuda.synchronize()
            per_kernel = collections.defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[label(e.name)] += e.device_time_total / REPS
            total = sum(per_kernel.values())
            parts = ", ".join(f"{n} {t:.1f}" for n, t in sorted(per_kernel.items(), key=lambda x: -x[1]))
            print(f"{shape_name(B, T, H, D)} norm={int(normalize)}  gpu {total:8.1f} us  [{parts}]", flush=True)


if __name__ == "__main__":
    main()
