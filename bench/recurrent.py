"""attnrnn's recurrent_linear_attn against fla's fused_recurrent_linear_attn, in one process, bf16.

    python -m bench.recurrent --fla .whl/fla_core-0.6.0-py3-none-any.whl \\
        --out bench/results/recurrent_h100.json

Short sequences (T <= 64, where fla's LinearAttention layer calls fused_recurrent) and long ones, at
H16 with D = 64 and 128, normalize on and off: forward and forward+backward, each as the median of
at least 15 timed calls (3 with --quick; host time included, after one untimed call: Triton autotuning) and as the
GPU's own time (timing.gpu_ms: the call queued behind a sleep kernel, so host gaps do not count).
attnrnn's recurrent form computes in fp32 throughout (its products are not rounded to bf16, as the
tensor-core chunk kernels' are) on the generic kernels at the chunk GenericTiles sets
(csrc/cuda/linear/tiles.h); up to T = 1024 the same kernels at chunks 8, 16 and 32, run through
chunk_linear_attn(chunk_size=C), are timed beside it: the measurement behind that chunk.
"""
import sys

import torch

import attnrnn

from .head_dims import against_fla, measure, write_results

# (B, T, H, D)
SHAPES = [(4, 16, 16, 64), (4, 64, 16, 64), (4, 64, 16, 128), (32, 64, 16, 128), (4, 1024, 16, 128),
          (4, 8192, 16, 128)]
GENERIC_CHUNKS = [8, 16, 32]
GENERIC_CHUNKS_UP_TO_T = 1024


def main(argv=None):
    args, fla, env = against_fla(__doc__, "bench.recurrent", argv)
    rows = []
    for B, T, H, D in SHAPES:
        gen = torch.Generator().manual_seed(0)

        def make():
            return torch.randn(B, T, H, D, generator=gen).to("cuda", torch.bfloat16)

        q, k, v, do = make().sigmoid(), make().sigmoid(), make() * 0.5, make()
        shape = f"B{B}-T{T}-H{H}-D{D}"
        for normalize in (False, True):
            impls = {
                "fla_fused_recurrent": lambda a, b, c: fla["fused_recurrent"](a, b, c, normalize=normalize)[0],
                "attnrnn_recurrent": lambda a, b, c: attnrnn.recurrent_linear_attn(a, b, c, normalize=normalize)[0],
            }
            for C in GENERIC_CHUNKS:
                if C < T <= GENERIC_CHUNKS_UP_TO_T:
                    impls[f"generic_C{C}"] = (lambda C: lambda a, b, c: attnrnn.chunk_linear_attn(
                        a, b, c, normalize=normalize, chunk_size=C)[0])(C)
            for impl, op in impls.items():
                try:
                    times = measure(op, q, k, v, do, gpu_only=True)
                except Exception as e:  # one failing row must not cost the run
                    print(f"  ERROR {shape} {impl}: {type(e).__name__}: {e}"[:400], file=sys.stderr)
                    times = dict(fwd_ms=None, fwd_gpu_ms=None, fwdbwd_ms=None, fwdbwd_gpu_ms=None)
                rows.append(dict(shape=shape, normalize=normalize, impl=impl, **times))
                f = lambda x: "      -" if x is None else f"{x:7.3f}"
                print(f"{shape:18s} {'norm' if normalize else 'unnorm':6s} {impl:20s} fwd {f(times['fwd_ms'])} "
                      f"({f(times['fwd_gpu_ms'])} gpu)  fwd+bwd {f(times['fwdbwd_ms'])} ({f(times['fwdbwd_gpu_ms'])} gpu)",
                      flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
        write_results(args.out, env, rows, partial=True)
    write_results(args.out, env, rows)
    return 1 if any(r["fwd_ms"] is None for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
