"""One training step of fla's LinearAttentionForCausalLM on fla's own kernels and on attnrnn's
(routed by attnrnn.integrations.fla), in one process, on one GPU.

    python -m bench.fla_model_step --out $OUT/fla_model_step.json

Needs flash-linear-attention 0.6 (fla_core and flash_linear_attention) and its transformers.
Model: hidden 1024, 8 layers, 16 heads of dim 64, vocab 32000, fla's defaults otherwise (Hadamard
feature map, no normalizer, fused RMSNorm, swiglu and cross entropy), bf16 weights, AdamW;
one batch of B=4 sequences of T=4096 tokens. With grad enabled fla's layer always calls
chunk_linear_attn, so that is the function timed here.

Per backend:
- step: median time (CUDA events) of forward, backward, optimizer step and zero_grad, after
  warm-up (Triton autotuning); fla and attnrnn are timed in alternating rounds, the reported time
  the median of the rounds' medians; peak CUDA memory of one step.
- op: the chunk_linear_attn the layer calls (fla's, or the routed one with its argument mapping),
  forward + backward alone at the layer's shapes, times the number of layers: its share of the step,
  and the rest of the step (projections, MLP, norms, loss, optimizer) as the difference.
- profile: one step under torch.profiler, CUDA kernel time summed by kernel-name category.
Before timing, the loss of the same batch on the same weights through each backend (a check that
both compute the same model).
"""
import argparse
import json
import re
import statistics
import sys

import torch

from .timing import median_ms

CONFIG = {"hidden_size": 1024, "num_hidden_layers": 8, "vocab_size": 32000}
BACKENDS = ("fla", "attnrnn")
# Kernel-name categories of the profile, first match wins (attnrnn's kernels live in attnrnn::,
# fla's linear-attention Triton kernels are named chunk_* / fused_*).
CATEGORIES = [
    ("linear attention (attnrnn)", r"attnrnn::"),
    ("linear attention (fla)", r"^(chunk_|fused_chunk|fused_recurrent)"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_"),
    ("optimizer", r"multi_tensor_apply|adam"),
    ("cross entropy", r"cross_entropy|logsumexp"),
    ("norm", r"norm"),
    ("swiglu", r"swiglu"),
]


def build(args):
    from fla.models import LinearAttentionConfig, LinearAttentionForCausalLM
    config = LinearAttentionConfig(**{**CONFIG, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
                                      "num_heads": args.hidden // args.head_dim})
    torch.manual_seed(0)
    model = LinearAttentionForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    model.train()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    return config, model, ids


def routing(backend):
    from attnrnn.integrations.fla import use_attnrnn
    return use_attnrnn(backend == "attnrnn")


def step_fn(model, opt, ids):
    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def peak_gib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def op_ms(backend, config, args):
    """chunk_linear_attn as the layer calls it, forward + backward, at the layer's shapes."""
    import fla.layers.linear_attn as layer_module
    H, D = config.num_heads, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(args.batch, args.seq, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(4))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    with routing(backend):
        fn = layer_module.chunk_linear_attn  # what the layer calls under this routing

    def fwd_bwd():
        o, _ = fn(q=leaves[0], k=leaves[1], v=leaves[2], initial_state=None, output_final_state=False,
                  normalize=config.norm_feature_map, cu_seqlens=None)
        torch.autograd.grad(o, leaves, do)

    return median_ms(fwd_bwd, "cuda", warmup=3, repeats=20, min_seconds=0.0)


def profile(step):
    """CUDA kernel time (ms) of one step by category, and the ten largest kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0:
            kernels[e.key] = kernels.get(e.key, 0.0) + e.self_device_time_total / 1e3
    by_category = {name: 0.0 for name, _ in CATEGORIES}
    by_category["other"] = 0.0
    for name, ms in kernels.items():
        category = next((c for c, pattern in CATEGORIES if re.search(pattern, name)), "other")
        by_category[category] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:10]
    return {"kernel_ms_total": sum(kernels.values()), "by_category_ms": by_category,
            "top_kernels_ms": [{"name": n[:160], "ms": ms} for n, ms in top]}


def table(result):
    r = result["backends"]
    fla, ours = r["fla"], r["attnrnn"]
    c = result["config"]
    lines = [f"fla LinearAttentionForCausalLM: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
             f"{c['num_heads']} heads x {c['head_dim']}, B{c['batch']} T{c['seq']}, bf16, AdamW ({result['device']})",
             f"{'':34s}{'fla kernels':>14s}{'attnrnn':>14s}{'fla / attnrnn':>16s}"]

    def row(label, key, fmt="{:14.2f}", ratio=True):
        a, b = fla[key], ours[key]
        tail = f"{a / b:15.2f}x" if ratio and b else ""
        lines.append(f"{label:34s}" + fmt.format(a) + fmt.format(b) + tail)

    row("step (ms)", "step_ms")
    row("peak memory (GiB)", "peak_gib", ratio=False)
    row(f"linear-attn op x{c['num_hidden_layers']} fwd+bwd (ms)", "op_ms_all_layers")
    row("  share of the step", "op_share", fmt="{:14.1%}", ratio=False)
    row("rest of the step (ms)", "rest_ms")
    row("loss on the same weights", "loss", fmt="{:14.4f}", ratio=False)
    if "profile" in fla and "profile" in ours:
        lines.append("CUDA kernel time of one step (ms), by kernel name:")
        for name, ms in fla["profile"]["by_category_ms"].items():
            lines.append(f"  {name:32s}{ms:14.2f}{ours['profile']['by_category_ms'][name]:14.2f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="fla_model_step.json")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3, help="alternating timing rounds per backend")
    ap.add_argument("--repeats", type=int, default=5, help="steps timed per round")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.fla_model_step needs a CUDA device")
    import fla
    import transformers
    import triton

    config, model, ids = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = step_fn(model, opt, ids)
    rows = {b: {} for b in BACKENDS}
    for b in BACKENDS:
        with routing(b):
            rows[b]["loss"] = model(input_ids=ids, labels=ids).loss.item()  # grad on: the training path
    for b in BACKENDS:
        with routing(b):
            for _ in range(3):  # warm-up: Triton autotuning, the optimizer's state, the allocator
                step()
            rows[b]["peak_gib"] = peak_gib(step)
    rounds = {b: [] for b in BACKENDS}
    for _ in range(args.rounds):
        for b in BACKENDS:
            with routing(b):
                rounds[b].append(median_ms(step, "cuda", warmup=1, repeats=args.repeats, min_seconds=0.0))
    for b in BACKENDS:
        row = rows[b]
        row["step_ms"] = statistics.median(rounds[b])
        row["step_ms_rounds"] = rounds[b]
        row["op_ms"] = op_ms(b, config, args)
        row["op_ms_all_layers"] = row["op_ms"] * config.num_hidden_layers
        row["op_share"] = row["op_ms_all_layers"] / row["step_ms"]
        row["rest_ms"] = row["step_ms"] - row["op_ms_all_layers"]
    for b in BACKENDS:
        with routing(b):
            try:
                rows[b]["profile"] = profile(step)
            except Exception as e:  # the timings above stand without it
                rows[b]["profile_error"] = f"{type(e).__name__}: {e}"[:300]
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "fla": fla.__version__, "transformers": transformers.__version__, "dtype": "bfloat16",
        "config": {**CONFIG, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
                   "num_heads": config.num_heads, "head_dim": args.head_dim, "batch": args.batch, "seq": args.seq,
                   "feature_map": config.feature_map, "normalize": config.norm_feature_map},
        "backends": rows,
        "step_speedup": rows["fla"]["step_ms"] / rows["attnrnn"]["step_ms"],
        "loss_abs_diff": abs(rows["fla"]["loss"] - rows["attnrnn"]["loss"]),
    }
    print(table(result))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
