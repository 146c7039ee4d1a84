"""Causal softmax attention as an RNN.

- :func:`streaming_attn`: the blocked online-softmax forward (o and the log-sum-exp per query)
  and its recomputing backward, with GQA, varlen and bottom-right causal alignment;
- :func:`softmax_attn_step`: one decode token over a KV cache, split over the cache length;
- :class:`NoCacheDecoder`: decodes a stack of attention layers keeping no KV cache at all,
  recomputing every layer's keys and values from the token ids (constant memory, super-quadratic
  time), next to :class:`TinyTransformer` and its KV-cached decoding;
- :func:`reference_attn`: the same math in plain PyTorch.
"""
from .attn import reference_attn, softmax_attn_step, streaming_attn
from .decoder import KVCacheDecoder, NoCacheDecoder, TinyTransformer

__all__ = ["streaming_attn", "softmax_attn_step", "reference_attn", "TinyTransformer", "KVCacheDecoder",
           "NoCacheDecoder"]
