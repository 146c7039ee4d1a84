"""Times linear_attn_step (bf16 inputs, fp32 state, normalize off unless --normalize) at several batch
sizes, two ways: one call between CUDA events (what bench/ reports: the op's host overhead
included) and the kernel alone (20 steps captured in a CUDA graph, replayed). Prints % of the state's read + write floor at
the measured copy rate. ATTNRNN_STEP_TILES (read once per process) forces the decode step's value
tiles. --fla also times fla's fused_recurrent_linear_attn (T = 1) both ways.
    PYTHONPATH=.:python python scripts/decode_probe.py --B 1 8 64 256 [--fla .whl/fla_core-0.6.0-py3-none-any.whl]"""
import argparse
import os
import sys

import torch

sys.path.insert(0, "python")
import attnrnn  # noqa: E402


def one_call_and_kernel_ms(step):
    """(median of single calls between events, one step's share of 20 replayed from a CUDA graph).
    Also scripts/call_host.py's measure of a forward call."""
    for _ in range(3):
        step()
    one = event_ms(step, 50)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(20):
                step()
    torch.cuda.synchronize()
    return one, event_ms(graph.replay, 20) / 20


def event_ms(fn, reps):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(reps):
        s.record(); fn(); e.record(); e.synchronize(); t.append(s.elapsed_time(e))
    return sorted(t)[len(t) // 2]


def copy_rate():
    x = torch.empty(1 << 28, device="cuda"); y = torch.empty_like(x)
    return 2 * x.numel() * 4 / (event_ms(lambda: y.copy_(x), 20) * 1e-3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--normalize", action="store_true", help="attnrnn's step with the key sum z (fla: without)")
    ap.add_argument("--fla", default="none", help="also time fla's fused_recurrent_linear_attn: auto, a wheel or a "
                    "site directory (as bench's --fla)")
    args = ap.parse_args()
    bw = copy_rate()
    knobs = {k: os.environ.get(k, "-") for k in ("ATTNRNN_STEP_TILES",)}
    from bench.baselines import load_fla
    fla = load_fla(args.fla)
    fla = None if fla is None else fla["fused_recurrent"]
    for B in args.B:
        q, k, v = (torch.randn(B, args.H, args.D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        S = torch.randn(B, args.H, args.D, args.D, device="cuda") * 0.01
        z = torch.rand(B, args.H, args.D, device="cuda") + 1 if args.normalize else None
        state = attnrnn.LinearAttnState(S.clone(), z)
        impls = {"attnrnn": lambda: attnrnn.linear_attn_step(q, k, v, state, normalize=args.normalize, scale=1.0)}
        if fla is not None:
            q4, k4, v4 = (t.unsqueeze(1) for t in (q, k, v))
            impls["fla_fused_recurrent"] = lambda: fla(q4, k4, v4, initial_state=S, output_final_state=True)[0]
        floor = 8 * B * args.H * args.D * args.D / bw * 1e3
        for name, step in impls.items():
            with torch.no_grad():
                one, kernel = one_call_and_kernel_ms(step)
            mode = "norm " if args.normalize and name == "attnrnn" else ""
            print(f"{knobs} {name:20s} {mode}B{B}-H{args.H}-D{args.D}: one call {one * 1e3:7.1f} us "
                  f"({100 * floor / one:4.1f}% floor)  kernel {kernel * 1e3:7.1f} us ({100 * floor / kernel:4.1f}% floor)"
                  f"  floor {floor * 1e3:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
