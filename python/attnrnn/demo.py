"""attnrnn demo: causal linear attention is an RNN.

1. The three forms - parallel (float64 reference), recurrent (token by token) and chunkwise - give
   the same outputs, final state and gradients.
2. A small linear-attention language model (attnrnn.lm.CausalLM) learns associative recall, a
   task that needs memory of the past: it reads key-value pairs ("c 7 x 2 ..."), then after "|"
   must answer each queried key with its value. Progress bar with loss and recall accuracy.
3. It generates: prompts are prefilled through the chunk kernel, then every new token is one
   O(1)-state step of the decode kernel; the generated answers are scored.
4. Decoding cost against context length: time and memory per decoded token of a linear-attention
   layer (state S, z: constant) and of a softmax layer (KV cache: grows with the context), printed
   as a table and plotted to a PNG.

Run: python -m attnrnn.demo [--quick] [--device cpu|cuda] [--out DIR] [--train-seconds S]
(uses CUDA when a GPU is present and attnrnn's CUDA ops work, otherwise the CPU; no network).
"""
import argparse
import contextlib
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnrnn
from attnrnn import reference
from attnrnn.lm import CausalLM, LMConfig
from attnrnn.nn import LinearAttention, SoftmaxAttention


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------
# 1. three forms
# --------------------------------------------------------------------------------------------------
def three_forms(device, B=2, T=777, H=4, Hkv=2, K=64, V=48):
    print(f"1) three forms on {device}: B={B} T={T} H={H} Hkv={Hkv} K={K} V={V}, fp32 inputs, elu1, normalize")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, Hkv, K, generator=gen)
    v = torch.randn(B, T, Hkv, V, generator=gen)
    do = torch.randn(B, T, H, V, generator=gen)
    opts = dict(feature_map="elu1", normalize=True, output_final_state=True)

    def run(fn, dtype, dev, **extra):
        ins = [t.to(device=dev, dtype=dtype).detach().clone().requires_grad_() for t in (q, k, v)]  # own leaves
        t0 = time.perf_counter()
        o, state = fn(*ins, **opts, **extra)
        o.backward(do.to(device=dev, dtype=dtype))
        _sync(dev)
        elapsed = (time.perf_counter() - t0) * 1e3
        return o.detach().cpu(), state.S.detach().cpu(), [x.grad.cpu() for x in ins], elapsed

    ref_o, ref_S, ref_g, _ = run(reference.parallel_linear_attn, torch.float64, "cpu")
    print(f"   {'form':34s} {'rel err o':>10s} {'rel err S':>10s} {'rel err dq,dk,dv (max)':>24s} {'ms':>8s}")
    for name, fn, extra in (
        ("attnrnn.recurrent_linear_attn", attnrnn.recurrent_linear_attn, {}),
        ("attnrnn.chunk_linear_attn (C=64)", attnrnn.chunk_linear_attn, {"chunk_size": 64}),
        ("reference.chunk_linear_attn fp32", reference.chunk_linear_attn, {}),
    ):
        dev = "cpu" if name.startswith("reference") else device
        o, S, g, ms = run(fn, torch.float32, dev, **extra)
        gerr = max(_rel(a, b) for a, b in zip(g, ref_g))
        print(f"   {name:34s} {_rel(o, ref_o):10.2e} {_rel(S, ref_S):10.2e} {gerr:24.2e} {ms:8.1f}")


# --------------------------------------------------------------------------------------------------
# 2. associative recall
# --------------------------------------------------------------------------------------------------
class RecallTask:
    """Associative recall: ``k1 v1 ... kn vn | q1 a1 ... qm am`` with distinct keys (letters),
    values (digits) and queries drawn from the keys; ``a_i`` is the value paired with ``q_i``.

    Tokens: keys ``0..25`` ('a'..'z'), values ``26..35`` ('0'..'9'), ``36`` = '|'. The loss covers
    the query section (queries are random among the keys, answers are determined by the past);
    recall accuracy counts the answers.
    """

    NUM_KEYS, NUM_VALUES = 26, 10
    SEP = NUM_KEYS + NUM_VALUES
    VOCAB = SEP + 1

    def __init__(self, num_pairs=8, num_queries=8):
        self.n, self.m = num_pairs, num_queries

    @classmethod
    def text(cls, ids):
        out = []
        for t in ids.tolist():
            out.append(chr(ord("a") + t) if t < cls.NUM_KEYS else "|" if t == cls.SEP else str(t - cls.NUM_KEYS))
        return " ".join(out)

    def sample(self, batch, generator, device="cpu"):
        """Returns seq ``[B, 2n + 1 + 2m]`` (int64) and the key -> value table ``[B, 26]`` (-1: absent)."""
        n, m, B = self.n, self.m, batch
        keys = torch.argsort(torch.rand(B, self.NUM_KEYS, generator=generator), dim=1)[:, :n]
        vals = torch.randint(self.NUM_KEYS, self.SEP, (B, n), generator=generator)
        qi = torch.randint(0, n, (B, m), generator=generator)
        qk, qa = keys.gather(1, qi), vals.gather(1, qi)
        seq = torch.cat([torch.stack([keys, vals], 2).reshape(B, 2 * n), torch.full((B, 1), self.SEP),
                         torch.stack([qk, qa], 2).reshape(B, 2 * m)], dim=1)
        table = torch.full((B, self.NUM_KEYS), -1, dtype=torch.long).scatter_(1, keys, vals)
        return seq.to(device), table.to(device)

    def batch(self, batch, generator, device="cpu"):
        """inputs ``[B, L-1]``, targets ``[B, L-1]`` (-100 outside the query section) and the mask of
        answer positions ``[B, L-1]``."""
        seq, _ = self.sample(batch, generator, device)
        inp, tgt = seq[:, :-1], seq[:, 1:].clone()
        tgt[:, :2 * self.n] = -100
        answers = torch.zeros_like(tgt, dtype=torch.bool)
        answers[:, 2 * self.n + 1::2] = True
        return inp, tgt, answers


def train_step(model, opt, task, generator, batch=64, device="cpu"):
    """One optimizer step on a fresh batch; returns (loss, recall accuracy on the batch)."""
    inp, tgt, answers = task.batch(batch, generator, device)
    logits = model(inp)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    acc = (logits.detach().argmax(-1) == tgt)[answers].float().mean()
    return loss.item(), acc.item()


class Progress:
    """A plain-stdout progress bar: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, total, width=30):
        self.total, self.width, self.tty = total, width, sys.stdout.isatty()
        self.next_line = 0.0

    def update(self, frac, text, final=False):
        frac = min(max(frac, 0.0), 1.0)
        bar = "#" * int(round(frac * self.width))
        line = f"   [{bar:<{self.width}s}] {frac * 100:3.0f}% {text}"
        if self.tty:
            print("\r" + line, end="\n" if final else "", flush=True)
        elif final or frac >= self.next_line:
            print(line, flush=True)
            self.next_line = math.floor(frac * 10 + 1) / 10


@contextlib.contextmanager
def _one_cpu_thread(device):
    """On the CPU, runs the block on one thread: the work here is small, and thread fork/join
    stalls (on a machine shared with other jobs) would otherwise dominate the timings."""
    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def make_model(device):
    cfg = LMConfig(vocab_size=RecallTask.VOCAB, hidden_size=64, num_layers=2, num_heads=4, layer_types="linear",
                   feature_map="elu1")
    return CausalLM(cfg).to(device)


def train(device, seconds=60.0, max_steps=None, batch=64, seed=0):
    task = RecallTask()
    torch.manual_seed(seed)
    model = make_model(device)
    nparams = sum(p.numel() for p in model.parameters())
    limit = f"{seconds:.0f} s" if max_steps is None else f"{max_steps} steps"
    print(f"\n2) training a {len(model.blocks)}-layer linear-attention LM ({nparams / 1e3:.0f}k parameters, "
          f"elu1, chunk kernel) on associative recall\n   ({task.n} key-value pairs, then {task.m} queries; "
          f"batch {batch}; {limit} on {device}{', 1 thread' if torch.device(device).type == 'cpu' else ''})")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed + 1)
    with _one_cpu_thread(device):  # the model is tiny
        return _train_loop(model, opt, task, gen, device, seconds, max_steps, batch)


def _train_loop(model, opt, task, gen, device, seconds, max_steps, batch):
    bar, t0, step, loss, acc, avg = Progress(seconds), time.perf_counter(), 0, float("nan"), 0.0, None
    while True:
        elapsed = time.perf_counter() - t0
        done = step >= max_steps if max_steps is not None else elapsed >= seconds
        frac = step / max_steps if max_steps is not None else elapsed / seconds
        if step and (done or step % 10 == 0):
            bar.update(frac, f"{elapsed:5.1f}s step {step:5d} loss {loss:.3f} recall {avg * 100:5.1f}%", final=done)
        if done:
            break
        loss, acc = train_step(model, opt, task, gen, batch, device)
        avg = acc if avg is None else 0.9 * avg + 0.1 * acc
        step += 1
    model.eval()
    with torch.no_grad():
        inp, tgt, answers = task.batch(512, torch.Generator().manual_seed(12345), device)
        held_out = (model(inp).argmax(-1) == tgt)[answers].float().mean().item()
    print(f"   held-out recall accuracy (512 new sequences, full forward): {held_out * 100:.1f}%  "
          f"(chance {100 / task.NUM_VALUES:.0f}%)")
    return model, task


# --------------------------------------------------------------------------------------------------
# 3. generation
# --------------------------------------------------------------------------------------------------
def generate(model, task, device, batch=64, show=3, seed=7):
    print(f"\n3) generation: prefill 'pairs | q1' ({2 * task.n + 2} tokens, chunk kernel), then "
          f"{2 * task.m - 1} decode steps (step kernel), temperature 0.7, top-k 5")
    gen = torch.Generator().manual_seed(seed)
    seq, table = task.sample(batch, gen, device)
    prompt_len = 2 * task.n + 2
    out = model.generate(seq[:, :prompt_len], max_new_tokens=2 * task.m - 1, temperature=0.7, top_k=5,
                         generator=torch.Generator(device=device).manual_seed(seed))
    tail = out[:, prompt_len - 1:]                        # q1 a1 q2 a2 ...: queries at even offsets
    qs, ans = tail[:, 0::2], tail[:, 1::2]
    valid = qs < task.NUM_KEYS
    expect = table.gather(1, qs.clamp(max=task.NUM_KEYS - 1))
    known = valid & (expect >= 0)                          # queries the model asked about present keys
    correct = (ans == expect) & known
    for b in range(min(show, batch)):
        marks = " ".join(f"{task.text(qs[b, i:i + 1])}->{task.text(ans[b, i:i + 1])}"
                         f"{'' if correct[b, i] else '(x)' if known[b, i] else '(?)'}" for i in range(qs.shape[1]))
        print(f"   pairs: {task.text(seq[b, :2 * task.n])}")
        print(f"   generated: {marks}")
    print("   (x): wrong value; (?): the model queried a key that is not in the prompt")
    print(f"   {int(known.sum())} of {qs.numel()} generated queries name a key of the prompt; answers correct: "
          f"{correct.sum().item() / max(int(known.sum()), 1) * 100:.1f}%")


# --------------------------------------------------------------------------------------------------
# 4. decoding cost
# --------------------------------------------------------------------------------------------------
def _fill_kv(layer, cache, slot, x):
    """Writes the keys/values of x [1, L, hidden] into slot's KV cache as a prefill would (without
    the O(L^2) attention a real prefill spends)."""
    pool = cache.layers[0]
    with torch.no_grad():
        for s in range(0, x.shape[1], 4096):
            _, k, v = layer._project(x[:, s:s + 4096])
            pool.k[slot, s:s + k.shape[1]] = k[0]
            pool.v[slot, s:s + v.shape[1]] = v[0]
    pool.lengths[slot] = x.shape[1]


def decode_cost(device, contexts, steps=20, hidden=512, heads=8, head_dim=64, seed=0):
    cpu = torch.device(device).type == "cpu"
    print(f"\n4) decoding cost per token against context length on {device} (one sequence, one layer: "
          f"hidden {hidden}, {heads} heads x {head_dim}, fp32{', 1 thread' if cpu else ''})")
    with _one_cpu_thread(device):
        return _decode_cost(device, contexts, steps, hidden, heads, head_dim, seed)


def _decode_cost(device, contexts, steps, hidden, heads, head_dim, seed):
    torch.manual_seed(seed)
    lin = LinearAttention(hidden, heads, head_dim=head_dim, feature_map="elu1").to(device).eval()
    smx = SoftmaxAttention(hidden, heads, head_dim=head_dim).to(device).eval()
    rows = []
    for L in contexts:
        x = torch.randn(1, L, hidden, device=device)
        xs = torch.randn(1, steps + 3, 1, hidden, device=device)
        row = {"context": L}
        for name, layer in (("linear", lin), ("softmax", smx)):
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            cache = layer.make_cache(1, max_len=L + steps + 3, device=device)
            slot = cache.allocate(1)
            with torch.no_grad():
                if name == "linear":
                    layer(x, cache, slot)                      # a real prefill (chunk kernel)
                else:
                    _fill_kv(layer, cache, slot, x)
                times = []
                for i in range(steps + 3):
                    _sync(device)
                    t0 = time.perf_counter()
                    layer(xs[:, i], cache, slot)
                    _sync(device)
                    if i >= 3:                                 # 3 warm-up steps
                        times.append(time.perf_counter() - t0)
            row[f"{name}_ms"] = statistics.median(times) * 1e3
            # State of one sequence at this context: the linear state is fixed, the KV cache holds
            # exactly the tokens seen (L + the decoded ones) -- per-token bytes times length.
            pool = cache.layers[0]
            if name == "linear":
                row[f"{name}_bytes"] = pool.nbytes_per_slot()
            else:
                per_token = pool.nbytes_per_slot() // pool.max_len
                row[f"{name}_bytes"] = per_token * L
            if device == "cuda":
                row[f"{name}_peak"] = torch.cuda.max_memory_allocated() - base
            del cache
        rows.append(row)
        print(f"   context {L:6d}: linear {row['linear_ms']:7.3f} ms, softmax {row['softmax_ms']:7.3f} ms",
              flush=True)
    return rows


def _mib(b):
    return f"{b / 2**20:10.3f}"


def print_table(rows):
    print(f"\n   {'context':>8s} | {'time per decoded token (ms)':^27s} | {'state per sequence (MiB)':^25s}")
    print(f"   {'':>8s} | {'linear':>8s} {'softmax':>8s} {'ratio':>8s} | {'linear S,z':>12s} {'softmax KV':>12s}")
    for r in rows:
        print(f"   {r['context']:8d} | {r['linear_ms']:8.3f} {r['softmax_ms']:8.3f} "
              f"{r['softmax_ms'] / r['linear_ms']:7.1f}x | {_mib(r['linear_bytes']):>12s} {_mib(r['softmax_bytes']):>12s}")


def plot(rows, path, device):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("   (matplotlib is not installed: no plot, the table above has the numbers)")
        return None
    ctx = [r["context"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((a, "ms", "time per decoded token (ms)"), (b, "bytes", "state per sequence (MiB)")):
        scale = 1 if key == "ms" else 2**-20
        ax.plot(ctx, [r[f"linear_{key}"] * scale for r in rows], "o-", label="linear attention (S, z)")
        ax.plot(ctx, [r[f"softmax_{key}"] * scale for r in rows], "s-", label="softmax attention (KV cache)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"attnrnn: decoding one token, one layer ({device}) - O(1) against O(N)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------
def pick_device(requested=None):
    """``requested``, else CUDA when a GPU is present and attnrnn's CUDA ops run, else the CPU."""
    if requested:
        return requested
    if torch.cuda.is_available():
        try:
            x = torch.ones(1, 2, 1, 8, device="cuda")
            _, st = attnrnn.chunk_linear_attn(x, x, x, output_final_state=True)
            attnrnn.linear_attn_step(x[:, :1], x[:, :1], x[:, :1], st)
            torch.cuda.synchronize()
            return "cuda"
        except (NotImplementedError, RuntimeError) as e:
            print(f"(attnrnn's CUDA ops do not run here ({type(e).__name__}): running on the CPU)")
    return "cpu"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when usable)")
    parser.add_argument("--quick", action="store_true", help="a few seconds: tiny sizes, a few training steps")
    parser.add_argument("--train-seconds", type=float, default=60.0, help="training time (default 60)")
    parser.add_argument("--out", default=os.path.join("build", "demo"),
                        help="folder (or .png path) for the plot (default build/demo)")
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    t0 = time.perf_counter()
    print(f"attnrnn {attnrnn.__version__} demo on {device} (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)\n")
    if args.quick:
        three_forms(device, T=65)
        model, task = train(device, max_steps=4, batch=16)
        generate(model, task, device, batch=4, show=1)
        rows = decode_cost(device, contexts=[64, 256], steps=3, hidden=64, heads=2, head_dim=32)
    else:
        three_forms(device)
        model, task = train(device, seconds=args.train_seconds)
        generate(model, task, device)
        rows = decode_cost(device, contexts=[256, 1024, 4096, 16384, 65536])
    print_table(rows)
    path = args.out if args.out.endswith(".png") else os.path.join(args.out, "decode_cost.png")
    written = plot(rows, path, device)
    if written:
        print(f"\n   plot: {os.path.abspath(written)}")
    print(f"\ndone in {time.perf_counter() - t0:.0f} s")
    return rows


if __name__ == "__main__":
    main()
