"""Summaries, the JSON file and the plot of the power-of-two experiment.

JSON schema (``SCHEMA``), one object:

``schema``       the string SCHEMA.
``config``       the run's settings (:class:`~attnrnn.experiments.power_of_two.ExperimentConfig` as a dict).
``environment``  ``torch``, ``attnrnn`` versions, ``device`` (its name), ``threads``.
``format``       ``x_width``, ``power_width`` (digits of every written power), an ``example`` sequence
                 without and with the chain of thought.
``split``        ``train`` and ``held_out``: the exponents (sorted ints).
``cells``        one object per (architecture, size, cot, seed):
    ``architecture`` ("softmax" | "linear" | "hybrid"), ``hidden_size``, ``num_layers``, ``num_heads``,
    ``cot`` (bool), ``seed``, ``parameters`` (int),
    ``state_numbers``: ``linear``, ``softmax``, ``total`` -- the model's fixed memory in numbers (see
    :func:`~attnrnn.experiments.power_of_two_model.state_numbers`),
    ``training``: ``steps``, ``seconds``, ``stopped_by`` ("steps" | "seconds"), ``final_loss``,
    ``eval_seconds``,
    ``per_x``: one object per exponent: ``x``, ``split`` ("train" | "held_out"), ``answer_digits``
    (significant digits of 2^x), ``generated_tokens`` (length of the right target), ``exact`` (bool),
    ``digit_accuracy`` (in [0, 1]), with a chain of thought ``chain_exact`` (bool: everything
    written is right), and where the answer is wrong ``generated`` (the text after the prompt)
    and ``first_error`` (where it first goes wrong: "power" | "label" | "separator" | "end"),
    ``summary``: for ``train`` and ``held_out``: ``exact`` and ``digit_accuracy`` (means in [0, 1]),
    ``max_x_99`` (the largest X whose exponents x <= X of that split are exactly right at >= 99%,
    null when the smallest one already is not).
``wall_seconds`` the whole run.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

SCHEMA = "attnrnn.experiments.power_of_two/1"
SPLITS = ("train", "held_out")


def max_x_at(records: Sequence[Dict], threshold: float = 0.99) -> Optional[int]:
    """The largest X such that the exponents x <= X among ``records`` are exact at >= threshold."""
    best, right = None, 0
    for count, record in enumerate(sorted(records, key=lambda r: r["x"]), start=1):
        right += bool(record["exact"])
        if right >= threshold * count:
            best = record["x"]
    return best


def summarize(per_x: Sequence[Dict]) -> Dict[str, Dict]:
    out = {}
    for split in SPLITS:
        records = [r for r in per_x if r["split"] == split]
        if not records:
            out[split] = {"exact": None, "digit_accuracy": None, "max_x_99": None}
            continue
        out[split] = {"exact": sum(r["exact"] for r in records) / len(records),
                      "digit_accuracy": sum(r["digit_accuracy"] for r in records) / len(records),
                      "max_x_99": max_x_at(records)}
    return out


def size_label(cell: Dict) -> str:
    return f"{cell['hidden_size']}x{cell['num_layers']}"


def table(result: Dict) -> List[str]:
    """One line per cell: exact match and max x at 99% on both splits, memory, parameters."""
    lines = [f"{'arch':8s} {'size':>7s} {'cot':>3s} {'seed':>4s} {'params':>8s} {'memory':>7s} "
             f"{'train exact':>11s} {'max x':>5s} {'held exact':>10s} {'digits':>6s} {'steps':>6s}"]
    for c in result["cells"]:
        tr, ho = c["summary"]["train"], c["summary"]["held_out"]
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"{c['architecture']:8s} {size_label(c):>7s} {'yes' if c['cot'] else 'no':>3s} {c['seed']:4d} "
                     f"{c['parameters']:8d} {c['state_numbers']['total']:7d} {fmt(tr['exact']):>11s} "
                     f"{str(tr['max_x_99']):>5s} {fmt(ho['exact']):>10s} {fmt(ho['digit_accuracy']):>6s} "
                     f"{c['training']['steps']:6d}")
    return lines


def binned(cells: Sequence[Dict], split: str, metric: str, width: int) -> List[tuple]:
    """(bin centre, mean of ``metric``) over the exponents of ``split`` in bins of ``width``
    consecutive x, pooled over ``cells`` (the seeds of one configuration)."""
    bins = defaultdict(list)
    for cell in cells:
        for r in cell["per_x"]:
            if r["split"] == split:
                bins[(r["x"] - 1) // width].append(float(r[metric]))
    return [((b + 0.5) * width + 0.5, sum(v) / len(v)) for b, v in sorted(bins.items())]


#: The plot's rows: (split, metric, axis label).
PLOT_ROWS = (("train", "exact", "training x: exact match"), ("held_out", "exact", "held-out x: exact match"),
             ("held_out", "digit_accuracy", "held-out x: digit accuracy"))


def plot(result: Dict, path: str) -> str:
    """Accuracy against x: a column per architecture, a row per PLOT_ROWS, a colour per size,
    solid without and dashed with the chain of thought (means over seeds, x in bins)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    archs = list(dict.fromkeys(c["architecture"] for c in result["cells"]))
    sizes = list(dict.fromkeys(size_label(c) for c in result["cells"]))
    width = max(1, math.ceil((cfg["x_max"] - cfg["x_min"] + 1) / 12))
    colours = plt.get_cmap("viridis")
    fig, axes = plt.subplots(len(PLOT_ROWS), len(archs), figsize=(4.2 * len(archs) + 0.6, 8.4), sharex=True,
                             sharey=True, squeeze=False)
    groups = defaultdict(list)
    for c in result["cells"]:
        groups[(c["architecture"], size_label(c), c["cot"])].append(c)
    for col, arch in enumerate(archs):
        for row, (split, metric, label) in enumerate(PLOT_ROWS):
            ax = axes[row][col]
            for i, size in enumerate(sizes):
                colour = colours(i / max(len(sizes) - 1, 1) * 0.85)
                for cot in (False, True):
                    cells = groups.get((arch, size, cot))
                    if cells:
                        points = binned(cells, split, metric, width)
                        ax.plot([p[0] for p in points], [p[1] for p in points], "--" if cot else "-", marker="o",
                                markersize=3, color=colour, label=f"{size}{', CoT' if cot else ''}")
            ax.set_ylim(-0.05, 1.05)
            ax.grid(True, alpha=0.3)
            if row == 0:
                ax.set_title(arch, fontsize=11)
            if row == len(PLOT_ROWS) - 1:
                ax.set_xlabel(f"x (bins of {width})")
            if col == 0:
                ax.set_ylabel(label, fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8,
               title="hidden x layers (solid: no CoT, dashed: CoT)", title_fontsize=8)
    seeds = cfg["seeds"]
    fig.suptitle(f"2^x without and with a chain of thought ({result['environment']['device']}, "
                 f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''}, {cfg['steps']} steps)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
