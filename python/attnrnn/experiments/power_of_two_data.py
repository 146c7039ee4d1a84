"""Data of the power-of-two experiment: the tokenizer, the sequence formats with and without a
chain of thought, the split of exponents into training and held-out values, and padded batches.

Every number is exact (Python ints). The formats are described in
:mod:`attnrnn.experiments.power_of_two`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

#: Token i is the character ALPHABET[i]: the ten digits, then the separators.
ALPHABET = "0123456789:,=._"
PROMPT_END, FRAME_SEP, ANSWER, STOP, PAD = (ALPHABET.index(c) for c in ":,=._")
VOCAB_SIZE = len(ALPHABET)
#: Target value of positions that carry no loss (the prompt and the padding).
IGNORE = -100


def encode(text: str) -> List[int]:
    """Characters of ALPHABET -> token ids."""
    try:
        return [ALPHABET.index(c) for c in text]
    except ValueError:
        bad = sorted(set(text) - set(ALPHABET))
        raise ValueError(f"text must use only the characters {ALPHABET!r}, got {bad}") from None


def decode(ids: Sequence[int]) -> str:
    """Token ids -> characters of ALPHABET."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < VOCAB_SIZE]
    if bad:
        raise ValueError(f"ids must lie in [0, {VOCAB_SIZE}), got {bad[:5]}")
    return "".join(ALPHABET[i] for i in ids)


def digits_lsb_first(n: int, width: int) -> str:
    """The decimal digits of n >= 0, least significant first, zero-padded to ``width``."""
    text = str(n)[::-1]
    if len(text) > width:
        raise ValueError(f"{n} has {len(text)} digits, more than width={width}")
    return text.ljust(width, "0")


@dataclass(frozen=True)
class PowerFormat:
    """The sequences for exponents ``1 <= x <= x_max`` (``cot``: with the chain of thought).

    ``x_width`` digits hold any exponent (the prompt, the countdown), ``power_width`` digits hold
    2^x_max: every power is written in that fixed width.
    """

    x_max: int
    cot: bool

    def __post_init__(self):
        if isinstance(self.x_max, bool) or not isinstance(self.x_max, int) or self.x_max < 1:
            raise ValueError(f"x_max must be an int >= 1, got {self.x_max!r}")

    @property
    def x_width(self) -> int:
        return len(str(self.x_max))

    @property
    def power_width(self) -> int:
        return len(str(2 ** self.x_max))

    def _check_x(self, x: int) -> None:
        if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= self.x_max:
            raise ValueError(f"x must be an int in [1, x_max={self.x_max}], got {x!r}")

    def prompt(self, x: int) -> str:
        """``x`` (most significant digit first, zero-padded) then ``:``."""
        self._check_x(x)
        return f"{x:0{self.x_width}d}:"

    def answer(self, x: int) -> str:
        """The answer field: 2^x, least significant digit first, zero-padded to power_width."""
        self._check_x(x)
        return digits_lsb_first(2 ** x, self.power_width)

    def power(self, k: int) -> str:
        """2^k in the answer's layout."""
        return digits_lsb_first(2 ** k, self.power_width)

    def target(self, x: int) -> str:
        """What the model writes after the prompt (the loss covers all of it)."""
        self._check_x(x)
        if not self.cot:
            return f"={self.answer(x)}."
        # The prompt "x:" labels the first frame; frame k (k = 1 .. x) is labelled x - k.
        frames = [self.power(0) + ","]
        frames += [f"{x - k:0{self.x_width}d}:{self.power(k)}," for k in range(1, x)]
        return "".join(frames) + f"{0:0{self.x_width}d}={self.answer(x)}."

    def roles(self, x: int) -> str:
        """What each character of ``target(x)`` is: ``p`` a digit of a power (the answer's
        included), ``l`` a digit of a countdown label, ``s`` a separator."""
        return "".join("s" if c in ":,=." else "p" for c in self.target(x)) if not self.cot else \
            "".join(self._frame_roles(x))

    def _frame_roles(self, x: int):
        yield "p" * self.power_width + "s"
        for _ in range(x):
            yield "l" * self.x_width + "s" + "p" * self.power_width + "s"

    def sequence(self, x: int) -> str:
        return self.prompt(x) + self.target(x)

    def max_target_len(self, xs: Sequence[int]) -> int:
        return max(len(self.target(x)) for x in xs)


def parse_answer(generated: str, width: int) -> Optional[str]:
    """The ``width`` characters after the first ``=`` of a generated target (None: no ``=``).
    Shorter when the generation stopped early."""
    at = generated.find("=")
    return None if at < 0 else generated[at + 1:at + 1 + width]


def parse_chain(sequence: str) -> List[Tuple[int, int]]:
    """(label, power) of every frame of a whole chain-of-thought sequence (the prompt labels the
    first frame, the answer is the last): the inverse of :meth:`PowerFormat.sequence` with
    ``cot=True``."""
    body, equals, answer = sequence.partition("=")
    frames = [f.split(":") for f in body.split(",")]
    if not equals or not answer.endswith(".") or len(frames) < 2 or any(len(f) != 2 for f in frames[:-1]) \
            or len(frames[-1]) != 1:
        raise ValueError(f"not a chain-of-thought sequence: {sequence!r}")
    labels = [int(f[0]) for f in frames]
    powers = [f[1] for f in frames[:-1]] + [answer[:-1]]
    return [(label, int(power[::-1])) for label, power in zip(labels, powers)]


def split_exponents(x_min: int, x_max: int, held_out_fraction: float, seed: int) -> Tuple[List[int], List[int]]:
    """Training and held-out exponents of [x_min, x_max]. The interior (x_min and x_max always
    train, so every held-out x lies inside the trained range) is cut into blocks of
    round(1 / held_out_fraction) consecutive exponents and one random exponent of each full block
    is held out: random, yet spread evenly over the range."""
    if not 1 <= x_min < x_max:
        raise ValueError(f"x_min and x_max must satisfy 1 <= x_min < x_max, got x_min={x_min}, x_max={x_max}")
    if not 0.0 <= held_out_fraction <= 0.5:
        raise ValueError(f"held_out_fraction must lie in [0, 0.5], got {held_out_fraction!r}")
    interior = list(range(x_min + 1, x_max))
    rng = random.Random(seed)
    block = round(1 / held_out_fraction) if held_out_fraction else len(interior) + 1
    held_out = [rng.choice(interior[i:i + block]) for i in range(0, len(interior) - block + 1, block)]
    train = [x for x in range(x_min, x_max + 1) if x not in set(held_out)]
    return train, held_out


def batch(fmt: PowerFormat, xs: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """inputs ``[B, T]`` and next-token targets ``[B, T]`` of the sequences of ``xs``, padded on
    the right; targets are IGNORE over the prompt and the padding."""
    seqs = [encode(fmt.sequence(x)) for x in xs]
    length = max(len(s) for s in seqs) - 1
    prompt_len = len(fmt.prompt(xs[0]))
    inputs = torch.full((len(seqs), length), PAD, dtype=torch.long)
    targets = torch.full((len(seqs), length), IGNORE, dtype=torch.long)
    for row, s in enumerate(seqs):
        inputs[row, :len(s) - 1] = torch.tensor(s[:-1])
        targets[row, prompt_len - 1:len(s) - 1] = torch.tensor(s[prompt_len:])
    return inputs, targets


class TrainingBatches:
    """The training sequences encoded once (``batch`` of all of them, on ``device``); a batch is a
    uniform draw of rows with replacement, cut to the longest sequence drawn."""

    def __init__(self, fmt: PowerFormat, xs: Sequence[int], device="cpu"):
        self.inputs, self.targets = (t.to(device) for t in batch(fmt, xs))
        self.lengths = torch.tensor([len(fmt.sequence(x)) - 1 for x in xs])

    def sample(self, size: int, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randint(len(self.lengths), (size,), generator=generator)
        length = int(self.lengths[rows].max())
        rows = rows.to(self.inputs.device)
        return self.inputs[rows, :length], self.targets[rows, :length]
