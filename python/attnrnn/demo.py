"""attnrnn demo: causal linear attention is an RNN.

1. The three forms - parallel (float64 reference), recurrent (token by token) and chunkwise - give
   the same outputs, final state and gradients.
2. Decoding with the state (S, z) costs constant memory per sequence, while softmax attention's KV
   cache grows with every token; decoding step by step reproduces the full forward.

Run: python -m attnrnn.demo  (uses CUDA when attnrnn has CUDA kernels and a GPU is present)
"""
import argparse
import time

import torch

import attnrnn
from attnrnn import reference


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def three_forms(device, B=2, T=777, H=4, Hkv=2, K=64, V=48):
    print(f"1) three forms on {device}: B={B} T={T} H={H} Hkv={Hkv} K={K} V={V}, fp32 inputs, elu1, normalize")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, Hkv, K, generator=gen)
    v = torch.randn(B, T, Hkv, V, generator=gen)
    do = torch.randn(B, T, H, V, generator=gen)
    opts = dict(feature_map="elu1", normalize=True, output_final_state=True)

    def run(fn, dtype, dev, **extra):
        ins = [t.to(device=dev, dtype=dtype).requires_grad_() for t in (q, k, v)]
        t0 = time.perf_counter()
        o, state = fn(*ins, **opts, **extra)
        o.backward(do.to(device=dev, dtype=dtype))
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


def decode(device, B=4, H=8, K=64, V=64, prefill=256, steps=768):
    print(f"\n2) decoding on {device}: B={B} H={H} K=V={K}, prefill {prefill} tokens, then {steps} steps")
    gen = torch.Generator().manual_seed(1)
    T = prefill + steps
    q, k, v = (torch.randn(B, T, H, d, generator=gen).to(device) for d in (K, K, V))
    opts = dict(feature_map="elu1", normalize=True)
    with torch.no_grad():
        full, _ = attnrnn.chunk_linear_attn(q, k, v, **opts)
        o, state = attnrnn.chunk_linear_attn(q[:, :prefill], k[:, :prefill], v[:, :prefill], output_final_state=True,
                                             **opts)
        outs = [o]
        kv_cache_elems = 2 * B * prefill * H * K  # a softmax layer would keep every key and value
        state_bytes = state.S.numel() * state.S.element_size() + state.z.numel() * state.z.element_size()
        print(f"   {'tokens seen':>11s} {'linear state (S, z)':>20s} {'softmax KV cache (fp32)':>24s}")
        for t in range(prefill, T):
            outs.append(attnrnn.linear_attn_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], state, **opts))
            kv_cache_elems += 2 * B * H * K
            if (t + 1) % 256 == 0:
                print(f"   {t + 1:11d} {state_bytes / 2**20:17.2f} MiB {kv_cache_elems * 4 / 2**20:21.2f} MiB")
        stepped = torch.cat(outs, dim=1)
    print(f"   prefill + {steps} decode steps vs one chunked call: rel err {_rel(stepped, full):.2e}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when usable)")
    args = parser.parse_args(argv)
    device = args.device or "cpu"
    if args.device is None and torch.cuda.is_available():
        try:
            attnrnn.chunk_linear_attn(*(torch.ones(1, 1, 1, 1, device="cuda") for _ in range(3)))
            device = "cuda"
        except NotImplementedError:
            print("(this build has no CUDA kernels yet: running on the CPU)")
    three_forms(device)
    decode(device)


if __name__ == "__main__":
    main()
