"""Softmax attention as a quadratic-complexity RNN, made runnable: a small pre-norm transformer
decoded with a KV cache (:class:`KVCacheDecoder`) and with no KV cache at all
(:class:`NoCacheDecoder`).

A softmax-attention layer is an RNN whose state is its whole KV cache. Dropping the cache means
recomputing it: layer l's keys and values at a block of positions need layer l-1's outputs there,
which need layer l-1's keys and values at every earlier position, and so on down to the token ids.
:class:`NoCacheDecoder` does exactly that, block by block and layer by layer, combining the
per-block partial attentions with the online-softmax merge of (o, lse). Memory holds O(layers x
block) activations whatever the length (only the ids grow); time for one token is
O(T^N / block^(N-2)) for N layers: linear for N = 1, super-quadratic per token for N >= 2.
"""
from typing import List, Optional

import torch
from torch import nn

from .._args import as_int, check_tensor
from .._host_copy import HostCopy
from .attn import softmax_attn_step, streaming_attn


class Block(nn.Module):
    """Pre-norm transformer block: x + Attn(LN(x)), then h + MLP(LN(h)); GQA attention."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, mlp_mult: int = 4):
        super().__init__()
        for value, name in ((dim, "dim"), (n_heads, "n_heads"), (n_kv_heads, "n_kv_heads"), (mlp_mult, "mlp_mult")):
            as_int(value, name, 1)
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(f"n_heads must divide dim and n_kv_heads must divide n_heads, got dim={dim}, "
                             f"n_heads={n_heads}, n_kv_heads={n_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.ln1 = nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_mult * dim), nn.GELU(), nn.Linear(mlp_mult * dim, dim))

    def q(self, x):  # [B, T, dim] -> [B, T, H, Dh]
        return self.wq(self.ln1(x)).unflatten(-1, (self.n_heads, self.head_dim))

    def kv(self, x):  # -> [B, T, Hkv, Dh] twice
        h = self.ln1(x)
        return (self.wk(h).unflatten(-1, (self.n_kv_heads, self.head_dim)),
                self.wv(h).unflatten(-1, (self.n_kv_heads, self.head_dim)))

    def finish(self, x, o):  # residual + output projection + MLP; o [B, T, H, Dh]
        h = x + self.wo(o.flatten(-2))
        return h + self.mlp(self.ln2(h))

    def forward(self, x):
        k, v = self.kv(x)
        return self.finish(x, streaming_attn(self.q(x), k, v, causal=True))


class TinyTransformer(nn.Module):
    """Embedding (tokens + learned positions), N causal softmax-attention blocks, LM head."""

    def __init__(self, vocab: int = 256, dim: int = 64, n_layers: int = 2, n_heads: int = 4,
                 n_kv_heads: Optional[int] = None, max_len: int = 4096, mlp_mult: int = 4):
        super().__init__()
        for value, name in ((vocab, "vocab"), (n_layers, "n_layers"), (max_len, "max_len")):
            as_int(value, name, 1)
        as_int(n_kv_heads, "n_kv_heads", 1, allow_none=True)
        self.vocab, self.max_len = vocab, max_len
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads or n_heads, mlp_mult) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def check_ids(self, ids, name: str = "ids", start: int = 0, read_values: bool = True) -> None:
        """ids: an int tensor [B, T] (T >= 1) at positions start..start+T-1 < max_len, with values in
        [0, vocab) (read only with read_values: on CUDA that is a device read)."""
        check_tensor(ids, name)
        if ids.dim() != 2 or ids.shape[1] < 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int32/int64 tensor [B, T] with T >= 1, got {ids.dtype} "
                             f"{list(ids.shape)}")
        if start + ids.shape[1] > self.max_len:
            raise ValueError(f"{name}: positions up to {start + ids.shape[1] - 1} exceed the model's max_len="
                             f"{self.max_len}")
        if read_values and ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab:
                raise ValueError(f"{name} must lie in [0, vocab={self.vocab}), got values in [{lo}, {hi}]")

    def embed(self, ids, start: int = 0):  # ids [B, T] at positions start..start+T-1
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(pos)

    def logits(self, x):
        return self.head(self.norm(x))

    def forward(self, ids):  # [B, T] -> logits [B, T, vocab]
        self.check_ids(ids)
        x = self.embed(ids)
        for blk in self.layers:
            x = blk(x)
        return self.logits(x)


class KVCacheDecoder:
    """Decoding with a KV cache per layer ([B, max_len, Hkv, Dh]; softmax_attn_step appends)."""

    def __init__(self, model: TinyTransformer, batch: int, max_len: Optional[int] = None):
        if not isinstance(model, TinyTransformer):
            raise TypeError(f"model must be a TinyTransformer, got {type(model).__name__}")
        self.batch = as_int(batch, "batch", 1)
        L = model.max_len if max_len is None else as_int(max_len, "max_len", 1, model.max_len)
        self.model = model
        p = next(model.parameters())
        self.k = [torch.zeros(batch, L, b.n_kv_heads, b.head_dim, device=p.device, dtype=p.dtype) for b in model.layers]
        self.v = [torch.zeros_like(c) for c in self.k]
        self.lens = torch.zeros(batch, dtype=torch.int32, device=p.device)
        # lens[0], the next token's position, without a device read per step while only this decoder
        # wrote lens.
        self._position = HostCopy()

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @torch.no_grad()
    def prefill(self, ids):  # ids [batch, T], 1 <= T <= max_len -> logits of the next token [batch, vocab]
        self.model.check_ids(ids)
        if ids.shape[0] != self.batch or ids.shape[1] > self.max_len:
            raise ValueError(f"ids must be [batch={self.batch}, T] with T <= max_len={self.max_len}, got "
                             f"{list(ids.shape)}")
        m, T = self.model, ids.shape[1]
        x = m.embed(ids)
        for i, blk in enumerate(m.layers):
            k, v = blk.kv(x)
            self.k[i][:, :T], self.v[i][:, :T] = k, v
            x = blk.finish(x, streaming_attn(blk.q(x), k, v, causal=True))
        self.lens.fill_(T)
        self._position.set(self.lens, T)
        return m.logits(x[:, -1])

    @torch.no_grad()
    def step(self, token):  # token [batch] -> logits of the next token [batch, vocab]
        """Appends one token per sequence. Its values are checked when token is on the CPU (on CUDA
        that would be a device read per step)."""
        m = self.model
        check_tensor(token, "token")
        if token.shape != (self.batch,):
            raise ValueError(f"token must be [batch={self.batch}], got {list(token.shape)}")
        pos = self._position.get(self.lens, lambda lens: int(lens[0]))  # equal lengths in the batch
        if pos >= self.max_len:
            raise ValueError(f"token: the KV cache is full (max_len={self.max_len} tokens); build the decoder with a "
                             "larger max_len")
        m.check_ids(token[:, None], "token", pos, read_values=not token.is_cuda)
        x = m.embed(token[:, None], pos)[:, 0]
        for i, blk in enumerate(m.layers):
            k, v = blk.kv(x)
            o = softmax_attn_step(blk.q(x), self.k[i], self.v[i], self.lens, k_new=k, v_new=v)
            x = blk.finish(x, o)
        self.lens += 1
        self._position.set(self.lens, pos + 1)
        return m.logits(x)

    def cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.k + self.v)


def _merge(o_acc, lse_acc, o, lse):
    """Online-softmax merge of two partial attentions over disjoint key sets: (o, lse) with
    o [B, T, H, Dv], lse [B, H, T]. lse_acc must be finite (the diagonal block goes first)."""
    lse_new = torch.logaddexp(lse_acc, lse)
    a = torch.exp(lse_acc - lse_new).transpose(1, 2).unsqueeze(-1)
    b = torch.exp(lse - lse_new).transpose(1, 2).unsqueeze(-1)
    return o_acc * a.to(o_acc.dtype) + o * b.to(o.dtype), lse_new


class NoCacheDecoder:
    """Next-token logits from the token ids alone, keeping no KV cache.

    ``next_logits(ids)`` computes the last layer's output at the last position. Layer l's output
    at a block of positions [s, e) (e a block end or the sequence end) is computed by
    ``_hidden(l, s, e)``: its queries come from layer l-1's output at [s, e); its keys and values
    are streamed over blocks of ``block_size`` positions, each recomputed from layer l-1's output
    on that block, itself recomputed recursively (never stored); per-block attentions (o, lse)
    are merged by the online-softmax rule. Live memory: O(n_layers x block_size x dim).
    """

    def __init__(self, model: TinyTransformer, block_size: int = 64):
        if not isinstance(model, TinyTransformer):
            raise TypeError(f"model must be a TinyTransformer, got {type(model).__name__}")
        self.model = model
        self.block = as_int(block_size, "block_size", 1)
        self.calls = 0  # _hidden evaluations (for the cost model)

    def _hidden(self, level: int, ids, start: int, end: int):
        """Output of layer `level` (0 = embeddings) at positions [start, end), end - 1 in the
        block [j0, end) with j0 = (end - 1) // block * block and start >= j0."""
        self.calls += 1
        m = self.model
        if level == 0:
            return m.embed(ids[:, start:end], start)
        blk = m.layers[level - 1]
        j0 = (end - 1) // self.block * self.block
        x_diag = self._hidden(level - 1, ids, j0, end)  # layer level-1 at the diagonal block
        x = x_diag[:, start - j0:]
        q = blk.q(x)
        # Diagonal block first (every query sees at least its own key): bottom-right causal.
        k, v = blk.kv(x_diag)
        o, lse = streaming_attn(q, k, v, causal=True, return_lse=True)
        del x_diag, k, v
        # Earlier blocks, fully visible: keys and values recomputed from the ids.
        for b0 in range(0, j0, self.block):
            xb = self._hidden(level - 1, ids, b0, b0 + self.block)
            k, v = blk.kv(xb)
            del xb
            ob, lb = streaming_attn(q, k, v, causal=False, return_lse=True)
            o, lse = _merge(o, lse, ob, lb)
            del k, v, ob, lb
        return blk.finish(x, o)

    @torch.no_grad()
    def next_logits(self, ids):  # ids [B, T] (1 <= T <= max_len) -> logits [B, vocab]
        self.model.check_ids(ids)
        T = ids.shape[1]
        x = self._hidden(len(self.model.layers), ids, T - 1, T)
        return self.model.logits(x[:, -1])

    @torch.no_grad()
    def generate(self, ids, steps: int) -> torch.Tensor:
        """Greedy decoding: appends `steps` (>= 0) tokens to ids [B, T]; T + steps <= max_len."""
        as_int(steps, "steps", 0)
        self.model.check_ids(ids)
        if ids.shape[1] + steps > self.model.max_len:
            raise ValueError(f"steps: {ids.shape[1]} + {steps} tokens exceed the model's max_len={self.model.max_len}")
        for _ in range(steps):
            nxt = self.next_logits(ids).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
        return ids


__all__: List[str] = ["Block", "TinyTransformer", "KVCacheDecoder", "NoCacheDecoder"]
