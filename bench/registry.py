"""The shapes we benchmark, in one place.

Training shapes are (B, T, H, D) with K = V = D; decode shapes are (B, H, D) with an fp32 state.
GPU shapes follow docs/design.md §5; CPU shapes are the 2-core targets.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainShape:
    B: int
    T: int
    H: int
    D: int

    @property
    def tag(self):
        return f"B{self.B}-T{self.T}-H{self.H}-D{self.D}"


@dataclass(frozen=True)
class DecodeShape:
    B: int
    H: int
    D: int

    @property
    def tag(self):
        return f"B{self.B}-H{self.H}-D{self.D}"


TRAIN = {
    "cpu": [TrainShape(2, 4096, 4, 64)],
    "cuda": [TrainShape(8, 2048, 16, 64), TrainShape(4, 8192, 16, 128), TrainShape(1, 65536, 16, 128),
             TrainShape(8, 4096, 32, 64)],
}

DECODE = {
    "cpu": [DecodeShape(8, 32, 128)],
    "cuda": [DecodeShape(64, 32, 128), DecodeShape(256, 32, 128)],
}

DTYPE = {"cpu": "float32", "cuda": "bfloat16"}
