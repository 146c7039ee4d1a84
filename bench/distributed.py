"""Context-parallel linear attention: per-rank time and bytes exchanged for each scheme.

CPU (spawns N gloo ranks on this machine, one thread each):
    python bench/distributed.py --world 2 --T 16384 --out bench/results/distributed_cpu.json
GPUs (one process per GPU, NCCL):
    torchrun --nproc-per-node 8 bench/distributed.py --T 1048576 --dtype bfloat16 --out cp_h200.json

Every rank holds T / R tokens of one sequence (B, H, Hkv, K, V as given). For each
(scheme, combine) it times, after warm-up, the median over --reps of the forward and of
forward+backward, with a barrier before each repeat (so a rank's time includes waiting for the
ranks before it: the chain's latency shows on the last rank); the configurations are interleaved
repeat by repeat so that drift of a shared machine hits all alike. Baselines on the same segment:
"local" = chunk_linear_attn on the rank's segment alone (no exchange: the compute floor of one
rank), and "exchange" = the collective alone on one packed state. Bytes are the payload each rank
sends per call (attnrnn.distributed.exchange_bytes, ring algorithms). Writes JSON (one row per
configuration with per-rank times) and prints a table from rank 0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import attnrnn
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    import attnrnn
from attnrnn.distributed import context_parallel_linear_attn, exchange_bytes

# NVLink multicast stays off in every process (the GPU machines' rule).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _key, _value in NCCL_ENV.items():
    os.environ.setdefault(_key, _value)

CONFIGS = [("allgather", "local"), ("allgather", "initial_state"), ("chain", "local"), ("chain", "initial_state")]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_all(fns, device, warmup, reps):
    """Median ms of each callable; the callables are interleaved repeat by repeat (round robin), so
    a drift of the machine (other ranks sharing the cores, caches, clocks) hits all alike."""
    times = [[] for _ in fns]
    for rep in range(warmup + reps):
        for i, fn in enumerate(fns):
            dist.barrier()
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            if rep >= warmup:
                times[i].append(time.perf_counter() - t)
    return [statistics.median(t) * 1e3 for t in times]


def _peak_bytes(fn, leaves, device, resident_io):
    """Peak memory of one call on this rank, counting only the op's own tensors: the caching
    allocator's peak minus what the benchmark holds that is not part of the call's inputs and
    outputs (do for a forward, the exchange-alone buffers). None on CPU."""
    if device.type != "cuda":
        return None
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    held_other = torch.cuda.memory_allocated(device) - resident_io
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - held_other
    for x in leaves:
        x.grad = None
    return peak


def run(args, T_total, rank, world, device):
    dtype = getattr(torch, args.dtype)
    T = T_total // world
    g = torch.Generator(device="cpu").manual_seed(rank)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    leaves = [mk(args.B, T, args.H, args.K), mk(args.B, T, args.Hkv, args.K), mk(args.B, T, args.Hkv, args.V)]
    leaves = [x.requires_grad_() for x in leaves]
    do = mk(args.B, T, args.H, args.V)
    opts = dict(normalize=not args.unnormalized, feature_map=args.feature_map, chunk_size=args.chunk_size)
    # Bytes of one rank's call: a forward reads q, k, v and writes o (do's shape); forward+backward
    # also reads do and writes dq, dk, dv. "resident" = those of them held before the call.
    resident_fwd = sum(x.numel() * x.element_size() for x in leaves)
    io_fwd = resident_fwd_bwd = resident_fwd + do.numel() * do.element_size()
    io_fwd_bwd = 2 * io_fwd

    def forward(call):
        def f():
            with torch.no_grad():
                call(*leaves)
        return f

    def fwd_bwd(call):
        def f():
            for x in leaves:
                x.grad = None
            call(*leaves).backward(do)
        return f

    nb1 = exchange_bytes(args.B, args.Hkv, args.K, args.V, world, normalize=opts["normalize"])
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    P = nb1["state_bytes"] // (8 if sdt == torch.float64 else 4)
    c = torch.randn(P, device=device, dtype=sdt)
    buf = torch.empty(world * P, device=device, dtype=sdt)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    local = lambda a, b, c_: attnrnn.chunk_linear_attn(a, b, c_, **opts)[0]  # noqa: E731
    configs = [("local (no exchange)", None, None, local, None),
               ("all-gather of one state", None, None, None, nb1["forward"])]
    for scheme, combine in CONFIGS:
        for validate in ((False, True) if (scheme, combine) == ("allgather", "initial_state") else (False,)):
            call = lambda a, b, c_, s=scheme, m=combine, val=validate: context_parallel_linear_attn(  # noqa: E731
                a, b, c_, scheme=s, combine=m, validate=val, output_final_state=args.final_state, **opts)[0]
            nb = exchange_bytes(args.B, args.Hkv, args.K, args.V, world, normalize=opts["normalize"],
                                output_final_state=args.final_state, scheme=scheme)
            configs.append((f"{scheme}/{combine}" + (" +validate" if validate else ""), scheme, combine, call,
                            nb["forward"] + nb["backward"]))
    if args.configs:
        unknown = set(args.configs) - {cfg[0] for cfg in configs}
        if unknown:
            raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose from {[cfg[0] for cfg in configs]}")
        configs = [cfg for cfg in configs if cfg[0] in args.configs]
    fns = [forward(cfg[3]) if cfg[3] else (lambda: gather(buf, c)) for cfg in configs]
    fwd = _time_all(fns, device, args.warmup, args.reps)
    fns = [fwd_bwd(cfg[3]) for cfg in configs if cfg[3]]
    fb = iter(_time_all(fns, device, args.warmup, args.reps))
    rows = []
    for cfg, f in zip(configs, fwd):
        b = next(fb) if cfg[3] else None
        mem = (None, None)
        if cfg[3]:
            mem = (_peak_bytes(forward(cfg[3]), leaves, device, resident_fwd),
                   _peak_bytes(fwd_bwd(cfg[3]), leaves, device, resident_fwd_bwd))
        per_rank = [None] * world
        dist.all_gather_object(per_rank, (f, b, *mem))
        rows.append(dict(name=cfg[0], scheme=cfg[1], combine=cfg[2], bytes_per_rank=cfg[4],
                         forward_ms=[p[0] for p in per_rank], fwd_bwd_ms=[p[1] for p in per_rank],
                         forward_peak_bytes=[p[2] for p in per_rank], fwd_bwd_peak_bytes=[p[3] for p in per_rank]))
    return dict(T=T_total, T_per_rank=T, io_bytes_forward=io_fwd, io_bytes_fwd_bwd=io_fwd_bwd, rows=rows)


def _worker(rank, world, port, args, out_q):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    runs = [run(args, T, rank, world, torch.device("cpu")) for T in args.T]
    if rank == 0:
        out_q.put(runs)
    dist.destroy_process_group()


def _report(args, world, runs, device_desc, backend):
    fmt = lambda xs: "/".join("-" if x is None else f"{x:.2f}" for x in xs)  # noqa: E731
    gib = lambda xs: "/".join("-" if x is None else f"{x / 2**30:.2f}" for x in xs)  # noqa: E731
    for run_ in runs:
        T, rows = run_["T"], run_["rows"]
        print(f"# {world} ranks ({backend}, {device_desc}), B={args.B} T={T} (T/rank={run_['T_per_rank']}) "
              f"H={args.H} Hkv={args.Hkv} K={args.K} V={args.V} {args.dtype}, median of {args.reps}, per rank; "
              f"inputs+outputs(+grads) per rank: fwd {run_['io_bytes_forward'] / 2**30:.2f} GiB, "
              f"fwd+bwd {run_['io_bytes_fwd_bwd'] / 2**30:.2f} GiB")
        print(f"| {'configuration':33} | {'forward ms':24} | {'fwd+bwd ms':24} | {'peak GiB fwd':18} "
              f"| {'peak GiB fwd+bwd':18} | bytes/rank |")
        print(f"|{'-' * 35}|{'-' * 26}|{'-' * 26}|{'-' * 20}|{'-' * 20}|-----------:|")
        for r in rows:
            fb = r["fwd_bwd_ms"] if r["fwd_bwd_ms"][0] is not None else [None] * world
            print(f"| {r['name']:33} | {fmt(r['forward_ms']):24} | {fmt(fb):24} | {gib(r['forward_peak_bytes']):18} "
                  f"| {gib(r['fwd_bwd_peak_bytes']):18} | {r['bytes_per_rank'] or '':>10} |")
    if args.out:
        meta = dict(world=world, backend=backend, device=device_desc, torch=torch.__version__,
                    host=platform.node(), args=vars(args), command=" ".join(sys.argv),
                    env={k: os.environ.get(k) for k in NCCL_ENV},
                    peak_bytes="per rank: the allocator's peak during one call minus what the benchmark holds "
                               "besides the call's inputs and outputs (and gradients for fwd+bwd)")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta=meta, runs=runs), indent=1) + "\n")
        print(f"wrote {args.out}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks to spawn (gloo, CPU); ignored under torchrun")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, nargs="+", default=[16384],
                   help="total tokens, split evenly over the ranks (several: one run each, one process group)")
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--Hkv", type=int, default=8)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--V", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--feature-map", default="elu1")
    p.add_argument("--unnormalized", action="store_true")
    p.add_argument("--final-state", action="store_true", help="also return (and differentiate) the final state")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--configs", nargs="+", default=None,
                   help='only these rows, by name (e.g. "local (no exchange)" "allgather/initial_state")')
    p.add_argument("--out", default=None, help="JSON file (written by rank 0)")
    args = p.parse_args()

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            device, backend = torch.device("cuda", local), "nccl"
        else:
            device, backend = torch.device("cpu"), "gloo"
            torch.set_num_threads(args.threads)
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        runs = [run(args, T, rank, world, device) for T in args.T]
        if rank == 0:
            desc = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
            _report(args, world, runs, desc, backend)
        dist.destroy_process_group()
        return

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for pr in procs:
        pr.start()
    runs = q.get()
    for pr in procs:
        pr.join()
    _report(args, args.world, runs, f"CPU, {args.threads} thread(s)/rank, {os.cpu_count()} cores", "gloo")


if __name__ == "__main__":
    main()
