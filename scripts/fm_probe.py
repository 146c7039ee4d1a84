"""Times chunk_linear_attn (bf16, B=1, H=16, D=128) by feature map, normalize, input
distribution and T, to find what makes the context-parallel benchmark's local segment slow.
    python scripts/fm_probe.py"""
import sys
import torch
sys.path.insert(0, "python")
import attnrnn


def ms(fn, reps=10):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(reps):
        s.record(); fn(); e.record(); torch.cuda.synchronize(); t.append(s.elapsed_time(e))
    return sorted(t)[len(t) // 2]


for T in (65536,):
    for dist_ in ("randn", "sigmoid"):
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda: torch.randn(1, T, 16, 128, device="cuda", generator=g, dtype=torch.bfloat16)
        q, k, v, do = mk(), mk(), mk(), mk()
        if dist_ == "sigmoid":
            q, k = q.sigmoid(), k.sigmoid()
        leaves = [x.requires_grad_() for x in (q, k, v)]
        for fm in (None, "elu1", "relu"):
            for norm in (False, True):
                f = lambda: attnrnn.chunk_linear_attn(*leaves, normalize=norm, feature_map=fm)[0]
                def fb():
                    for x in leaves:
                        x.grad = None
                    f().backward(do)
                with torch.no_grad():
                    tf = ms(f)
                print(f"T={T:7d} {dist_:7s} fm={str(fm):5s} norm={int(norm)} fwd {tf:8.3f} ms  fwd+bwd {ms(fb):8.3f} ms", flush=True)
