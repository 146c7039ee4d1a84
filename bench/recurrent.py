"""attnrnn's recurrent_linear_attn against fla's fused_recurrent_linear_attn, in one process, bf16.

    python -m bench.recurrent --fla .whl/fla_core-0.6.0-py3-none-any.whl \\
        --out bench/results/recurrent_h100.json

Short sequences (T <= 64, where fla's LinearAttention layer calls fused_recurrent) and long ones, at
H16 with D = 64 and 128, normalize on and off: forward and forward+backward medians of both, after
one untimed call each (Triton autotuning), with attnrnn's chunk_linear_attn and fla's chunk beside
them for scale. attnrnn's recurrent form computes in fp32 throughout (its products are not rounded to
bf16, as the tensor-core chunk kernels' are).
"""
import sys

import torch

import attnrnn

from .head_dims import against_fla, measure, write_results

# (B, T, H, D)
SHAPES = [(4, 16, 16, 64), (4, 64, 16, 64), (4, 64, 16, 128), (32, 64, 16, 128), (4, 1024, 16, 128),
          (4, 8192, 16, 128)]


def main(argv=None):
    args, fla, env = against_fla(__doc__, "bench.recurrent", argv)
    out = args.out
    rows = []
    for B, T, H, D in SHAPES:
        gen = torch.Generator().manual_seed(0)

        def make():
            return torch.randn(B, T, H, D, generator=gen).to("cuda", torch.bfloat16)

        q, k, v, do = make().sigmoid(), make().sigmoid(), make() * 0.5, make()
        for normalize in (False, True):
            impls = {
                "attnrnn_recurrent": lambda a, b, c: attnrnn.recurrent_linear_attn(a, b, c, normalize=normalize)[0],
                "fla_fused_recurrent": lambda a, b, c: fla["fused_recurrent"](a, b, c, normalize=normalize)[0],
                "attnrnn_chunk": lambda a, b, c: attnrnn.chunk_linear_attn(a, b, c, normalize=normalize)[0],
                "fla_chunk": lambda a, b, c: fla["chunk"](a, b, c, normalize=normalize)[0],
            }
            for impl, op in impls.items():
                try:
                    fwd, fwdbwd = measure(op, q, k, v, do)
                except Exception as e:  # one failing row must not cost the run
                    print(f"  ERROR B{B}-T{T}-H{H}-D{D} {impl}: {type(e).__name__}: {e}"[:400], file=sys.stderr)
                    fwd = fwdbwd = None
                rows.append(dict(shape=f"B{B}-T{T}-H{H}-D{D}", normalize=normalize, impl=impl, fwd_ms=fwd,
                                 fwdbwd_ms=fwdbwd))
                f = lambda x: "       -" if x is None else f"{x:8.3f}"
                print(f"B{B}-T{T}-H{H}-D{D:<4d} {'norm' if normalize else 'unnorm':6s} {impl:20s} fwd {f(fwd)} ms"
                      f"  fwd+bwd {f(fwdbwd)} ms", flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
        write_results(out, env, rows, partial=True)
    write_results(out, env, rows)
    return 1 if any(r["fwd_ms"] is None for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
