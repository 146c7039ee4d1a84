"""Host time of one forward call taken apart, without the profiler: the public function, the
operator called directly (packet and overload), and plain PyTorch calls of one allocation or one
kernel for comparison; at a tiny shape (the GPU never holds the host back) and at training shapes
(a sleep kernel keeps the GPU busy, so no launch waits).

    PYTHONPATH=.:python:scripts python scripts/host_paths.py
"""

import torch

import attnrnn
from attnrnn._ops import ops
from bench.timing import host_us
from kernel_times import shape_name


def main():
    torch.set_grad_enabled(False)
    for shape in [(1, 64, 1, 64), (8, 4096, 32, 64), (1, 65536, 16, 128)]:
        q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16).sigmoid() for _ in range(3))
        busy = shape[1] > 64
        for normalize in (False, True):
            s = shape[-1] ** -0.5
            rows = {
                "public chunk_linear_attn": lambda: attnrnn.chunk_linear_attn(q, k, v, normalize=normalize),
                "ops.chunk_fwd (packet)": lambda: ops.chunk_fwd(q, k, v, None, None, None, s, 1e-6, "identity",
                                                                 normalize, False, 0),
                "ops.chunk_fwd.default": lambda: ops.chunk_fwd.default(q, k, v, None, None, None, s, 1e-6,
                                                                       "identity", normalize, False, 0),
            }
            if hasattr(attnrnn._C, "chunk_fwd"):  # the typed eager call (trees from the twentieth session on)
                rows["_C.chunk_fwd (typed)"] = lambda: attnrnn._C.chunk_fwd(q, k, v, None, None, None, s, 1e-6,
                                                                            "identity", normalize, False, 0, False)
            for name, fn in rows.items():
                print(f"{shape_name(*shape)} norm={int(normalize)} {name:28s} "
                      f"{host_us(fn, calls=300, batch=20, busy=busy):6.1f} us", flush=True)
    x = torch.zeros(64, device="cuda")
    for name, fn in {"torch.empty(0)": lambda: torch.empty(0, device="cuda"),
                     "torch.empty(1 MiB)": lambda: torch.empty(1 << 18, device="cuda"),
                     "x.add_(1) (one kernel)": lambda: x.add_(1),
                     "torch.ops.aten.add_.Scalar": lambda: torch.ops.aten.add_.Scalar(x, 1)}.items():
        print(f"{name:40s} {host_us(fn, calls=300, batch=20):6.1f} us", flush=True)
    qd, kd, vd = (torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    S = torch.zeros(64, 32, 128, 128, device="cuda")
    st = attnrnn.LinearAttnState(S)
    step_rows = {"public linear_attn_step B64": lambda: attnrnn.linear_attn_step(qd, kd, vd, st, normalize=False, scale=1.0),
                 "ops.step.default B64": lambda: ops.step.default(qd, kd, vd, S, None, None, 1.0, 1e-6, "identity", False)}
    if hasattr(attnrnn._C, "step"):
        step_rows["_C.step (typed) B64"] = lambda: attnrnn._C.step(qd, kd, vd, S, None, None, 1.0, 1e-6, "identity", False)
    for name, fn in step_rows.items():
        print(f"{name:40s} {host_us(fn, calls=300, batch=20, busy=True):6.1f} us", flush=True)


if __name__ == "__main__":
    main()
