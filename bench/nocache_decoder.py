"""Decoding softmax attention with no KV cache against KV-cached decoding: time per token and peak
memory against the sequence length, for N = 1, 2, 4 layers (attnrnn.softmax.NoCacheDecoder).

    python bench/nocache_decoder.py --device cpu --out bench/results/nocache_decoder_cpu.json

Time per token: NoCacheDecoder.next_logits at length L (the whole recomputation), against one
KVCacheDecoder.step at cache length L - 1 (minimum of a few runs after a warm-up). Peak memory: on CUDA
torch.cuda.max_memory_allocated above the model and ids; on the CPU, peak bytes of live tensors
created during the call, tracked with a TorchDispatchMode (storages counted once, released when
their last tensor dies; tracemalloc does not see torch's allocator), plus the preallocated KV
cache for the cached decoder (which would grow with L).
"""
import argparse
import json
import pathlib
import time
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import attnrnn
from attnrnn.softmax import KVCacheDecoder, NoCacheDecoder, TinyTransformer


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages created by ops while active (CPU memory meter)."""

    def __init__(self, ignore=()):
        super().__init__()
        self.ignore = {t.untyped_storage().data_ptr() for t in ignore}
        self.live, self.cur, self.peak = {}, 0, 0

    def _release(self, key):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.cur -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key == 0 or key in self.ignore:
                continue
            if key in self.live:
                self.live[key][1] += 1
            else:
                self.live[key] = [st.nbytes(), 1]
                self.cur += st.nbytes()
                self.peak = max(self.peak, self.cur)
            weakref.finalize(t, self._release, key)
        return out


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(fn, device, ignore, reps):
    """(min seconds, peak bytes) of fn(): the minimum, as the shared CPU machine is noisy."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with LiveTensorBytes(ignore) as meter:
            fn()
        peak = meter.peak
    return min(times), peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", default="1,2,4")
    ap.add_argument("--lengths", default="64,128,256,512,1024,2048")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--budget", type=float, default=4.0, help="skip longer lengths once a call takes this long (s)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/nocache_decoder_cpu.json")
    args = ap.parse_args()
    dev = args.device
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for N in map(int, args.layers.split(",")):
        lengths = list(map(int, args.lengths.split(",")))
        model = TinyTransformer(vocab=256, dim=args.dim, n_layers=N, n_heads=args.heads, max_len=max(lengths) + 1)
        model = model.to(dev).eval()
        params = list(model.parameters())
        nocache_alive = True
        for L in lengths:
            ids = torch.randint(0, 256, (1, L), device=dev)
            row = dict(layers=N, length=L)
            # KV cache: prefill L - 1 tokens, then time steps at cache length L - 1.
            kv = KVCacheDecoder(model, batch=1, max_len=min(L + 16, model.max_len))
            kv.prefill(ids[:, :L - 1])
            lens0 = kv.lens.clone()

            def kv_step():
                kv.lens.copy_(lens0)
                return kv.step(ids[:, L - 1])
            t, peak = measure(kv_step, dev, params + kv.k + kv.v + [ids, kv.lens, lens0], reps=9)
            row.update(kv_s_per_token=t, kv_peak_bytes=peak + kv.cache_bytes(), kv_cache_bytes=kv.cache_bytes())
            del kv
            if nocache_alive:
                nc = NoCacheDecoder(model, block_size=args.block)
                reps = 3
                t, peak = measure(lambda: nc.next_logits(ids), dev, params + [ids], reps=reps)
                nc.calls = 0
                nc.next_logits(ids)
                row.update(nocache_s_per_token=t, nocache_peak_bytes=peak, nocache_block_evals=nc.calls)
                nocache_alive = t < args.budget
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = dict(command="python bench/nocache_decoder.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items()), device=dev, torch=torch.__version__,
        threads=torch.get_num_threads(), attnrnn=attnrnn.__version__)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    plot(rows, out.with_suffix(".png"), meta)
    print_table(rows)


def print_table(rows):
    print("| N | L | no cache: ms/token | no cache: peak KB | block evals | KV cache: ms/token | KV cache: peak KB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        nc_t = f"{1e3 * r['nocache_s_per_token']:.2f}" if "nocache_s_per_token" in r else "—"
        nc_m = f"{r['nocache_peak_bytes'] / 1024:.0f}" if "nocache_peak_bytes" in r else "—"
        nc_c = str(r.get("nocache_block_evals", "—"))
        print(f"| {r['layers']} | {r['length']} | {nc_t} | {nc_m} | {nc_c} | {1e3 * r['kv_s_per_token']:.3f} | "
              f"{r['kv_peak_bytes'] / 1024:.0f} |")


def plot(rows, path, meta):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, N in enumerate(sorted({r["layers"] for r in rows})):
        rs = [r for r in rows if r["layers"] == N]
        c = f"C{i}"
        nc = [r for r in rs if "nocache_s_per_token" in r]
        a.loglog([r["length"] for r in nc], [1e3 * r["nocache_s_per_token"] for r in nc], "o-", c=c,
                 label=f"no cache, N={N}")
        a.loglog([r["length"] for r in rs], [1e3 * r["kv_s_per_token"] for r in rs], "s--", c=c, label=f"KV cache, N={N}")
        b.loglog([r["length"] for r in nc], [r["nocache_peak_bytes"] / 1024 for r in nc], "o-", c=c,
                 label=f"no cache, N={N}")
        b.loglog([r["length"] for r in rs], [r["kv_peak_bytes"] / 1024 for r in rs], "s--", c=c, label=f"KV cache, N={N}")
    a.set(xlabel="sequence length L", ylabel="ms per token", title="time per decoded token")
    b.set(xlabel="sequence length L", ylabel="peak KB (live tensors)", title="peak memory per token")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"softmax attention without a KV cache ({meta['device']}, {meta['threads']} threads)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
