"""Model, training and greedy evaluation of the power-of-two experiment.

The model is :class:`attnrnn.lm.CausalLM` with a fixed sinusoidal position added to its token
embedding (scaled by one learned gain); see :mod:`attnrnn.experiments.power_of_two` for why.
"""
from __future__ import annotations

import math
import multiprocessing
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..lm import CausalLM, LMConfig
from .power_of_two_data import IGNORE, STOP, VOCAB_SIZE, PowerFormat, TrainingBatches, decode, encode, parse_answer


def sinusoids(length: int, dim: int) -> torch.Tensor:
    """``[length, dim]``: sin and cos of the position at dim // 2 geometric frequencies."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * freqs
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2] = angles.sin()
    table[:, 1::2] = angles.cos()[:, :dim // 2]
    return table.float()


POSITIONS = ("absolute", "shifted", "none")


class PositionedLM(nn.Module):
    """A CausalLM whose token embedding gets ``gain * sinusoids[position]`` added (a forward hook
    on the embedding, so the LM itself runs unchanged).

    ``positions``: ``"absolute"`` numbers the tokens from 0; ``"shifted"`` also from 0 when
    evaluating, but :func:`train` starts each batch at a random offset in [0, max_len], so that
    only differences of positions carry information; ``"none"`` adds nothing.
    ``forward(ids, cache, state_indices, start)``: ``start`` is the position of ``ids[:, 0]``
    (the number of tokens already in the cache, plus the offset; every row of a batch shares it).
    """

    def __init__(self, config: LMConfig, max_len: int, positions: str = "absolute"):
        super().__init__()
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        self.lm = CausalLM(config)
        self.positions = positions
        self.max_offset = max_len if positions == "shifted" else 0
        self.max_len = max_len + self.max_offset
        self._start = 0
        if positions != "none":
            # The token embedding starts at std 0.02; the positions start at the same scale.
            self.position_gain = nn.Parameter(torch.tensor(0.02))
            self.register_buffer("position_table", sinusoids(self.max_len, config.hidden_size), persistent=False)
            self.lm.embed.register_forward_hook(self._add_positions)

    def _add_positions(self, module, inputs, embedded):
        length = embedded.shape[1]
        return embedded + self.position_gain * self.position_table[self._start:self._start + length]

    def forward(self, ids, cache=None, state_indices=None, start: int = 0):
        if start + ids.shape[1] > self.max_len:
            raise ValueError(f"ids: positions up to {start + ids.shape[1]} exceed max_len={self.max_len}")
        self._start = start
        return self.lm(ids, cache, state_indices)


def state_numbers(model: CausalLM) -> Dict[str, int]:
    """The fixed "memory" of the model in numbers, per layer kind: a linear layer's recurrent
    state (Hkv x K x V for S, plus Hkv x K for z when normalized); for a softmax layer the
    hidden x 2 of the no-cache view (the residual stream a token carries in and out of the
    layer; its keys and values live in the context, the "disk", and are not counted)."""
    out = {"linear": 0, "softmax": 0}
    for block in model.blocks:
        spec = block.attn.spec()
        if spec[0] == "linear":
            _, heads, k, v, normalize, _ = spec
            out["linear"] += heads * k * v + (heads * k if normalize else 0)
        else:
            out["softmax"] += 2 * block.attn.hidden_size
    out["total"] = out["linear"] + out["softmax"]
    return out


class ProgressBar:
    """A one-line progress bar on stderr: redrawn in place on a terminal (in the main process:
    bars of parallel workers would overwrite each other), otherwise a line at every tenth of the
    way."""

    def __init__(self, label: str, width: int = 24, stream=None):
        self.label, self.width = label, width
        self.stream = sys.stderr if stream is None else stream
        self.tty = getattr(self.stream, "isatty", lambda: False)() and multiprocessing.parent_process() is None
        self.next_tenth = 0.0

    def update(self, fraction: float, text: str = "", final: bool = False) -> None:
        fraction = min(max(fraction, 0.0), 1.0)
        if not (self.tty or final or fraction >= self.next_tenth):
            return
        filled = int(fraction * self.width)
        line = f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {fraction * 100:3.0f}% {text}"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
            self.next_tenth = math.floor(fraction * 10 + 1) / 10
        self.stream.flush()


def lr_factor(progress: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warm-up over the first ``warmup`` of training, then cosine decay to ``floor``."""
    if progress < warmup:
        return (progress + 1e-3) / warmup
    t = min((progress - warmup) / (1.0 - warmup), 1.0)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def train(model: PositionedLM, fmt: PowerFormat, train_xs: Sequence[int], *, steps: int, seconds: Optional[float],
          batch_size: int, lr: float, seed: int, device, label: str = "train", log_every: int = 10) -> Dict:
    """AdamW on batches of exponents drawn uniformly (with replacement) from ``train_xs``, until
    ``steps`` steps or ``seconds`` of training, whichever comes first; the schedule follows the
    larger of the two fractions, so it always ends decayed. Returns the training record."""
    sampler = torch.Generator().manual_seed(seed + 1)
    batches = TrainingBatches(fmt, train_xs, device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    bar, last_loss, t0, step = ProgressBar(label), None, time.perf_counter(), 0
    model.train()
    while True:
        elapsed = time.perf_counter() - t0
        progress = max(step / steps, elapsed / seconds if seconds else 0.0)
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr * lr_factor(progress)
        inputs, targets = batches.sample(batch_size, sampler)
        offset = int(torch.randint(model.max_offset + 1, (), generator=sampler)) if model.max_offset else 0
        logits = model(inputs, start=offset)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        last_loss = loss.detach()
        if step % log_every == 0 or step == 1:  # a device read: only now and then
            bar.update(progress, f"step {step} loss {last_loss.item():.3f} {elapsed:.0f}s")
    elapsed = time.perf_counter() - t0
    final_loss = None if last_loss is None else last_loss.item()
    bar.update(1.0, f"step {step} loss {final_loss:.3f} {elapsed:.0f}s" if step else "no step", final=True)
    return {"steps": step, "seconds": elapsed, "stopped_by": "steps" if step >= steps else "seconds",
            "final_loss": final_loss}


@torch.no_grad()
def generate_targets(model: PositionedLM, fmt: PowerFormat, xs: Sequence[int], device,
                     max_batch: int = 128) -> List[str]:
    """Greedy decoding with the model's cache (prefill the prompts, then one token per step) of
    every target of ``xs``; each result is cut after its first STOP token."""
    model.eval()
    out: List[str] = []
    for lo in range(0, len(xs), max_batch):
        chunk = list(xs[lo:lo + max_batch])
        out += _generate_chunk(model, fmt, chunk, device)
    return out


def _generate_chunk(model, fmt, xs, device):
    prompts = torch.tensor([encode(fmt.prompt(x)) for x in xs], device=device)
    rows, prompt_len = prompts.shape
    max_new = fmt.max_target_len(xs)
    cache = model.lm.make_cache(rows, max_len=prompt_len + max_new, device=device)
    slots = cache.allocate(rows)
    logits = model(prompts, cache, slots, start=0)[:, -1]
    tokens, stopped = [], torch.zeros(rows, dtype=torch.bool, device=device)
    for i in range(max_new):
        token = logits.argmax(dim=-1)
        tokens.append(token)
        stopped |= token == STOP
        if i + 1 == max_new or (i % 16 == 15 and bool(stopped.all())):  # a device read every 16 steps
            break
        logits = model(token[:, None], cache, slots, start=prompt_len + i)[:, -1]
    texts = [decode(row) for row in torch.stack(tokens, dim=1).cpu().tolist()]
    return [t[:t.index(".") + 1] if "." in t else t for t in texts]


def score(fmt: PowerFormat, x: int, generated: str) -> Dict:
    """Exact match of the answer field, digit accuracy over the significant digits of 2^x, and
    (with a chain of thought) whether the whole generated target is right."""
    truth = fmt.answer(x)
    answer = parse_answer(generated, fmt.power_width) or ""
    significant = len(str(2 ** x))
    right = sum(a == b for a, b in zip(answer[:significant], truth[:significant]))
    record = {"x": x, "exact": answer == truth, "digit_accuracy": right / significant}
    if fmt.cot:
        record["chain_exact"] = generated == fmt.target(x)
    return record


def first_error(fmt: PowerFormat, x: int, generated: str) -> Optional[str]:
    """Where a generated target first departs from the right one: ``"power"`` (a doubling),
    ``"label"`` (the countdown), ``"separator"``, ``"end"`` (it goes on after the right target
    or stops short of it); None when it is right."""
    target = fmt.target(x)
    at = next((i for i, (a, b) in enumerate(zip(generated, target)) if a != b), min(len(generated), len(target)))
    if at == len(target) == len(generated):
        return None
    if at >= min(len(generated), len(target)):
        return "end"
    return {"p": "power", "l": "label", "s": "separator"}[fmt.roles(x)[at]]
