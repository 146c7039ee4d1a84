"""Softmax attention on the GPU: attnrnn's CUDA kernels against PyTorch's default SDPA (whatever
backend it picks, as a user calls it; the result names the kernels of one forward call), in one
process, bf16, against the softmax targets.

    python -m bench.softmax --out $OUT/softmax_h100.json --png $OUT/softmax_h100.png

Shapes (inputs [B, T, H, D]; SDPA gets the same memory as [B, H, T, D] views):
  train   B=4, H=16 (B*H = 64), T in {4096, 16384}, D in {64, 128}, causal: forward and
          forward+backward (torch.autograd.grad, nothing accumulated); targets <= 1.5x / <= 2x SDPA
  decode  B=64, H=32 (B*H = 2048), D=128, L in {2048, 8192}: one query over L cached keys
          (SDPA: q of length 1, non-causal over the cache views); target <= 1.15x SDPA;
          B=1, H=32, L=131072: % of the read floor (K+V bytes over the copy bandwidth measured
          in this run with a large device-to-device copy); target >= 80%
Also printed: TFLOP/s of the train shapes, the largest |ours - SDPA| of every output (a broken
kernel shows there first), and the same step with k_new appended.
"""
import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

from .__main__ import copy_bandwidth
from .timing import median_ms

TRAIN = [(4, 4096, 16, 64), (4, 4096, 16, 128), (4, 16384, 16, 64), (4, 16384, 16, 128)]
DECODE = [(64, 32, 128, 2048), (64, 32, 128, 8192)]
LONG = (1, 32, 128, 131072)
TARGETS = {"fwd": 1.5, "fwd_bwd": 2.0, "decode": 1.15, "long_decode_pct_floor": 80.0}


def sdpa(q, k, v, causal):
    """PyTorch's default SDPA on [B, T, H, D] inputs (as [B, H, T, D] views)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)


def kernel_names(fn):
    """The CUDA kernels one call of fn launches (which backend default SDPA chose)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if e.device_type.name == "CUDA"})


def train_case(ar, B, T, H, D):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    ours = lambda q, k, v: ar.softmax.streaming_attn(q, k, v, causal=True)  # noqa: E731
    ref = lambda q, k, v: sdpa(q, k, v, True)  # noqa: E731
    row = {"B": B, "T": T, "H": H, "D": D, "sdpa_kernels": kernel_names(lambda: ref(q, k, v))}
    flops = 2.0 * B * H * T * T * D  # causal: 4 B H T^2 D / 2
    for name, fn in (("ours", ours), ("sdpa", ref)):
        row[f"{name}_fwd_ms"] = median_ms(lambda: fn(q, k, v), "cuda")
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

        def fwd_bwd():
            o = fn(*leaves)
            torch.autograd.grad(o, leaves, do)

        row[f"{name}_fwd_bwd_ms"] = median_ms(fwd_bwd, "cuda")
        row[f"{name}_fwd_tflops"] = flops / (row[f"{name}_fwd_ms"] * 1e-3) / 1e12
        row[f"{name}_fwd_bwd_tflops"] = 3.5 * flops / (row[f"{name}_fwd_bwd_ms"] * 1e-3) / 1e12
    a = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    b = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    oa, ob = ours(*a), ref(*b)
    ga, gb = torch.autograd.grad(oa, a, do), torch.autograd.grad(ob, b, do)
    row["max_abs_diff"] = {n: (x.float() - y.float()).abs().max().item()
                           for n, x, y in zip(("o", "dq", "dk", "dv"), (oa, *ga), (ob, *gb))}
    row["fwd_ratio"] = row["ours_fwd_ms"] / row["sdpa_fwd_ms"]
    row["fwd_bwd_ratio"] = row["ours_fwd_bwd_ms"] / row["sdpa_fwd_bwd_ms"]
    row["fwd_ok"] = row["fwd_ratio"] <= TARGETS["fwd"]
    row["fwd_bwd_ok"] = row["fwd_bwd_ratio"] <= TARGETS["fwd_bwd"]
    return row


def decode_case(ar, B, H, D, L, bandwidth):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    kc, vc = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    kn, vn = (torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    full = torch.full((B,), L, dtype=torch.int32, device="cuda")
    short = full - 1
    row = {"B": B, "H": H, "D": D, "L": L}
    row["ours_ms"] = median_ms(lambda: ar.softmax.softmax_attn_step(q, kc, vc, full), "cuda")
    row["ours_append_ms"] = median_ms(lambda: ar.softmax.softmax_attn_step(q, kc, vc, short, k_new=kn, v_new=vn),
                                      "cuda")
    q4 = q[:, None]
    ref = lambda: sdpa(q4, kc, vc, False)  # noqa: E731
    row["sdpa_ms"] = median_ms(ref, "cuda")
    row["sdpa_kernels"] = kernel_names(ref)
    o = ar.softmax.softmax_attn_step(q, kc, vc, full)
    row["max_abs_diff"] = {"o": (o.float() - ref()[:, 0].float()).abs().max().item()}
    kv_bytes = 2 * B * L * H * D * 2
    row["read_floor_ms"] = kv_bytes / bandwidth * 1e3
    row["ours_pct_floor"] = 100 * row["read_floor_ms"] / row["ours_ms"]
    row["sdpa_pct_floor"] = 100 * row["read_floor_ms"] / row["sdpa_ms"]
    row["ratio"] = row["ours_ms"] / row["sdpa_ms"]
    return row


def table(rows_train, rows_dec, row_long, bandwidth):
    lines = [f"copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s", "",
             "train (bf16, causal)     ours fwd  sdpa fwd  ratio | ours f+b  sdpa f+b  ratio | TFLOP/s f / f+b",
             "-" * 104]
    for r in rows_train:
        lines.append(
            f"B{r['B']} T{r['T']:>5} H{r['H']} D{r['D']:<4}   {r['ours_fwd_ms']:8.3f}  {r['sdpa_fwd_ms']:8.3f}  "
            f"{r['fwd_ratio']:5.2f}{'' if r['fwd_ok'] else '!'} | {r['ours_fwd_bwd_ms']:8.3f}  "
            f"{r['sdpa_fwd_bwd_ms']:8.3f}  {r['fwd_bwd_ratio']:5.2f}{'' if r['fwd_bwd_ok'] else '!'} | "
            f"{r['ours_fwd_tflops']:5.0f} / {r['ours_fwd_bwd_tflops']:5.0f} (sdpa {r['sdpa_fwd_tflops']:4.0f} / "
            f"{r['sdpa_fwd_bwd_tflops']:4.0f})")
    lines += ["", "decode (bf16)            ours ms  +append  sdpa ms  ratio | % floor ours / sdpa", "-" * 80]
    for r in rows_dec + [row_long]:
        lines.append(f"B{r['B']:<3} H{r['H']} D{r['D']} L{r['L']:<7} {r['ours_ms']:8.3f} {r['ours_append_ms']:8.3f} "
                     f"{r['sdpa_ms']:8.3f}  {r['ratio']:5.2f} | {r['ours_pct_floor']:5.1f} / {r['sdpa_pct_floor']:5.1f}")
    lines.append("('!' marks a ratio past its target: fwd 1.5, fwd+bwd 2.0, decode 1.15; long decode >= 80% floor)")
    return "\n".join(lines)


def plot(path, rows_train, rows_dec, row_long):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG written", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [f"T{r['T']}\nD{r['D']}" for r in rows_train]
    x = range(len(rows_train))
    axes[0].bar([i - 0.2 for i in x], [r["fwd_ratio"] for r in rows_train], 0.4, label="forward")
    axes[0].bar([i + 0.2 for i in x], [r["fwd_bwd_ratio"] for r in rows_train], 0.4, label="forward+backward")
    axes[0].axhline(TARGETS["fwd"], color="C0", ls="--", lw=1)
    axes[0].axhline(TARGETS["fwd_bwd"], color="C1", ls="--", lw=1)
    axes[0].set_xticks(list(x), labels)
    axes[0].set_ylabel("time / default SDPA time")
    axes[0].set_title("train, bf16, causal, B*H = 64 (dashed: targets)")
    axes[0].legend()
    dec = rows_dec + [row_long]
    labels = [f"B{r['B']} L{r['L']}" for r in dec]
    x = range(len(dec))
    axes[1].bar([i - 0.2 for i in x], [r["ours_pct_floor"] for r in dec], 0.4, label="attnrnn")
    axes[1].bar([i + 0.2 for i in x], [r["sdpa_pct_floor"] for r in dec], 0.4, label="SDPA (default)")
    axes[1].axhline(TARGETS["long_decode_pct_floor"], color="k", ls="--", lw=1)
    axes[1].set_xticks(list(x), labels)
    axes[1].set_ylabel("% of the K+V read floor (measured copy rate)")
    axes[1].set_title("decode step, bf16, H = 32, D = 128")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the result JSON, e.g. bench/results/softmax_h100.json")
    ap.add_argument("--png", default=None)
    ap.add_argument("--quick", action="store_true", help="the smaller train shapes only (T = 4096)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.softmax needs a CUDA device")
    import attnrnn as ar
    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = copy_bandwidth("cuda")
    train = [s for s in TRAIN if not args.quick or s[1] == 4096]
    rows_train = [train_case(ar, *s) for s in train]
    rows_dec = [decode_case(ar, *s, bandwidth) for s in DECODE]
    row_long = decode_case(ar, *LONG, bandwidth)
    row_long["ok"] = row_long["ours_pct_floor"] >= TARGETS["long_decode_pct_floor"]
    for r in rows_dec:
        r["ok"] = r["ratio"] <= TARGETS["decode"]
    print(table(rows_train, rows_dec, row_long, bandwidth))
    for r in rows_train + rows_dec + [row_long]:
        shape = " ".join(f"{k}{r[k]}" for k in ("B", "T", "L", "H", "D") if k in r)
        print(f"default SDPA's kernels at {shape}: {'; '.join(r['sdpa_kernels'])}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
              "copy_bandwidth_Bps": bandwidth, "targets": TARGETS, "train": rows_train, "decode": rows_dec,
              "long_decode": row_long,
              "all_targets_met": all(r["fwd_ok"] and r["fwd_bwd_ok"] for r in rows_train)
              and all(r["ok"] for r in rows_dec) and row_long["ok"]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    print(f"wrote {args.out}")
    if args.png:
        plot(args.png, rows_train, rows_dec, row_long)


if __name__ == "__main__":
    main()
