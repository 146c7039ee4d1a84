"""Run the benchmark registry: attnrnn against its baselines in one process, JSON + a table.

    python -m bench --device cpu                       # the CPU targets (2 cores here)
    python -m bench --device cuda --out bench/results/h200.json
"""
import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

import attnrnn

from . import baselines, registry
from .timing import median_ms


def train_rows(shape, device, dtype, fla):
    B, T, H, D = shape.B, shape.T, shape.H, shape.D
    gen = torch.Generator(device="cpu").manual_seed(0)

    def make(*s):
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)

    q, k, v = make(B, T, H, D).sigmoid(), make(B, T, H, D).sigmoid(), make(B, T, H, D) * 0.5
    do = make(B, T, H, D)
    qh, kh, vh, doh = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    rows = []
    for normalize in (False, True):
        def ours_fwd():
            return attnrnn.chunk_linear_attn(q, k, v, normalize=normalize)[0]

        # Gradients are reset before each backward (as triton's do_bench(grad_to_none=...) does), so
        # neither side pays for accumulating into .grad.
        def ours_fwdbwd(ins=[t.detach().clone().requires_grad_() for t in (q, k, v)]):
            for t in ins:
                t.grad = None
            attnrnn.chunk_linear_attn(*ins, normalize=normalize)[0].backward(do)

        def torch_fwd():
            return baselines.torch_chunk(qh, kh, vh, normalize=normalize)

        def torch_fwdbwd(ins=[t.detach().clone().requires_grad_() for t in (qh, kh, vh)]):
            for t in ins:
                t.grad = None
            baselines.torch_chunk(*ins, normalize=normalize).backward(doh)

        impls = {"attnrnn": (ours_fwd, ours_fwdbwd), "torch_chunk": (torch_fwd, torch_fwdbwd)}
        if fla is not None:
            def fla_fwdbwd(ins=[t.detach().clone().requires_grad_() for t in (q, k, v)]):
                for t in ins:
                    t.grad = None
                fla["chunk"](*ins, normalize=normalize)[0].backward(do)

            impls["fla_chunk"] = (lambda: fla["chunk"](q, k, v, normalize=normalize)[0], fla_fwdbwd)
            if not normalize:
                impls["fla_fused_chunk"] = (lambda: fla["fused_chunk"](q, k, v, normalize=False)[0], None)
        for impl, (fwd, fwdbwd) in impls.items():
            for mode, fn in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
                if fn is None:
                    continue
                with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                    ms = median_ms(fn, device)
                rows.append(dict(suite="train", shape=shape.tag, normalize=normalize, mode=mode, impl=impl, ms=ms))
    return rows


def decode_rows(shape, device, dtype, fla):
    B, H, D = shape.B, shape.H, shape.D
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, H, D, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    S = torch.randn(B, H, D, D, generator=gen).to(device) * 0.01
    S_ours = S.clone()
    state = attnrnn.LinearAttnState(S_ours)
    impls = {
        "attnrnn": lambda: attnrnn.linear_attn_step(q, k, v, state, normalize=False, scale=1.0),
        "torch_step": lambda: baselines.torch_step(S, q, k, v),
    }
    if fla is not None:
        q4, k4, v4 = (t.unsqueeze(1) for t in (q, k, v))
        impls["fla_fused_recurrent"] = lambda: fla["fused_recurrent"](q4, k4, v4, initial_state=S,
                                                                      output_final_state=True)[0]
    rows = []
    with torch.no_grad():
        for impl, fn in impls.items():
            rows.append(dict(suite="decode", shape=shape.tag, normalize=False, mode="step", impl=impl,
                             ms=median_ms(fn, device, repeats=50)))
    return rows


def copy_bandwidth(device):
    """Device-to-device copy rate in bytes/s (read + write), the memory floor's denominator."""
    x = torch.empty(1 << 28, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x), device, repeats=20)
    return 2 * x.numel() * 4 / (ms * 1e-3)


def floor_bytes(row, elem_bytes):
    """Bytes that must move: q, k, v read and o written (forward); about 11/4 of that for
    forward+backward (q, k, v, do read, dq, dk, dv written, plus the forward); the fp32 state read
    and written once (decode)."""
    if row["suite"] == "decode":
        B, H, D = (int(x[1:]) for x in row["shape"].split("-"))
        return 2 * B * H * D * D * 4
    B, T, H, D = (int(x[1:]) for x in row["shape"].split("-"))
    fwd = 4 * B * T * H * D * elem_bytes
    return fwd if row["mode"] == "fwd" else fwd * 11 / 4


def add_floors(rows, bandwidth, elem_bytes):
    for r in rows:
        r["floor_ms"] = floor_bytes(r, elem_bytes) / bandwidth * 1e3
        r["pct_of_floor"] = 100 * r["floor_ms"] / r["ms"]


def add_ratios(rows):
    """Speed-up of attnrnn over each baseline measured on the same (shape, normalize, mode)."""
    ours = {(r["suite"], r["shape"], r["normalize"], r["mode"]): r["ms"] for r in rows if r["impl"] == "attnrnn"}
    for r in rows:
        mine = ours.get((r["suite"], r["shape"], r["normalize"], r["mode"]))
        r["attnrnn_speedup"] = None if mine is None else r["ms"] / mine
    return rows


def environment(device):
    env = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
           "machine": platform.machine(), "command": " ".join([Path(sys.executable).name, "-m", "bench"] + sys.argv[1:])}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    else:
        try:
            env["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
        except (OSError, StopIteration):
            env["cpu"] = platform.processor()
        env["cores"] = os.cpu_count()
    return env


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--suite", choices=["train", "decode", "all"], default="all")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/<device>.json)")
    args = parser.parse_args(argv)
    device = args.device
    dtype = getattr(torch, registry.DTYPE[device])
    fla = baselines.load_fla() if device == "cuda" else None
    rows = []
    if args.suite in ("train", "all"):
        for shape in registry.TRAIN[device]:
            rows += train_rows(shape, device, dtype, fla)
    if args.suite in ("decode", "all"):
        for shape in registry.DECODE[device]:
            rows += decode_rows(shape, device, dtype, fla)
    add_ratios(rows)
    bandwidth = copy_bandwidth(device) if device == "cuda" else None
    if bandwidth is not None:
        add_floors(rows, bandwidth, torch.finfo(dtype).bits // 8)
    out = Path(args.out or Path(__file__).parent / "results" / f"{device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    if bandwidth is not None:
        env["copy_TBps"] = bandwidth / 1e12
    out.write_text(json.dumps({"env": env, "dtype": registry.DTYPE[device], "rows": rows}, indent=1))
    print(f"{'suite':7s} {'shape':24s} {'norm':5s} {'mode':8s} {'impl':20s} {'ms':>10s} {'attnrnn x':>10s}"
          f" {'% floor':>8s}")
    for r in rows:
        speed = "" if r["attnrnn_speedup"] is None else f"{r['attnrnn_speedup']:.2f}"
        floor = f"{r['pct_of_floor']:.1f}" if "pct_of_floor" in r else ""
        print(f"{r['suite']:7s} {r['shape']:24s} {str(r['normalize']):5s} {r['mode']:8s} {r['impl']:20s} "
              f"{r['ms']:10.3f} {speed:>10s} {floor:>8s}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
