"""attnrnn: attention viewed as an RNN.

Causal linear attention in chunkwise, recurrent and single-step forms as PyTorch ops with CPU
and CUDA kernels; `attnrnn.reference` holds the same math in plain PyTorch. `attnrnn.nn` has the
layers and the decoding cache, `attnrnn.lm` a small causal LM, `attnrnn.softmax` softmax
attention as an RNN, `attnrnn.distributed` context parallelism over torch.distributed.
"""
from pathlib import Path

from . import distributed, lm, nn, reference, softmax
from .linear_attn import (
    FEATURE_MAPS,
    LinearAttnState,
    chunk_linear_attn,
    linear_attn_step,
    recurrent_linear_attn,
)

__version__ = "0.1.0"

#: CMake prefix of the installed C++ package: `cmake -DCMAKE_PREFIX_PATH=<this> ...` then
#: `find_package(attnrnn CONFIG REQUIRED)` gives targets attnrnn::attnrnn and attnrnn::torch.
cmake_prefix_path = str(Path(__file__).resolve().parent)

__all__ = [
    "FEATURE_MAPS",
    "LinearAttnState",
    "chunk_linear_attn",
    "recurrent_linear_attn",
    "linear_attn_step",
    "reference",
    "softmax",
    "distributed",
    "nn",
    "lm",
    "cmake_prefix_path",
]
