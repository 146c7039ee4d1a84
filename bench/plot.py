"""Plot a `python -m bench` JSON: per shape, bars of time per implementation, fla ratio annotated.

    python -m bench.plot IN.json [MORE.json ...] OUT.png

One panel per training shape (forward and forward+backward, normalize False / True), one panel
for the decode step; log time axis; above each attnrnn bar the faster fla variant's time / ours
("2.10x fla": ours is 2.1 times faster; below 1, slower) — or / plain PyTorch's when the run has no
fla; and a panel listing the targets with their verdicts. Several JSON files are joined
(later files win on the same row). Needs matplotlib; without it, prints so and skips.
"""
import json
import math
import sys
from pathlib import Path

from . import report

ORDER = ["attnrnn", "fla_chunk", "fla_fused_chunk", "fla_fused_recurrent", "torch_chunk", "torch_step"]
COLORS = {"attnrnn": "#d62728", "fla_chunk": "#1f77b4", "fla_fused_chunk": "#17becf",
          "fla_fused_recurrent": "#9467bd", "torch_chunk": "#7f7f7f", "torch_step": "#7f7f7f"}
LABELS = {"attnrnn": "attnrnn", "fla_chunk": "fla chunk", "fla_fused_chunk": "fla fused_chunk",
          "fla_fused_recurrent": "fla fused_recurrent", "torch_chunk": "plain PyTorch",
          "torch_step": "plain PyTorch"}


def _load(paths):
    rows, env, dtype, checks = {}, None, None, None
    for p in paths:
        doc = json.loads(Path(p).read_text())
        env = env or doc.get("env", {})
        dtype = dtype or doc.get("dtype")
        for r in doc["rows"]:
            rows[(r["suite"], r["shape"], r["normalize"], r["mode"], r["impl"])] = r
        if len(paths) == 1:
            checks = doc.get("targets")
    rows = report.add_ratios(list(rows.values()))
    if checks is None:
        checks = report.targets(rows, dtype) if (env or {}).get("gpu") else []
    return rows, env or {}, dtype, checks


def _annotation(r, rows_by_key):
    """Text above an attnrnn bar: speed-up over the faster fla variant, else over plain PyTorch."""
    if r.get("speedup_vs_fla_best") is not None:
        return f"{r['speedup_vs_fla_best']:.2f}x fla"
    for base in ("torch_chunk", "torch_step"):
        other = rows_by_key.get((r["suite"], r["shape"], r["normalize"], r["mode"], base))
        if other and other.get("ms") is not None and r.get("ms"):
            return f"{other['ms'] / r['ms']:.2f}x torch"
    return None


def _bars(ax, groups, rows_by_key, impls):
    """groups: [(label, (suite, shape, normalize, mode))]; one bar per impl in each group."""
    width = 0.8 / max(1, len(impls))
    for gi, (_, key) in enumerate(groups):
        for ii, impl in enumerate(impls):
            r = rows_by_key.get(key + (impl,))
            if r is None or r.get("ms") is None:
                continue
            x = gi - 0.4 + width * (ii + 0.5)
            ax.bar(x, r["ms"], width * 0.92, color=COLORS.get(impl, "#bcbd22"), label=LABELS.get(impl, impl))
            if impl == "attnrnn":
                text = _annotation(r, rows_by_key)
                if text:
                    ax.annotate(text, (x, r["ms"]), xytext=(0, 3), textcoords="offset points", ha="center",
                                va="bottom", fontsize=7, rotation=90, fontweight="bold")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g[0] for g in groups], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("median time (ms, log)")
    ax.margins(y=0.35)
    ax.grid(axis="y", which="both", alpha=0.25)


def _targets_text(ax, checks):
    ax.axis("off")
    lines = ["Targets, from the medians above:"]
    for c in checks:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[c["passed"]]
        unit = {"x": "x", "%": "%", "ratio": ""}[c["unit"]]
        op = "<=" if c["unit"] == "ratio" else ">="
        meas = "-" if c["measured"] is None else f"{c['measured']:.2f}{unit}"
        name = c["target"].split(":")[0]
        lines.append(f"{verdict:4s} {name[:24]:24s} {c['shape']:19s} n={'T' if c['normalize'] else 'F'} "
                     f"{meas:>7s} ({op}{c['required']:g}{unit})")
    s = report.summary(checks)
    lines.append(f"{s['passed']} passed, {s['failed']} failed, {s['not_measured']} not measured")
    ax.text(0, 1, "\n".join(lines), va="top", ha="left", family="monospace", fontsize=6.2, transform=ax.transAxes)


def plot_files(paths, png):
    """Draw the plot; returns False (after saying why) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib, or `make install`, which installs "
              "requirements-dev.txt): skipping the plot; the JSON is complete without it", file=sys.stderr)
        return False
    rows, env, dtype, checks = _load(paths)
    rows_by_key = {(r["suite"], r["shape"], r["normalize"], r["mode"], r["impl"]): r for r in rows}
    train_shapes = list(dict.fromkeys(r["shape"] for r in rows if r["suite"] == "train"))
    decode_shapes = list(dict.fromkeys(r["shape"] for r in rows if r["suite"] == "decode"))
    present = {r["impl"] for r in rows if r.get("ms") is not None}
    train_impls = [i for i in ORDER if i in present and any(r["impl"] == i for r in rows if r["suite"] == "train")]
    decode_impls = [i for i in ORDER if i in present and any(r["impl"] == i for r in rows if r["suite"] == "decode")]

    n = len(train_shapes) + bool(decode_shapes) + bool(checks)
    ncols = min(3, max(1, n))
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.6 * ncols, 4.4 * nrows), squeeze=False)
    axes = list(axes.flat)
    for ax in axes[n:]:
        ax.axis("off")
    i = 0
    for shape in train_shapes:
        groups = [(f"{mode}\nnormalize={'T' if norm else 'F'}", ("train", shape, norm, mode))
                  for mode in ("fwd", "fwd+bwd") for norm in (False, True)]
        _bars(axes[i], groups, rows_by_key, train_impls)
        title = shape
        peaks = [rows_by_key.get(("train", shape, norm, "fwd+bwd", "attnrnn"), {}).get("peak_ratio")
                 for norm in (False, True)]
        if any(p is not None for p in peaks):
            title += "\nattnrnn fwd+bwd peak / io: " + " / ".join("-" if p is None else f"{p:.2f}" for p in peaks)
        axes[i].set_title(title, fontsize=9)
        i += 1
    if decode_shapes:
        groups = [(shape, ("decode", shape, False, "step")) for shape in decode_shapes]
        _bars(axes[i], groups, rows_by_key, decode_impls)
        pct = [rows_by_key.get(("decode", s, False, "step", "attnrnn"), {}).get("pct_of_floor") for s in decode_shapes]
        title = "decode step (fp32 state)"
        if any(p is not None for p in pct):
            title += "\nattnrnn % of floor: " + " / ".join("-" if p is None else f"{p:.0f}%" for p in pct)
        axes[i].set_title(title, fontsize=9)
        i += 1
    if checks:
        _targets_text(axes[i], checks)

    handles, labels = {}, []
    for ax in axes:
        for h, l in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(l, h)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    device = env.get("gpu") or env.get("cpu") or "?"
    fla = f"fla {env['fla']}" if env.get("fla") else "no fla"
    runs = env.get("merged_from")
    command = (f"{len(runs)} runs split by --shapes, merged (their commands: env.merged_from in the JSON)" if runs
               else env.get("command", ""))
    fig.suptitle(f"attnrnn vs baselines — {device}, {dtype}, torch {env.get('torch', '?')}, {fla}\n{command}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=130)
    plt.close(fig)
    print(f"wrote {png}")
    return True


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return 0 if plot_files(argv[:-1], argv[-1]) else 1


if __name__ == "__main__":
    sys.exit(main())
