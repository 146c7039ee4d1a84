"""Run the benchmark registry: attnrnn against its baselines in one process, JSON + a table.

    python -m bench --device cpu                       # the CPU targets (2 cores here)
    python -m bench --device cuda --fla .whl/fla_core-0.6.0-py3-none-any.whl \\
        --out bench/results/h200.json --png bench/results/h200.png
    python -m bench --merge a.json b.json --out all.json --png all.png   # runs split by --shapes

Per training shape and normalize mode: forward and forward+backward time of attnrnn, the plain
PyTorch chunked version and (on CUDA, when loaded) fla chunk / fused_chunk, each after one untimed
warm-up call (Triton autotuning, lazy workspaces); on CUDA also the peak memory of one
forward+backward. Per decode shape: one step. Then ratios, % of the memory floor and the
targets (bench/report.py), computed from the medians.
"""
import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

import attnrnn

from . import baselines, registry, report, timing
from .timing import median_ms

MIB = report.MIB


def _error(row, e):
    row["ms"] = None
    row["error"] = f"{type(e).__name__}: {e}"[:500]
    print(f"  ERROR {row['suite']} {row['shape']} normalize={row['normalize']} {row['mode']} {row['impl']}: "
          f"{row['error']}", file=sys.stderr, flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _progress(row):
    extra = f"  peak {row['peak_mib']:.0f} MiB ({row['peak_ratio']:.2f}x io)" if row.get("peak_mib") is not None else ""
    if row.get("gpu_ms") is not None:
        extra = f"  GPU ahead {row['gpu_ms']:.3f} ms" + extra
    print(f"  {row['suite']} {row['shape']} normalize={row['normalize']} {row['mode']:7s} {row['impl']:20s}"
          f" {row['ms']:10.3f} ms{extra}", file=sys.stderr, flush=True)


def measure_train_impl(tag, normalize, impl, op, inputs, device, elem_bytes):
    """Rows (fwd, fwd+bwd) of one implementation op(q, k, v) -> o on inputs (q, k, v, do)."""
    q, k, v, do = inputs
    cuda = device == "cuda"

    def fresh():
        return [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        return op(q, k, v)

    # Gradients are reset before each backward (as triton's do_bench(grad_to_none=...) does), so
    # no implementation pays for accumulating into .grad.
    timed_ins = fresh()

    def fwdbwd():
        for t in timed_ins:
            t.grad = None
        op(*timed_ins).backward(do)

    def fwdbwd_once(a, b, c, d):
        op(a, b, c).backward(d)

    rows = []
    for mode in ("fwd", "fwd+bwd"):
        row = dict(suite="train", shape=tag, normalize=normalize, mode=mode, impl=impl)
        try:
            with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                # One untimed call first: Triton autotuning / compilation and lazy workspaces happen
                # here, never inside the timing or the memory measurement.
                warm = (lambda: fwd()) if mode == "fwd" else (lambda: fwdbwd_once(*fresh(), do))
                if cuda:
                    row["resident_mib"] = timing.resident_growth_bytes(warm) / MIB
                else:
                    warm()
                if cuda and mode == "fwd+bwd":
                    peak = timing.peak_cuda_bytes(lambda: fresh() + [do.detach().clone()], fwdbwd_once)
                    io = report.io_bytes_fwdbwd(tag, elem_bytes)
                    # Memory an op keeps allocated across calls (grown in its warm-up calls of this
                    # shape and mode) counts against it too.
                    resident = (row["resident_mib"] + rows[0].get("resident_mib", 0.0)) * MIB
                    row["peak_call_mib"] = peak / MIB
                    row["peak_mib"] = (peak + resident) / MIB
                    row["io_mib"] = io / MIB
                    row["peak_ratio"] = (peak + resident) / io
                row["ms"] = median_ms(fwd if mode == "fwd" else fwdbwd, device)
                if cuda and not timing.QUICK:
                    row["gpu_ms"] = timing.gpu_ms(fwd if mode == "fwd" else fwdbwd)
            _progress(row)
        except Exception as e:  # one failing implementation must not cost the whole (GPU) run
            _error(row, e)
        rows.append(row)
    return rows


def train_rows(shape, device, dtype, fla):
    B, T, H, D = shape.B, shape.T, shape.H, shape.D
    gen = torch.Generator(device="cpu").manual_seed(0)

    def make(*s):
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)

    q, k, v = make(B, T, H, D).sigmoid(), make(B, T, H, D).sigmoid(), make(B, T, H, D) * 0.5
    do = make(B, T, H, D)
    bthd = (q, k, v, do)
    bhtd = tuple(t.transpose(1, 2).contiguous() for t in bthd)
    elem_bytes = torch.finfo(dtype).bits // 8
    rows = []
    for normalize in (False, True):
        impls = {
            "attnrnn": (bthd, lambda a, b, c: attnrnn.chunk_linear_attn(a, b, c, normalize=normalize)[0]),
            "torch_chunk": (bhtd, lambda a, b, c: baselines.torch_chunk(a, b, c, normalize=normalize)),
        }
        if fla is not None:
            impls["fla_chunk"] = (bthd, lambda a, b, c: fla["chunk"](a, b, c, normalize=normalize)[0])
            impls["fla_fused_chunk"] = (bthd, lambda a, b, c: fla["fused_chunk"](a, b, c, normalize=normalize)[0])
        for impl, (inputs, op) in impls.items():
            rows += measure_train_impl(shape.tag, normalize, impl, op, inputs, device, elem_bytes)
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
            row = dict(suite="decode", shape=shape.tag, normalize=False, mode="step", impl=impl)
            try:
                fn()  # untimed warm-up call (Triton autotuning)
                if device == "cuda":
                    torch.cuda.synchronize()
                row["ms"] = median_ms(fn, device, repeats=50)
                _progress(row)
            except Exception as e:
                _error(row, e)
            rows.append(row)
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
    s = report.parse_tag(row["shape"])
    if row["suite"] == "decode":
        return 2 * s["B"] * s["H"] * s["D"] * s["D"] * 4
    fwd = 4 * s["B"] * s["T"] * s["H"] * s["D"] * elem_bytes
    return fwd if row["mode"] == "fwd" else fwd * 11 / 4


def add_floors(rows, bandwidth, elem_bytes):
    for r in rows:
        r["floor_ms"] = floor_bytes(r, elem_bytes) / bandwidth * 1e3
        r["pct_of_floor"] = None if r.get("ms") is None else 100 * r["floor_ms"] / r["ms"]


def environment(device, fla):
    env = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
           "machine": platform.machine(), "command": " ".join([Path(sys.executable).name, "-m", "bench"] + sys.argv[1:]),
           "fla": None if fla is None else fla["version"], "fla_source": None if fla is None else fla["source"],
           "quick": timing.QUICK}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        try:
            import triton
            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    else:
        try:
            env["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
        except (OSError, StopIteration):
            env["cpu"] = platform.processor()
        env["cores"] = os.cpu_count()
    return env


def finish(rows, env, dtype, out, png=None):
    """Derived fields, targets, JSON, tables and (optionally) the plot."""
    report.add_ratios(rows)
    checks = report.targets(rows, dtype) if env.get("gpu") else []  # the targets are the H200's
    doc = {"env": env, "dtype": dtype, "rows": rows, "targets": checks, "targets_summary": report.summary(checks)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    report.print_rows(rows)
    report.print_targets(checks)
    print(f"wrote {out}")
    if png:
        from . import plot
        plot.plot_files([out], png)
    return doc


def select(shapes, only):
    return shapes if not only else [s for s in shapes if s.tag in only]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--suite", choices=["train", "decode", "all"], default="all")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/<device>.json)")
    parser.add_argument("--png", default=None, help="also plot the JSON to this PNG (python -m bench.plot)")
    parser.add_argument("--fla", default="auto",
                        help="fla baseline (CUDA only): 'auto' = import it if installed (default), 'none' = skip "
                             "it, or a path to fla_core-*.whl / a site directory holding fla/")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shape tags to run (e.g. B1-T65536-H16-D128,B64-H32-D128); default all")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 warm-up, 3 repeats per median")
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="measure nothing: join the rows of these runs (later files win on the same row), "
                             "recompute ratios and targets, write --out (and --png)")
    args = parser.parse_args(argv)

    if args.merge:
        docs = [json.loads(Path(p).read_text()) for p in args.merge]
        dtypes = {d["dtype"] for d in docs}
        if len(dtypes) != 1:
            parser.error(f"--merge: the runs have different dtypes {sorted(dtypes)}")
        merged = {}
        for d in docs:
            for r in d["rows"]:
                merged[(r["suite"], r["shape"], r["normalize"], r["mode"], r["impl"])] = r
        env = dict(docs[0]["env"], merged_from=[{"file": p, "command": d["env"].get("command"),
                                                 "host_probe_us": d["env"].get("host_probe_us")}
                                                for p, d in zip(args.merge, docs)])
        if not args.out:
            parser.error("--merge needs --out")
        finish(list(merged.values()), env, dtypes.pop(), Path(args.out), args.png)
        return 0

    timing.QUICK = args.quick
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    dtype_name = registry.DTYPE[device]
    dtype = getattr(torch, dtype_name)
    only = None
    if args.shapes:
        only = {s.strip() for s in args.shapes.split(",") if s.strip()}
        known = {s.tag for s in registry.TRAIN[device] + registry.DECODE[device]}
        if only - known:
            parser.error(f"--shapes: unknown {sorted(only - known)}; {device} shapes are {sorted(known)}")
    if device == "cuda":
        fla = baselines.load_fla(args.fla)
    else:
        if args.fla not in ("auto", "none"):
            print("--fla ignored: fla is Triton, CUDA only", file=sys.stderr)
        fla = None
    print(f"fla: {'not loaded' if fla is None else fla['version'] + ' from ' + fla['source']}", file=sys.stderr)

    out = Path(args.out or Path(__file__).parent / "results" / f"{device}.json")
    env = environment(device, fla)
    if device == "cuda":
        env["host_probe_us"] = timing.host_probe_us()
        print(f"host probe (µs): {env['host_probe_us']}", file=sys.stderr)
    t0 = time.perf_counter()
    rows = []

    def checkpoint():  # partial JSON after each shape, so a run cut short still leaves its rows
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"env": dict(env, partial=True), "dtype": dtype_name, "rows": rows}, indent=1))

    if args.suite in ("train", "all"):
        for shape in select(registry.TRAIN[device], only):
            rows += train_rows(shape, device, dtype, fla)
            checkpoint()
            if device == "cuda":
                torch.cuda.empty_cache()
    if args.suite in ("decode", "all"):
        for shape in select(registry.DECODE[device], only):
            rows += decode_rows(shape, device, dtype, fla)
            checkpoint()
    if device == "cuda":
        bandwidth = copy_bandwidth(device)
        add_floors(rows, bandwidth, torch.finfo(dtype).bits // 8)
        env["copy_TBps"] = bandwidth / 1e12
    env["wall_s"] = round(time.perf_counter() - t0, 1)
    finish(rows, env, dtype_name, out, args.png)
    return 1 if any(r.get("ms") is None for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
