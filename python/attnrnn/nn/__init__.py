"""attnrnn.nn: attention layers and decoding caches for model authors.

* :class:`LinearAttention` - projections, optional q/k and output RMSNorm, fused (``"elu1"``,
  ``"relu"``, ``"identity"``) or module feature maps; chunk kernel for training and prefill,
  step kernel for decoding.
* :class:`SoftmaxAttention` - SDPA with a KV cache, for hybrid stacks.
* :class:`AttentionCache` - per-layer state pools (``S [P, Hkv, K, V]``, ``z [P, Hkv, K]``, or a KV
  cache) with a slot allocator; ``state_indices [B]`` addresses rows for batched serving.
* :class:`HedgehogFeatureMap` - a learnable softmax feature map.
"""
from .attention import LinearAttention, SoftmaxAttention
from .cache import AttentionCache, KVPool, LinearStatePool
from .feature_maps import ELU1FeatureMap, HedgehogFeatureMap, ReLUFeatureMap

__all__ = [
    "LinearAttention",
    "SoftmaxAttention",
    "AttentionCache",
    "LinearStatePool",
    "KVPool",
    "HedgehogFeatureMap",
    "ELU1FeatureMap",
    "ReLUFeatureMap",
]
