"""attnrnn's chunk_linear_attn against fla's chunk over the head-dim grid in bf16, and in fp32 at
PyTorch's float32 matmul precisions "highest" and "high", in one process.

    python -m bench.head_dims --fla .whl/fla_core-0.6.0-py3-none-any.whl \\
        --out bench/results/head_dims_h100.json

A call too short for the whole grid measures part of it (--only RUN,RUN) into the same file
(--append keeps the file's rows of the other runs; "partial" stays true while a run has none).

Per (K, V) at B4-T8192 (H16 for dims up to 128, H32 at 32, H8 past 128), normalize on and off:
forward and forward+backward medians of both, after one untimed call each (Triton autotuning), the
speed-up over fla and the share of the memory floor: q, k, v read and o written forward; with the
backward also q, k, v, do read and dq, dk, dv written (6K + 5V elements per (token, head)), at the
device's copy rate. fp32 rows (K = V up to 128, the mma.sync sweeps' dims) run under each precision
setting; fla's Triton kernels read fp32 operands as TF32 under both. At K = V = 32, 64 and 128 in
bf16, and for fp32 at "high" (where sm_90a runs TF32 wgmma), attnrnn's mma.sync sweeps (the path of
GPUs without wgmma) are timed too, forced through the testing hook on the same GPU: a stand-in for
Ampere-class parts.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

import attnrnn

from . import baselines, timing
from .__main__ import copy_bandwidth, environment
from .timing import gpu_ms, median_ms

# (K, V, H): the square dims, a wide V and a narrow one
GRID = [(32, 32, 32), (64, 64, 16), (96, 96, 16), (128, 128, 16), (192, 192, 8), (256, 256, 8), (64, 256, 8),
        (128, 64, 16)]
# fp32: the square head dims its tensor-core (mma.sync) sweeps take, under each float32 matmul precision
FP32_GRID = [(32, 32, 32), (64, 64, 16), (96, 96, 16), (128, 128, 16)]
FP32_PRECISIONS = ["highest", "high"]
B, T = 4, 8192
# bf16 dims also timed on the mma.sync sweeps
MMA_SYNC_DIMS = [(32, 32), (64, 64), (128, 128)]


def or_dash(x, spec):
    """x formatted by spec, or "-" for a time that was not measured."""
    return "-" if x is None else format(x, spec)


def write_results(out, env, rows, partial=False):
    """The JSON a GPU bench writes: its environment (partial while shapes remain) and its rows."""
    Path(out).write_text(json.dumps({"env": dict(env, partial=True) if partial else env, "rows": rows}, indent=1))


def floor_bytes(K, V, H, mode, element_bytes):
    per_token_head = 2 * K + 2 * V if mode == "fwd" else 6 * K + 5 * V
    return B * T * H * per_token_head * element_bytes


def measure(op, q, k, v, do, gpu_only=False):
    """Times of op(q, k, v) -> o, each after one untimed call (Triton autotuning): the forward (under
    no_grad) and forward+backward, as medians of calls with their host time (fwd_ms, fwdbwd_ms) and,
    with gpu_only, also as the GPU's own time (fwd_gpu_ms, fwdbwd_gpu_ms; timing.gpu_ms)."""
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwdbwd():
        for t in ins:
            t.grad = None
        op(*ins).backward(do)

    times = {}
    for name, call, grad in (("fwd", lambda: op(q, k, v), False), ("fwdbwd", fwdbwd, True)):
        with torch.set_grad_enabled(grad):
            call()
            times[f"{name}_ms"] = median_ms(call, "cuda")
            if gpu_only:
                times[f"{name}_gpu_ms"] = gpu_ms(call)
    return times


def on_mma_sync(op):
    """op run with the tensor-core sweeps forced onto mma.sync (testing.h's PlanOverride)."""
    def forced(*args):
        before = attnrnn._C._plan_override()
        attnrnn._C._set_plan_override(True, *before[1:])
        try:
            return op(*args)
        finally:
            attnrnn._C._set_plan_override(*before)
    return forced


def measure_shape(K, V, H, dtype, precision, fla, bandwidth):
    """The rows of one (K, V, H, dtype[, precision]): both normalize modes, forward and forward+backward."""
    gen = torch.Generator().manual_seed(0)

    def make(d):
        return torch.randn(B, T, H, d, generator=gen).to("cuda", dtype)

    q, k, v, do = make(K).sigmoid(), make(K).sigmoid(), make(V) * 0.5, make(V)
    element_bytes = q.element_size()
    name = dtype_name(dtype, precision)
    rows = []
    for normalize in (False, True):
        impls = {"attnrnn": lambda a, b, c: attnrnn.chunk_linear_attn(a, b, c, normalize=normalize)[0],
                 "fla_chunk": lambda a, b, c: fla["chunk"](a, b, c, normalize=normalize)[0]}
        if (dtype == torch.bfloat16 and (K, V) in MMA_SYNC_DIMS) or name == "fp32-high":
            impls["attnrnn_mma_sync"] = on_mma_sync(impls["attnrnn"])
        times = {}
        for impl, op in impls.items():
            try:
                t = measure(op, q, k, v, do)
                times[impl] = (t["fwd_ms"], t["fwdbwd_ms"])
            except Exception as e:  # one failing shape must not cost the run
                print(f"  ERROR K{K}-V{V} {name} {impl}: {type(e).__name__}: {e}"[:400], file=sys.stderr)
                times[impl] = (None, None)
        for i, mode in enumerate(("fwd", "fwd+bwd")):
            ours, theirs = times["attnrnn"][i], times["fla_chunk"][i]
            floor_ms = floor_bytes(K, V, H, mode, element_bytes) / bandwidth * 1e3
            row = dict(shape=f"B{B}-T{T}-H{H}-K{K}-V{V}", K=K, V=V, dtype=name, normalize=normalize, mode=mode,
                       attnrnn_ms=ours, fla_chunk_ms=theirs, floor_ms=floor_ms,
                       speedup=None if ours is None or theirs is None else theirs / ours,
                       pct_of_floor=None if ours is None else 100 * floor_ms / ours)
            if "attnrnn_mma_sync" in times:
                row["attnrnn_mma_sync_ms"] = times["attnrnn_mma_sync"][i]
            rows.append(row)
            f = or_dash
            print(f"{row['shape']:24s} {name:12s} {'norm' if normalize else 'unnorm':6s} {mode:7s} attnrnn "
                  f"{f(ours, '8.3f')} ms  fla {f(theirs, '8.3f')} ms  {f(row['speedup'], '6.2f')}x  "
                  f"{f(row['pct_of_floor'], '5.1f')}% of floor"
                  + (f"  mma.sync {f(row['attnrnn_mma_sync_ms'], '8.3f')} ms" if "attnrnn_mma_sync_ms" in row else ""),
                  flush=True)
    return rows


def against_fla(doc, module, argv, add_options=None):
    """The command line of a script that times attnrnn against fla on the GPU (--fla, --out, --quick,
    and what add_options(parser) adds): (parsed arguments, fla's functions, the run's environment
    with its command)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fla", default="auto", help="as python -m bench's --fla")
    parser.add_argument("--out", required=True, help="JSON path")
    parser.add_argument("--quick", action="store_true", help="1 warm-up and 3 repeats per median")
    if add_options is not None:
        add_options(parser)
    args = parser.parse_args(argv)
    timing.QUICK = args.quick
    fla = baselines.load_fla(args.fla)
    if fla is None:
        parser.error("fla is not loaded: pass --fla with fla_core's wheel")
    command = " ".join([f"python -m {module}"] + (argv if argv is not None else sys.argv[1:]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    return args, fla, dict(environment("cuda", fla), command=command)  # environment() records --quick


def markdown_table(rows):
    """The forward+backward rows as a markdown table: per shape and dtype, attnrnn's time, fla's, the
    speed-up and the share of the memory floor, unnormalized then normalized (mma.sync beside)."""
    f = or_dash
    lines = ["| shape | dtype | normalize | attnrnn ms | fla ms | attnrnn x | % floor | mma.sync ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["mode"] != "fwd+bwd":
            continue
        lines.append(f"| {r['shape']} | {r['dtype']} | {'yes' if r['normalize'] else 'no'} | "
                     f"{f(r['attnrnn_ms'], '.3f')} | {f(r['fla_chunk_ms'], '.3f')} | {f(r['speedup'], '.2f')} | "
                     f"{f(r['pct_of_floor'], '.0f')} | {f(r.get('attnrnn_mma_sync_ms'), '.3f')} |")
    return "\n".join(lines)


def dtype_name(dtype, precision):
    """"bf16", or "fp32-" and the float32 matmul precision: a row's dtype."""
    return "bf16" if dtype == torch.bfloat16 else f"fp32-{precision}"


def run_name(K, V, dtype, precision):
    """"bf16-K64-V256", "fp32-highest-K128-V128": what --only selects."""
    return row_run_name(dict(dtype=dtype_name(dtype, precision), K=K, V=V))


def row_run_name(row):
    """The run (run_name) a result row belongs to."""
    return f"{row['dtype']}-K{row['K']}-V{row['V']}"


def appended(previous, env, rows):
    """(env, rows) of a results file that keeps previous's rows of the runs `rows` does not measure,
    with each command and copy rate: a grid measured in several calls, one file."""
    if previous["env"].get("gpu") != env.get("gpu"):
        raise SystemExit(f"--append: the file was measured on {previous['env'].get('gpu')}, this is {env.get('gpu')}")
    measured = {row_run_name(r) for r in rows}
    as_list = lambda x: x if isinstance(x, list) else [x]
    merged_env = dict(env, command=as_list(previous["env"]["command"]) + [env["command"]],
                      copy_TBps=as_list(previous["env"]["copy_TBps"]) + [env["copy_TBps"]])
    return merged_env, [r for r in previous["rows"] if row_run_name(r) not in measured] + rows


def grid_runs():
    """Every run of the grid, (K, V, H, dtype, precision), and its run_name."""
    runs = [(K, V, H, torch.bfloat16, None) for K, V, H in GRID]
    runs += [(K, V, H, torch.float32, precision) for precision in FP32_PRECISIONS for K, V, H in FP32_GRID]
    return runs, [run_name(K, V, dtype, precision) for K, V, _, dtype, precision in runs]


def main(argv=None):
    runs, names = grid_runs()

    def options(parser):
        parser.add_argument("--only", type=lambda s: s.split(","), default=None,
                            help="comma-separated runs, of " + ", ".join(names))
        parser.add_argument("--append", action="store_true",
                            help="keep the --out file's rows of the runs not measured now (same GPU)")

    args, fla, env = against_fla(__doc__, "bench.head_dims", argv, options)
    if args.only is not None:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            raise SystemExit(f"--only: unknown runs {unknown}; known: {names}")
        runs = [r for r, name in zip(runs, names) if name in args.only]
    out = args.out
    previous = json.loads(Path(out).read_text()) if args.append and Path(out).exists() else None
    bandwidth = copy_bandwidth("cuda")
    env["copy_TBps"] = bandwidth / 1e12
    rows = []

    def write():  # partial while any run of the grid has no rows
        file_env, file_rows = appended(previous, env, rows) if previous is not None else (env, rows)
        write_results(out, file_env, file_rows, partial=bool(set(names) - {row_run_name(r) for r in file_rows}))

    before = torch.get_float32_matmul_precision()
    for K, V, H, dtype, precision in runs:
        torch.set_float32_matmul_precision(precision or before)
        try:
            rows += measure_shape(K, V, H, dtype, precision, fla, bandwidth)
        finally:
            torch.set_float32_matmul_precision(before)
        torch.cuda.empty_cache()
        write()
    print(markdown_table(rows))
    return 1 if any(r["attnrnn_ms"] is None for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
