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

from ._args import as_finite, as_flag, as_int, check_tensor
from .nn import AttentionCache, HedgehogFeatureMap, LinearAttention, SoftmaxAttention
from .nn.cache import checks_on_device, guard, kept, nan_if, poison

__all__ = ["LMConfig", "CausalLM"]

LAYER_TYPES = ("linear", "softmax")
FEATURE_MAPS = ("elu1", "relu", "identity", "hedgehog")


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

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raises TypeError (a field of the wrong type) or ValueError (out of range) naming the field;
        the layers check what they take themselves (head dims, heads dividing the width)."""
        as_int(self.vocab_size, "vocab_size", 1)
        as_int(self.hidden_size, "hidden_size", 1)
        as_int(self.num_layers, "num_layers", 1)
        as_int(self.num_heads, "num_heads", 1)
        as_int(self.num_kv_heads, "num_kv_heads", 1, allow_none=True)
        as_int(self.head_dim, "head_dim", 1, allow_none=True)
        if not isinstance(self.feature_map, str):
            raise TypeError(f"feature_map must be a str, one of {FEATURE_MAPS}, got {type(self.feature_map).__name__}")
        if self.feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {self.feature_map!r}")
        for name in ("normalize", "qk_norm", "output_norm", "token_shift", "tie_embeddings"):
            as_flag(getattr(self, name), name)
        if as_finite(self.mlp_ratio, "mlp_ratio") <= 0 or int(self.mlp_ratio * self.hidden_size) < 1:
            raise ValueError(f"mlp_ratio must give an MLP width int(mlp_ratio * hidden_size) >= 1, got "
                             f"{self.mlp_ratio!r}")
        self.resolved_layer_types()

    def resolved_layer_types(self) -> Tuple[str, ...]:
        lt = self.layer_types
        if isinstance(lt, str):
            if lt == "hybrid":
                return tuple("softmax" if i % 2 else "linear" for i in range(self.num_layers))
            if lt not in LAYER_TYPES:
                raise ValueError(f"layer_types must be 'linear', 'softmax', 'hybrid' or a list of those per layer, "
                                 f"got {lt!r}")
            return (lt,) * self.num_layers
        if not isinstance(lt, Sequence):
            raise TypeError(f"layer_types must be a str or a list of str, got {type(lt).__name__}")
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


def _check_token_values(input_ids: torch.Tensor, vocab_size: int) -> None:
    if input_ids.numel():  # a device read (a sync on CUDA)
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"input_ids must lie in [0, vocab_size={vocab_size}), got values in [{lo}, {hi}]")


@torch.library.custom_op("attnrnn_nn::checked_token_ids", mutates_args=())
def _checked_token_ids(input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """input_ids after _check_token_values, inside a graph compiled for the CPU: every later use (the
    embedding, the cache's last token) takes the copy, so none runs before the check. (Compiled on
    CUDA the ids are checked on the device instead, see CausalLM._check.)"""
    _check_token_values(input_ids, vocab_size)
    return input_ids.clone()


@_checked_token_ids.register_fake
def _(input_ids, vocab_size):
    return torch.empty_like(input_ids)


def _check_top_k(top_k):
    as_int(top_k, "top_k", 1, allow_none=True)


class CausalLM(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab_size]``.

    With ``cache`` (from :meth:`make_cache`) and ``state_indices [B]`` (allocated slots), the call
    continues those sequences: a prompt (T > 1, chunk kernel) or one token each (T == 1, step
    kernel). Everything is checked before the cache is written: a bad call raises ValueError and
    changes nothing, except compiled on CUDA, where it changes nothing and returns NaN logits
    without raising (raising would need a device sync on every call; see ``attnrnn.nn.cache``).
    """

    def __init__(self, config: LMConfig):
        super().__init__()
        if not isinstance(config, LMConfig):
            raise TypeError(f"config must be an LMConfig, got {type(config).__name__}")
        config.check()  # again: a dataclass's fields may have changed since it was built
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
        as_int(num_slots, "num_slots", 1)
        if "softmax" in self.layer_types and max_len is None:
            raise ValueError("max_len is required: this model has softmax layers, whose KV cache grows with the context")
        pools = [b.attn.make_state(num_slots, max_len=max_len, device=device) for b in self.blocks]
        extras = {"last_token": torch.zeros(num_slots, dtype=torch.long, device=device)} if self.shift_embed else {}
        return AttentionCache(pools, extras=extras, signature=self.cache_signature())

    def _check(self, input_ids, cache, state_indices, ids_in_range=False):
        """Checks a call; returns (input_ids, the cache's slots or None, bad): under torch.compile
        the checked copies, which every later step must use (see _checked_token_ids). Compiled on
        CUDA nothing raises: ids out of the vocabulary are clamped into it and set ``bad`` (a 0-dim
        bool tensor; None elsewhere), which poisons the slots; see attnrnn.nn.cache."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be an int tensor [B, T], got {input_ids.dtype} {list(input_ids.shape)}")
        compiling = torch.compiler.is_compiling()
        bad = None
        if not ids_in_range:
            vocab = self.config.vocab_size
            if checks_on_device(input_ids.device):  # the embedding must not read past its table
                bad = ((input_ids < 0) | (input_ids >= vocab)).any()
                input_ids = input_ids.clamp(0, vocab - 1)
            elif compiling:
                input_ids = torch.ops.attnrnn_nn.checked_token_ids(input_ids, vocab)
            else:
                _check_token_values(input_ids, vocab)
        if cache is None:
            if state_indices is not None:
                raise ValueError("state_indices needs a cache")
            return input_ids, None, bad
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
        if B:  # every KV cache must take the tokens before the first layer writes anything
            slots = None if compiling else cache._slots_of(idx)
            for i, pool in enumerate(cache.layers):
                if pool.kind == "softmax":
                    idx = pool.check_room(idx, T, i, "input_ids", slots)
        if bad is not None:
            idx = poison(idx, bad)
        return input_ids, idx, bad

    # -- forward and generation ------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: Optional[AttentionCache] = None,
                state_indices: Optional[torch.Tensor] = None, *, _ids_in_range: bool = False) -> torch.Tensor:
        """input_ids ``[B, T]`` (int) -> logits ``[B, T, vocab_size]``. (``_ids_in_range``: generate's
        own tokens, sampled from the logits, skip the range check's device read.)"""
        input_ids, idx, bad = self._check(input_ids, cache, state_indices, _ids_in_range)
        rows = idx
        if cache is not None:  # compiled on CUDA: a bad call's rows are read, and written unchanged
            rows, bad = guard(idx)
        input_ids = input_ids.long()
        h = self.embed(input_ids)
        if self.shift_embed is not None:
            B = input_ids.shape[0]
            first = cache.extras["last_token"][rows] if cache is not None else input_ids.new_zeros(B)
            prev = torch.cat([first[:, None], input_ids[:, :-1] + 1], dim=1)
            h = h + self.shift_embed(prev)
        for block in self.blocks:
            h = block(h, cache, idx)
        if cache is not None and self.shift_embed is not None and input_ids.shape[1] > 0:
            cache.extras["last_token"].index_copy_(0, rows, kept(bad, input_ids[:, -1] + 1, lambda: first))
        return nan_if(bad, self.head(self.norm(h)))

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
        as_int(max_new_tokens, "max_new_tokens", 0)
        as_finite(temperature, "temperature", minimum=0)
        check_tensor(input_ids, "input_ids")
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
