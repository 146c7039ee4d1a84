"""A small causal language model of linear, softmax or hybrid attention layers.

Each block is pre-norm: ``h = h + attn(rms(h)); h = h + mlp(rms(h))`` with a SwiGLU MLP. The
input embedding adds a learned embedding of the *previous* token (a one-token "token shift",
as in RWKV/short convolutions) so that a single attention layer can bind a key to the value that
follows it; its decoding state is one int per sequence, kept in the cache next to the layer
states. There is no positional encoding: causal masking (softmax) and the recurrence (linear)
give the order.

Prefill runs the chunk kernel (and SDPA for softmax layers); decoding then costs O(1) state per
linear layer and O(N) per softmax layer::

    model = CausalLM(LMConfig(vocab_size=64, layer_types="hybrid"))
    out = model.generate(prompt, max_new_tokens=20, temperature=0.8, top_k=5)   # [B, T0 + 20]
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .nn import AttentionCache, HedgehogFeatureMap, LinearAttention, SoftmaxAttention

__all__ = ["LMConfig", "CausalLM"]

LAYER_TYPES = ("linear", "softmax")


@dataclass
class LMConfig:
    """Configuration of :class:`CausalLM`.

    ``layer_types``: ``"linear"``, ``"softmax"``, ``"hybrid"`` (linear layers with every second
    one softmax: ``linear, softmax, linear, softmax, ...``) or one entry per layer.
    ``feature_map``: ``"elu1"``, ``"relu"``, ``"identity"`` (fused) or ``"hedgehog"`` (a learnable
    :class:`~attnrnn.nn.HedgehogFeatureMap` per layer).
    """

    vocab_size: int
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    layer_types: Union[str, Sequence[str]] = "linear"
    feature_map: str = "elu1"
    normalize: bool = True
    qk_norm: bool = False
    output_norm: bool = False
    mlp_ratio: float = 2.0
    token_shift: bool = True
    tie_embeddings: bool = True

    def resolved_layer_types(self) -> Tuple[str, ...]:
        lt = self.layer_types
        if isinstance(lt, str):
            if lt == "hybrid":
                return tuple("softmax" if i % 2 else "linear" for i in range(self.num_layers))
            if lt not in LAYER_TYPES:
                raise ValueError(f"layer_types must be 'linear', 'softmax', 'hybrid' or a list of those per layer, "
                                 f"got {lt!r}")
            return (lt,) * self.num_layers
        lt = tuple(lt)
        if len(lt) != self.num_layers or any(t not in LAYER_TYPES for t in lt):
            raise ValueError(f"layer_types must list {self.num_layers} entries from {LAYER_TYPES}, got {lt!r}")
        return lt


class _MLP(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        a, b = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(a) * b)


class _Block(nn.Module):
    def __init__(self, cfg: LMConfig, kind: str, layer_idx: int):
        super().__init__()
        common = dict(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, qk_norm=cfg.qk_norm, layer_idx=layer_idx)
        if kind == "linear":
            head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_heads
            fm = HedgehogFeatureMap(head_dim) if cfg.feature_map == "hedgehog" else cfg.feature_map
            self.attn = LinearAttention(cfg.hidden_size, cfg.num_heads, feature_map=fm, normalize=cfg.normalize,
                                        output_norm=cfg.output_norm, **common)
        else:
            self.attn = SoftmaxAttention(cfg.hidden_size, cfg.num_heads, **common)
        self.norm1 = nn.RMSNorm(cfg.hidden_size)
        self.norm2 = nn.RMSNorm(cfg.hidden_size)
        self.mlp = _MLP(cfg.hidden_size, int(cfg.mlp_ratio * cfg.hidden_size))

    def forward(self, h, cache, idx):
        h = h + self.attn(self.norm1(h), cache, idx)
        return h + self.mlp(self.norm2(h))


def _check_top_k(top_k):
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")


class CausalLM(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab_size]``.

    With ``cache`` (from :meth:`make_cache`) and ``state_indices [B]`` (allocated slots), the call
    continues those sequences: a prompt (T > 1, chunk kernel) or one token each (T == 1, step
    kernel). Everything is checked before the cache is written.
    """

    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.layer_types = config.resolved_layer_types()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        # Row 0: "no previous token" (start of a sequence); row i + 1: token i.
        self.shift_embed = nn.Embedding(config.vocab_size + 1, config.hidden_size) if config.token_shift else None
        self.blocks = nn.ModuleList(_Block(config, kind, i) for i, kind in enumerate(self.layer_types))
        self.norm = nn.RMSNorm(config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, HedgehogFeatureMap):  # runs after its Linear child: restore the identity start
            m.reset_parameters()

    # -- cache -----------------------------------------------------------------------------------
    def cache_signature(self) -> tuple:
        """What a compatible cache must have been built for: every layer's state spec."""
        return (tuple(b.attn.spec() for b in self.blocks), self.config.token_shift)

    def make_cache(self, num_slots: int, max_len: Optional[int] = None, device=None) -> AttentionCache:
        """A cache for ``num_slots`` concurrent sequences. ``max_len`` (tokens per sequence) is
        needed only by softmax layers; linear layers keep ``S [P, Hkv, K, V]``, ``z [P, Hkv, K]``."""
        device = self.embed.weight.device if device is None else device
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if "softmax" in self.layer_types and max_len is None:
            raise ValueError("max_len is required: this model has softmax layers, whose KV cache grows with the context")
        pools = [b.attn.make_state(num_slots, max_len=max_len, device=device) for b in self.blocks]
        extras = {"last_token": torch.zeros(num_slots, dtype=torch.long, device=device)} if self.shift_embed else {}
        return AttentionCache(pools, extras=extras, signature=self.cache_signature())

    def _check(self, input_ids, cache, state_indices, ids_in_range=False):
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be an int tensor [B, T], got {input_ids.dtype} {list(input_ids.shape)}")
        compiling = torch.compiler.is_compiling()
        if not compiling and not ids_in_range and input_ids.numel():  # a device read (a sync on CUDA)
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"input_ids must lie in [0, vocab_size={self.config.vocab_size}), got values in "
                                 f"[{lo}, {hi}]")
        if cache is None:
            if state_indices is not None:
                raise ValueError("state_indices needs a cache")
            return None
        if not isinstance(cache, AttentionCache):
            raise TypeError(f"cache must be an attnrnn.nn.AttentionCache, got {type(cache).__name__}")
        if cache.signature != self.cache_signature():
            ours = self.cache_signature()
            theirs = cache.signature if isinstance(cache.signature, tuple) and len(cache.signature) == 2 else (
                cache.signature, None)
            raise ValueError(f"cache was built for another model: its layers are {theirs[0]} with token_shift="
                             f"{theirs[1]}, this model's are {ours[0]} ({len(self.blocks)} layers) with token_shift="
                             f"{ours[1]}; use model.make_cache()")
        B, T = input_ids.shape
        idx = cache.check_indices(state_indices, B)
        if not compiling and B:
            slots = cache._slots_of(idx)
            for i, pool in enumerate(cache.layers):
                if pool.kind == "softmax" and pool.end_after(slots, T) > pool.max_len:
                    raise ValueError(f"input_ids: {T} more token(s) exceed the KV cache of layer {i} "
                                     f"(max_len={pool.max_len}); build the cache with a larger max_len")
        return idx

    # -- forward and generation ------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: Optional[AttentionCache] = None,
                state_indices: Optional[torch.Tensor] = None, *, _ids_in_range: bool = False) -> torch.Tensor:
        """input_ids ``[B, T]`` (int) -> logits ``[B, T, vocab_size]``. (``_ids_in_range``: generate's
        own tokens, sampled from the logits, skip the range check's device read.)"""
        idx = self._check(input_ids, cache, state_indices, _ids_in_range)
        input_ids = input_ids.long()
        h = self.embed(input_ids)
        if self.shift_embed is not None:
            B = input_ids.shape[0]
            first = cache.extras["last_token"][idx] if cache is not None else input_ids.new_zeros(B)
            prev = torch.cat([first[:, None], input_ids[:, :-1] + 1], dim=1)
            h = h + self.shift_embed(prev)
        for block in self.blocks:
            h = block(h, cache, idx)
        if cache is not None and self.shift_embed is not None and input_ids.shape[1] > 0:
            cache.extras["last_token"].index_copy_(0, idx, input_ids[:, -1] + 1)
        return self.head(self.norm(h))

    @staticmethod
    def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
               generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """logits ``[B, vocab]`` -> token ids ``[B]``: greedy when ``temperature <= 0``, else
        sampling from ``softmax(logits / temperature)`` restricted to the ``top_k`` best
        (``top_k``: None or an int >= 1)."""
        _check_top_k(top_k)
        if temperature <= 0:
            return logits.argmax(dim=-1)
        logits = logits.float() / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Continues ``input_ids [B, T0]`` (T0 >= 1) by ``max_new_tokens``; returns ``[B, T0 + n]``.

        ``temperature`` (>= 0; 0 is greedy) and ``top_k`` (None or an int >= 1) are as in
        :meth:`sample`; they are checked before the prompt runs.

        The prompt is prefilled in one call (chunk kernel), then each new token is one decoding
        step (step kernel: O(1) state per linear layer)."""
        _check_top_k(top_k)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [B, T0] with T0 >= 1, got {list(input_ids.shape)}")
        B, T0 = input_ids.shape
        cache = self.make_cache(B, max_len=T0 + max_new_tokens)
        idx = cache.allocate(B)
        logits = self(input_ids, cache, idx)[:, -1]
        out = [input_ids.long()]
        for i in range(max_new_tokens):
            tok = self.sample(logits, temperature, top_k, generator)
            out.append(tok[:, None])
            if i + 1 < max_new_tokens:
                logits = self(tok[:, None], cache, idx, _ids_in_range=True)[:, -1]
        return torch.cat(out, dim=1)

    def extra_repr(self) -> str:
        return f"config={asdict(self.config)}"
