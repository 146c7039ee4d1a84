"""The memory-bottleneck experiment: 2^x without and with a chain of thought, softmax against
linear attention, by model size.

A model of :mod:`attnrnn.lm` reads an exponent x and writes the decimal digits of 2^x. Without a
chain of thought (CoT) all the work has to happen inside the model's fixed-size state while it
writes the answer; with one, it writes every doubling into the sequence and reads it back. The
claim under test: softmax attention is itself an RNN with a memory fixed by its size (about
hidden x layers x 2 numbers; the context is a disk it reads, see ``attnrnn.softmax.NoCacheDecoder``),
so without a CoT accuracy must fall once x is large enough, even on the training exponents, at an
x that grows with the model; a CoT moves that point much further.

Tokens: the digits ``0``-``9`` and the separators ``:`` ``,`` ``=`` ``.`` (and ``_``, which only pads
batches and is never a target). Sequences, shown for x = 5 in a run with x_max = 16 (x takes 2
digits, every power 5, the width of 2^16 = 65536)::

    without CoT:  05:=23000.
    with CoT:     05:10000,04:20000,03:40000,02:80000,01:61000,00=23000.

* The prompt is x (most significant digit first, zero-padded) and ``:``.
* The answer is ``=``, then 2^x least significant digit first, zero-padded to the width of
  2^x_max, then ``.``. It is written the same way with and without a CoT, so the two are scored on
  the same string: exact match of all its digits, digit accuracy over the significant ones.
* The CoT is a countdown of frames ``r:p,``: the prompt is the first label (r = x, p = 2^0), then
  frame k = 1 .. x has the label r = x - k and p = 2^k in the answer's layout. The answer is the
  frame whose label reaches 0, with ``=`` for ``:``.

Why this scratch space:

* Every power has the same width, so digit i of 2^k sits a fixed number of tokens
  (x_width + power_width + 2) after digit i of 2^(k-1). A new digit is (2 d_i + [d_(i-1) >= 5])
  mod 10: it reads two tokens at two fixed offsets, and a label is the label one frame back minus
  one. Nothing has to be counted or searched for.
* Each step is the same local rule whatever x is, so the rule learnt on training exponents applies
  to held-out ones: the only new thing a held-out x brings is the prompt, which is also the first
  label. Two alternatives generalized worse (softmax 64x2 on the CPU): labels counting up from 0
  make stopping a comparison of each label with the prompt, which the model learnt per training x
  and got wrong on every held-out x (x <= 24); a countdown that starts by copying the prompt into
  a label of its own failed on all of them too (x <= 32).
* Stopping is local: the frame labelled 0 is the answer.
* Least significant digit first, as the carry travels. Applied to the answer in both modes.
* The cost: the CoT is x (x_width + power_width + 2) tokens, quadratic in x.

Positions: CausalLM has no positional encoding (order comes from the causal mask and the
recurrence), so a token can be found only by what it is, not by where it is; every frame holds
the same kinds of tokens, so such a model cannot tell the previous frame from older ones. Every
cell (both architectures, with and without CoT) therefore adds sinusoidal positions, times one
learned gain, to the token embedding (``PositionedLM``), counted from 0 (``--positions absolute``).
``--positions shifted`` starts each training batch at a random offset, so that only distances
between tokens carry information (with absolute positions a model can tie where its chain ends
to x itself); on the CPU it made the chain much slower to learn (softmax and linear 64x2, x <= 24,
500 steps: 0.15 and 0.30 of the training x against 1.00). ``none`` leaves positions out.

Training: the loss covers every token after the prompt (the CoT and the answer); AdamW (betas
0.9, 0.98, weight decay 0.01), linear warm-up over 5% then cosine decay to 10% of ``--lr``, gradient
clipping at 1; each batch draws its exponents uniformly with replacement from the training
exponents (no curriculum). Budget: ``--steps`` optimizer steps, cut short by ``--seconds`` per cell
if that comes first (the schedule follows whichever fraction is larger; the JSON records which
one stopped it). Equal steps and batch sizes with and without CoT: equal examples, not equal
compute (the CoT's sequences are longer). The exponents of [x_min, x_max] are split once
(``--split-seed``): ``--held-out-fraction`` of the interior ones are held out, so each lies inside
the trained range. Model weights and batches follow ``--seeds``; on the CPU a run is exactly
reproducible, on a GPU up to kernel nondeterminism.

Evaluation: greedy decoding through the model's cache (prefill the prompt, then one token per
step) for every exponent of both splits.

Memory, in numbers: a linear layer's recurrent state, heads x K x V for S plus heads x K for z; a
softmax layer's hidden x 2 (the stream a token carries into and out of the layer in the no-cache
view; the keys and values are the disk, not counted). See ``power_of_two_report`` for the JSON.

Run::

    python -m attnrnn.experiments.power_of_two --quick                       # CPU, a few minutes
    python -m attnrnn.experiments.power_of_two --device cuda                 # the full grid, one GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..lm import LMConfig
from .power_of_two_data import VOCAB_SIZE, PowerFormat, split_exponents
from .power_of_two_model import POSITIONS, PositionedLM, first_error, generate_targets, score, state_numbers, train
from .power_of_two_report import SCHEMA, plot, summarize, table

ARCHITECTURES = ("softmax", "linear", "hybrid")


@dataclass
class ExperimentConfig:
    """One grid: every (architecture, size, cot, seed) is a cell. ``sizes``: (hidden_size,
    num_layers) pairs. ``seconds``: per-cell training cap (None: steps only)."""

    architectures: Tuple[str, ...] = ARCHITECTURES
    sizes: Tuple[Tuple[int, int], ...] = ((64, 2), (128, 4), (256, 4))
    x_min: int = 1
    x_max: int = 64
    cot: Tuple[bool, ...] = (False, True)
    steps: int = 2000
    seconds: Optional[float] = 45.0
    batch_size: int = 32
    lr: float = 2e-3
    seeds: Tuple[int, ...] = (0, 1)
    head_dim: int = 32
    positions: str = "absolute"
    held_out_fraction: float = 0.2
    split_seed: int = 0
    device: str = "cpu"
    workers: int = 1

    def validate(self) -> "ExperimentConfig":
        def positive_int(name, value):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

        if not self.architectures or any(a not in ARCHITECTURES for a in self.architectures):
            raise ValueError(f"architectures must be a non-empty list from {ARCHITECTURES}, got {self.architectures!r}")
        if not self.sizes:
            raise ValueError("sizes must list at least one (hidden_size, num_layers) pair")
        for hidden, layers in self.sizes:
            positive_int("sizes: hidden_size", hidden)
            positive_int("sizes: num_layers", layers)
            if "hybrid" in self.architectures and layers < 2:
                raise ValueError(f"sizes: the hybrid architecture needs num_layers >= 2 (its odd layers are softmax), "
                                 f"got {hidden}x{layers}")
        for name in ("x_min", "steps", "batch_size", "head_dim", "workers"):
            positive_int(name, getattr(self, name))
        positive_int("x_max", self.x_max)
        if self.x_max <= self.x_min:
            raise ValueError(f"x_max must be larger than x_min={self.x_min}, got {self.x_max}")
        if not self.cot or any(not isinstance(c, bool) for c in self.cot):
            raise ValueError(f"cot must be a non-empty list of bools, got {self.cot!r}")
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"seconds must be > 0 or None, got {self.seconds!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")
        if not self.seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in self.seeds):
            raise ValueError(f"seeds must be a non-empty list of ints, got {self.seeds!r}")
        split_exponents(self.x_min, self.x_max, self.held_out_fraction, self.split_seed)  # its own checks
        return self

    def cells(self) -> List[Tuple[str, Tuple[int, int], bool, int]]:
        return [(a, s, c, seed) for a in self.architectures for s in self.sizes for c in self.cot
                for seed in self.seeds]


QUICK = dict(architectures=("softmax", "linear"), sizes=((16, 1), (32, 2), (64, 2)), x_max=12, steps=500,
             seconds=None, batch_size=16, lr=3e-3, seeds=(0,), device="cpu")


def num_heads(hidden: int, head_dim: int) -> int:
    heads = max(1, hidden // head_dim)
    while hidden % heads:
        heads -= 1
    return heads


def build_model(config: ExperimentConfig, architecture: str, hidden: int, layers: int, max_len: int) -> PositionedLM:
    lm_config = LMConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden, num_layers=layers,
                         num_heads=num_heads(hidden, config.head_dim), layer_types=architecture)
    return PositionedLM(lm_config, max_len=max_len, positions=config.positions)


def run_cell(config: ExperimentConfig, architecture: str, size: Tuple[int, int], cot: bool, seed: int) -> Dict:
    """Trains and evaluates one cell; returns its JSON object."""
    if config.device == "cpu":
        # One thread per cell: these models are so small that a second thread's fork/join costs
        # more than it brings, and on a machine shared with other jobs far more; run cells in
        # parallel with workers instead.
        torch.set_num_threads(1)
    else:
        torch.backends.cuda.matmul.allow_tf32 = True  # the models are tiny: TF32 is exact enough
    hidden, layers = size
    fmt = PowerFormat(config.x_max, cot)
    train_xs, held_out = split_exponents(config.x_min, config.x_max, config.held_out_fraction, config.split_seed)
    torch.manual_seed(seed)
    model = build_model(config, architecture, hidden, layers, max_len=len(fmt.sequence(config.x_max)) + 1)
    model.to(config.device)
    label = f"{architecture} {hidden}x{layers} {'CoT' if cot else 'no CoT'} seed {seed}"
    record = train(model, fmt, train_xs, steps=config.steps, seconds=config.seconds, batch_size=config.batch_size,
                   lr=config.lr, seed=seed, device=config.device, label=label)
    t0 = time.perf_counter()
    xs = list(range(config.x_min, config.x_max + 1))
    generated = generate_targets(model, fmt, xs, config.device)
    record["eval_seconds"] = time.perf_counter() - t0
    held = set(held_out)
    per_x = []
    for x, text in zip(xs, generated):
        per_x.append({**score(fmt, x, text), "split": "held_out" if x in held else "train",
                      "answer_digits": len(str(2 ** x)), "generated_tokens": len(fmt.target(x))})
        if not per_x[-1]["exact"]:
            per_x[-1].update(generated=text, first_error=first_error(fmt, x, text))
    return {"architecture": architecture, "hidden_size": hidden, "num_layers": layers,
            "num_heads": model.lm.config.num_heads, "cot": cot, "seed": seed,
            "parameters": sum(p.numel() for p in model.parameters()), "state_numbers": state_numbers(model.lm),
            "training": record, "per_x": per_x, "summary": summarize(per_x)}


def run_grid(config: ExperimentConfig, log=print) -> Dict:
    """Every cell of the grid (in ``config.workers`` processes when > 1); returns the JSON object."""
    config.validate()
    t0 = time.perf_counter()
    cells = config.cells()
    log(f"{len(cells)} cells on {config.device}, {config.workers} worker(s): x in [{config.x_min}, {config.x_max}], "
        f"{config.steps} steps" + (f" (at most {config.seconds:g} s each)" if config.seconds else ""))
    if config.workers == 1:
        results = [run_cell(config, *cell) for cell in cells]
    else:
        # The costliest cells (CoT, large) first, so that the cheap ones fill the gaps at the end.
        order = sorted(cells, key=lambda c: (not c[2], -c[1][0] * c[1][1]))
        with ProcessPoolExecutor(config.workers, mp_context=get_context("spawn")) as pool:
            futures = {cell: pool.submit(run_cell, config, *cell) for cell in order}
            results = [futures[cell].result() for cell in cells]
    fmt_plain, fmt_cot = PowerFormat(config.x_max, False), PowerFormat(config.x_max, True)
    train_xs, held_out = split_exponents(config.x_min, config.x_max, config.held_out_fraction, config.split_seed)
    example = min(5, config.x_max)
    return {
        "schema": SCHEMA,
        "config": dataclasses.asdict(config),
        "environment": environment(config.device),
        "format": {"x_width": fmt_plain.x_width, "power_width": fmt_plain.power_width,
                   "example": {"x": example, "without_cot": fmt_plain.sequence(example),
                               "with_cot": fmt_cot.sequence(example)}},
        "split": {"train": train_xs, "held_out": held_out},
        "cells": results,
        "wall_seconds": time.perf_counter() - t0,
    }


def environment(device: str) -> Dict:
    import attnrnn
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    return {"torch": torch.__version__, "attnrnn": attnrnn.__version__, "device": name,
            "threads": torch.get_num_threads()}


def write(result: Dict, out_dir: str) -> Tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "power_of_two.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    return json_path, plot(result, os.path.join(out_dir, "power_of_two.png"))


def _size(text: str) -> Tuple[int, int]:
    try:
        hidden, layers = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HIDDENxLAYERS such as 64x2, got {text!r}") from None
    return hidden, layers


def parse_args(argv: Optional[Sequence[str]] = None) -> Tuple[ExperimentConfig, argparse.Namespace]:
    defaults = ExperimentConfig()
    p = argparse.ArgumentParser(prog="python -m attnrnn.experiments.power_of_two", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a small grid for a 2-core CPU (a few minutes); the flags below still override it")
    p.add_argument("--arch", nargs="+", choices=ARCHITECTURES, help="architectures (default: all)")
    p.add_argument("--sizes", nargs="+", type=_size, metavar="HxL",
                   help="model sizes hidden_size x num_layers (default: 64x2 128x4 256x4)")
    p.add_argument("--x-min", type=int, help=f"smallest exponent (default {defaults.x_min})")
    p.add_argument("--x-max", type=int, help=f"largest exponent (default {defaults.x_max})")
    p.add_argument("--cot", choices=("both", "on", "off"), default="both", help="chain of thought (default both)")
    p.add_argument("--steps", type=int, help=f"optimizer steps per cell (default {defaults.steps})")
    p.add_argument("--seconds", type=float,
                   help=f"training-time cap per cell in seconds, 0 for none (default {defaults.seconds:g})")
    p.add_argument("--batch-size", type=int, help=f"sequences per step (default {defaults.batch_size})")
    p.add_argument("--lr", type=float, help=f"peak AdamW learning rate (default {defaults.lr:g})")
    p.add_argument("--seeds", nargs="+", type=int, help="model/batch seeds (default 0 1)")
    p.add_argument("--head-dim", type=int, help=f"attention head size (default {defaults.head_dim})")
    p.add_argument("--positions", choices=POSITIONS,
                   help="sinusoidal positions from 0, from a random offset per training batch, or none "
                        "(default absolute)")
    p.add_argument("--held-out-fraction", type=float,
                   help=f"share of the exponents held out (default {defaults.held_out_fraction:g})")
    p.add_argument("--split-seed", type=int, help=f"seed of the held-out split (default {defaults.split_seed})")
    p.add_argument("--device", help="cpu or cuda (default: cuda when attnrnn's CUDA ops run here, else cpu)")
    p.add_argument("--workers", type=int,
                   help="cells trained at once, one process each (default 4 on a GPU, 1 on the CPU)")
    p.add_argument("--out", default=os.path.join("build", "power_of_two"),
                   help="folder for power_of_two.json and power_of_two.png (default build/power_of_two)")
    args = p.parse_args(argv)
    values = dict(QUICK) if args.quick else {}
    flags = {"architectures": args.arch, "sizes": args.sizes, "x_min": args.x_min, "x_max": args.x_max,
             "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seeds": args.seeds,
             "head_dim": args.head_dim, "held_out_fraction": args.held_out_fraction, "split_seed": args.split_seed,
             "device": args.device, "workers": args.workers, "positions": args.positions}
    values.update({k: tuple(v) if isinstance(v, list) else v for k, v in flags.items() if v is not None})
    if args.seconds is not None:
        values["seconds"] = args.seconds or None
    values["cot"] = {"both": (False, True), "on": (True,), "off": (False,)}[args.cot]
    if "device" not in values:
        from ..demo import pick_device
        values["device"] = pick_device()
    if "workers" not in values and values["device"].startswith("cuda"):
        values["workers"] = 4  # the models are small: one process leaves most of a GPU idle
    try:
        config = ExperimentConfig(**values).validate()
    except ValueError as e:
        p.error(str(e))
    return config, args


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    config, args = parse_args(argv)
    result = run_grid(config)
    print("\n".join(table(result)))
    json_path, png_path = write(result, args.out)
    print(f"\nwrote {os.path.abspath(json_path)}\n      {os.path.abspath(png_path)}\n"
          f"done in {result['wall_seconds']:.0f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
