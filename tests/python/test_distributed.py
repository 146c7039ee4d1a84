"""Context parallelism (attnrnn.distributed) against the single-process op: over gloo on CPU
(2 and 4 ranks) and over NCCL with one GPU per rank (2 and 4 ranks, where the machine has them;
CUDA tensors, the CUDA kernels on both sides).

One group of N spawned ranks per (backend, world size) runs every case in turn; each case is then
reported as its own test. Every rank builds the same full inputs from a seed, computes the
single-process chunk_linear_attn on the concatenated sequence (the reference), runs
context_parallel_linear_attn on its own segment, and compares its output, the final state and
every gradient (q, k, v of its segment; initial S and z on rank 0). The global loss is the sum of
per-rank losses, each with its own weights on o and on the (replicated) final state.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import tempfile
import traceback

import pytest
import torch
import torch.nn.functional as F

import attnrnn
from attnrnn.distributed import context_parallel_linear_attn
from conftest import NCCL_ENV

TIMEOUT_S = 120  # a hung collective fails the test instead of blocking the suite
SHORT_TIMEOUT_S = 5  # the group of a case in which one rank fails: a rank left waiting fails in seconds
DEVICE = torch.device("cpu")  # a rank's device, set by _worker in each spawned process

LENS = {  # per world size: tokens per rank (concatenated in rank order)
    "uneven": {2: [29, 0], 4: [5, 0, 31, 12]},
    "first_empty": {2: [0, 33], 4: [0, 9, 0, 20]},
    "even": {2: [24, 24], 4: [12, 12, 12, 12]},
    "short": {2: [1, 40], 4: [1, 1, 17, 3]},
    "long": {2: [300, 211], 4: [130, 0, 250, 131]},  # several chunks per rank
}


def softplus_map(x):
    return F.softplus(x)


def failing_map(x):
    raise RuntimeError("this feature map fails on purpose")


def _case(dtype=torch.float64, lens="uneven", normalize=True, feature_map="elu1", scheme="allgather",
          combine="local", init=True, final=True, H=4, Hkv=2, K=16, V=12, B=2, chunk_size=None,
          positive=False, grad=True, validate=True):
    return dict(dtype=dtype, lens=lens, normalize=normalize, feature_map=feature_map, scheme=scheme,
                combine=combine, init=init, final=final, H=H, Hkv=Hkv, K=K, V=V, B=B,
                chunk_size=chunk_size, positive=positive, grad=grad, validate=validate)


CASES = {
    "f64-norm-elu1-allgather-local": _case(),
    "f64-norm-elu1-chain-local": _case(scheme="chain"),
    "f64-norm-elu1-allgather-initial_state": _case(combine="initial_state"),
    "f64-norm-elu1-chain-initial_state": _case(scheme="chain", combine="initial_state"),
    "f64-unnorm-identity-allgather": _case(normalize=False, feature_map=None),
    "f64-unnorm-identity-chain-initial_state": _case(normalize=False, feature_map=None, scheme="chain",
                                                     combine="initial_state", lens="first_empty"),
    "f64-norm-callable-first_empty": _case(feature_map=softplus_map, lens="first_empty", init=False),
    "f64-norm-relu-nofinal-chain": _case(feature_map="relu", final=False, scheme="chain", lens="short"),
    "f64-norm-identity-positive-mha-chunk16": _case(feature_map=None, positive=True, H=3, Hkv=3, K=20, V=8,
                                                    lens="even", chunk_size=16),
    "f64-mqa-noinit-nofinal": _case(H=4, Hkv=1, init=False, final=False, lens="short", validate=False),
    "f64-forward-only": _case(grad=False, scheme="chain"),
    "f32-norm-elu1-allgather-local": _case(dtype=torch.float32),
    "f32-norm-elu1-chain-initial_state": _case(dtype=torch.float32, scheme="chain", combine="initial_state"),
    "f32-unnorm-relu-allgather": _case(dtype=torch.float32, normalize=False, feature_map="relu", lens="even"),
    # the training precision at head dims with tensor-core kernels on the GPU
    "bf16-norm-elu1-allgather-initial_state-K64": _case(dtype=torch.bfloat16, combine="initial_state", lens="long",
                                                        H=4, Hkv=2, K=64, V=64),
    "bf16-unnorm-chain-initial_state-K128": _case(dtype=torch.bfloat16, normalize=False, scheme="chain",
                                                  combine="initial_state", lens="long", H=2, Hkv=2, K=128, V=128,
                                                  B=1),
}

ERROR_CASES = ("mismatched_B", "mismatched_K", "mismatched_dtype", "local_dtype_mix",
               "initial_state_on_rank1", "initial_state_dtype", "bad_scheme", "mismatched_normalize",
               "bad_heads", "group_not_member", "scale_default_vs_explicit", "scale_explicit_mismatch",
               "feature_map_raises_on_rank1")  # last: where a rank still waited, the next case would not line up


# ---- what every rank runs ----------------------------------------------------------------------------

def _inputs(c, world):
    lens = LENS[c["lens"]][world]
    T = sum(lens)
    g = torch.Generator().manual_seed(1234)
    B, H, Hkv, K, V, dt = c["B"], c["H"], c["Hkv"], c["K"], c["V"], c["dtype"]
    rnd = (lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)) if c["positive"] else \
        (lambda *s: torch.randn(*s, generator=g, dtype=torch.float64))
    q, k, v = rnd(B, T, H, K).to(dt), rnd(B, T, Hkv, K).to(dt), torch.randn(B, T, Hkv, V, generator=g).to(dt)
    sdt = torch.float64 if dt == torch.float64 else torch.float32
    S0 = torch.randn(B, Hkv, K, V, generator=g, dtype=torch.float64).to(sdt)
    z0 = (torch.rand(B, Hkv, K, generator=g, dtype=torch.float64) + 0.5).to(sdt)
    W = torch.randn(B, T, H, V, generator=g, dtype=torch.float64).to(dt)
    gS = torch.randn(world, B, Hkv, K, V, generator=g, dtype=torch.float64).to(sdt)
    gz = torch.randn(world, B, Hkv, K, generator=g, dtype=torch.float64).to(sdt)
    return (lens, *(x.to(DEVICE) for x in (q, k, v, S0, z0, W, gS, gz)))


def _compare(name, x, ref, dtype, failures, whole=None):
    """Relative error of this rank's piece, against the scale of the whole tensor (`whole`, the
    reference over all ranks): a 1-token segment at the start of a normalized sequence has
    gradients that are a cancellation (o_0 = v_0 up to eps), tiny next to the rest."""
    if x is None or ref is None:
        if (x is None) != (ref is None):
            failures.append(f"{name}: got {x is None and 'None' or 'a tensor'}, expected the other")
        return
    if tuple(x.shape) != tuple(ref.shape):
        failures.append(f"{name}: shape {list(x.shape)} != {list(ref.shape)}")
        return
    if ref.numel() == 0:
        return
    x, ref = x.detach().double(), ref.detach().double()
    whole = ref if whole is None else whole.detach().double()
    if not torch.isfinite(x).all():
        failures.append(f"{name}: not finite")
        return
    if dtype == torch.float64:
        err = ((x - ref).abs().max() / whole.abs().max().clamp_min(1e-300)).item()
        tol = 1e-10
    else:  # relative RMS, scaled to the whole tensor's RMS
        rms = whole.norm() / max(whole.numel(), 1) ** 0.5
        err = ((x - ref).norm() / max(ref.numel(), 1) ** 0.5 / rms.clamp_min(1e-300)).item()
        # fp32: summation order only. bf16: both sides keep an fp32 state and round o and the
        # gradients to bf16 once, at different points: two bf16 unit roundoffs.
        tol = 1e-5 if dtype == torch.float32 else 2 * 2.0 ** -8
    if not err <= tol:
        failures.append(f"{name}: relative error {err:.3e} > {tol:.0e}")


def _run_case(c, rank, world):
    lens, q, k, v, S0, z0, W, gS, gz = _inputs(c, world)
    norm, fm, init, final = c["normalize"], c["feature_map"], c["init"], c["final"]
    opts = dict(normalize=norm, feature_map=fm, chunk_size=c["chunk_size"])
    state = None
    # reference: the whole sequence in one process
    leaves = [x.clone().requires_grad_(c["grad"]) for x in (q, k, v, S0, z0)]
    ql, kl, vl, Sl, zl = leaves
    if init:
        state = (Sl, zl if norm else None)
    o_ref, fin_ref = attnrnn.chunk_linear_attn(ql, kl, vl, initial_state=state, output_final_state=True, **opts)
    if c["grad"]:
        loss = (o_ref * W).sum()
        if final:
            loss = loss + (fin_ref.S * gS.sum(0)).sum() + ((fin_ref.z * gz.sum(0)).sum() if norm else 0)
        loss.backward()
    # this rank's segment
    a = sum(lens[:rank])
    b = a + lens[rank]
    seg = [x[:, a:b].clone().requires_grad_(c["grad"]) for x in (q, k, v)]
    Sd, zd = S0.clone().requires_grad_(c["grad"]), z0.clone().requires_grad_(c["grad"])
    state = (Sd, zd if norm else None) if (init and rank == 0) else None
    with torch.set_grad_enabled(c["grad"]):
        o, fin = context_parallel_linear_attn(*seg, initial_state=state, output_final_state=final,
                                              scheme=c["scheme"], combine=c["combine"], validate=c["validate"],
                                              **opts)
    failures = []
    _compare("o", o, o_ref[:, a:b], c["dtype"], failures, o_ref)
    if final:
        _compare("final S", fin.S, fin_ref.S, c["dtype"], failures)
        _compare("final z", fin.z, fin_ref.z, c["dtype"], failures)
    elif fin is not None:
        failures.append("final state returned without output_final_state")
    if c["grad"]:
        loss = (o * W[:, a:b]).sum()
        if final:
            loss = loss + (fin.S * gS[rank]).sum() + ((fin.z * gz[rank]).sum() if norm else 0)
        loss.backward()
        for name, x, ref in zip("qkv", seg, leaves[:3]):
            _compare(f"d{name}", x.grad, ref.grad[:, a:b], c["dtype"], failures, ref.grad)
        if init and rank == 0:
            _compare("d initial S", Sd.grad, Sl.grad, c["dtype"], failures)
            if norm:
                _compare("d initial z", zd.grad, zl.grad, c["dtype"], failures)
    return failures


def _run_error_case(name, rank, world):
    """Returns (exception type name, message) of what this rank raised, or (None, '')."""
    B, T, H, Hkv, K, V = 2, 5, 2, 1, 8, 4
    dt = torch.float32
    kw = {}
    if name == "mismatched_B" and rank == 1:
        B = 3
    if name == "mismatched_K" and rank == world - 1:
        K = 6
    if name == "mismatched_dtype" and rank == 1:
        dt = torch.float64
    if name == "bad_heads" and rank == world - 1:
        H, Hkv = 3, 2
    if name == "bad_scheme":
        kw["scheme"] = "ring"
    if name == "mismatched_normalize" and rank == 0:
        kw["normalize"] = False
    if name == "scale_default_vs_explicit" and rank != 0:  # None on rank 0 is the same K ** -0.5
        kw["scale"] = K ** -0.5
    if name == "scale_explicit_mismatch":  # -1.0 (once taken for "default") against None
        kw["scale"] = -1.0 if rank == 0 else None
    if name == "feature_map_raises_on_rank1":
        kw["group"] = torch.distributed.new_group(list(range(world)),
                                                  timeout=datetime.timedelta(seconds=SHORT_TIMEOUT_S))
        kw["feature_map"] = failing_map if rank == 1 else softplus_map
    rnd = lambda *s, dtype=dt: torch.randn(*s, dtype=dtype, device=DEVICE)  # noqa: E731
    zeros = lambda *s, dtype=torch.float32: torch.zeros(*s, dtype=dtype, device=DEVICE)  # noqa: E731
    q, k, v = rnd(B, T, H, K), rnd(B, T, Hkv, K), rnd(B, T, Hkv, V)
    if name == "local_dtype_mix" and rank == 0:
        k = k.double()
    if name == "initial_state_on_rank1" and rank == 1:
        kw["initial_state"] = (zeros(B, Hkv, K, V), zeros(B, Hkv, K))
    if name == "initial_state_dtype" and rank == 0:
        kw["initial_state"] = (zeros(B, Hkv, K, V, dtype=torch.float64), zeros(B, Hkv, K))
    if name == "group_not_member":
        sub = torch.distributed.new_group([0])  # collective over the whole world
        kw["group"] = sub
        if rank == 0:  # a group of one rank: must equal the single-process op
            o, fin = context_parallel_linear_attn(q, k, v, output_final_state=True, **kw)
            o_ref, fin_ref = attnrnn.chunk_linear_attn(q, k, v, output_final_state=True)
            ok = torch.allclose(o, o_ref, rtol=1e-5, atol=1e-6) and torch.allclose(fin.S, fin_ref.S, rtol=1e-5, atol=1e-5)
            return (None, "" if ok else "world size 1 group differs from chunk_linear_attn")
    try:
        context_parallel_linear_attn(q, k, v, **kw)
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e))
    return (None, "")


def _worker(rank, world, backend, init_file, out_path):
    global DEVICE
    results = {}
    try:
        torch.set_num_threads(1)
        kw = {}
        if backend == "nccl":
            DEVICE = torch.device("cuda", rank)
            torch.cuda.set_device(DEVICE)
            kw["device_id"] = DEVICE
        torch.distributed.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                             world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S), **kw)
        for name, c in CASES.items():
            try:
                results[name] = _run_case(c, rank, world)
            except Exception:  # noqa: BLE001
                results[name] = [traceback.format_exc()]
        for name in ERROR_CASES:
            try:
                results["error:" + name] = _run_error_case(name, rank, world)
            except Exception:  # noqa: BLE001
                results["error:" + name] = ("crash", traceback.format_exc())
        torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001
        results["__worker__"] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(results, f)


def _group(backend, world):
    if backend == "gloo":
        return pytest.param(("gloo", world), id=f"gloo-world{world}")
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= world and torch.distributed.is_nccl_available()
    return pytest.param(("nccl", world), id=f"nccl-cuda-world{world}",
                        marks=pytest.mark.skipif(not enough, reason=f"needs {world} CUDA devices and NCCL"))


@pytest.fixture(scope="module", params=[_group(b, w) for b in ("gloo", "nccl") for w in (2, 4)])
def group_results(request):
    """Spawns one group of `world` ranks (gloo on CPU, or NCCL with one GPU per rank) that runs
    every case; returns per-rank results."""
    backend, world = request.param
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        # A file store in the private temp dir: no free-port race (bind, close, another process takes it).
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world, backend, init_file, paths[r])) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT_S * 3)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for r, path in enumerate(paths):
            if not os.path.exists(path):
                pytest.fail(f"rank {r} of {world} wrote no results (exit code {procs[r].exitcode})")
            with open(path) as f:
                results.append(json.load(f))
    for r, res in enumerate(results):
        if "__worker__" in res:
            pytest.fail(f"rank {r} of {world} failed to run: {res['__worker__']}")
    return world, results


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(group_results, case):
    world, results = group_results
    failures = [f"rank {r}: {msg}" for r, res in enumerate(results) for msg in res[case]]
    assert not failures, f"{case} on {world} ranks:\n" + "\n".join(failures)


# what each rank must raise: (exception type, substring), the first entry for the ranks at fault
def _expected_error(name, rank, world):
    other = ("ValueError", "invalid arguments on rank")
    return {
        "mismatched_B": ("ValueError", "q: the batch size B must be the same on every rank"),
        "mismatched_K": ("ValueError", "q: the head dim K must be the same on every rank"),
        "mismatched_dtype": ("ValueError", "q: the dtype must be the same on every rank"),
        "local_dtype_mix": ("ValueError", "q, k, v must have one dtype") if rank == 0 else other,
        "initial_state_on_rank1": ("ValueError", "it must be None on rank 1") if rank == 1 else other,
        "initial_state_dtype": ("ValueError", "initial_state.S must be torch.float32") if rank == 0 else other,
        "bad_scheme": ("ValueError", "scheme must be one of"),
        "mismatched_normalize": ("ValueError", "normalize: the value must be the same on every rank"),
        "bad_heads": ("ValueError", "must be equal and divide q's heads") if rank == world - 1 else other,
        "group_not_member": (None, "") if rank == 0 else ("ValueError", "group: this process"),
        "scale_default_vs_explicit": (None, ""),
        "scale_explicit_mismatch": ("ValueError", "scale: the value must be the same on every rank"),
        "feature_map_raises_on_rank1": ("RuntimeError", "this feature map fails on purpose") if rank == 1 else
        ("ValueError", "feature_map raised on rank(s) [1] of the group"),
    }[name]


@pytest.mark.parametrize("name", ERROR_CASES)
def test_bad_inputs_raise_on_every_rank(group_results, name):
    world, results = group_results
    for r, res in enumerate(results):
        got_type, got_msg = res["error:" + name]
        want_type, want_msg = _expected_error(name, r, world)
        assert got_type == want_type and want_msg in got_msg, (
            f"rank {r} of {world}: expected {want_type} containing {want_msg!r}, got {got_type}: {got_msg}")


def test_requires_initialized_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_linear_attn(q, q, q)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "unnorm"])
@pytest.mark.parametrize("feature_map", ["elu1", "relu", "identity"])
def test_half_segment_state_matches_float64(monkeypatch, feature_map, normalize):
    """The bf16 segment state of the NCCL path (tensor-core products with fp32 output, hi/lo state
    gradient), run on the CPU with its one CUDA-only product emulated in float64: forward and
    gradients within two bf16 roundings of the float64 formulas."""
    from attnrnn import distributed as D
    monkeypatch.setattr(D, "_bmm_fp32", lambda a, b: torch.bmm(a.double(), b.double()).float())
    g = torch.Generator().manual_seed(5)
    B, T, Hkv, K, V = 2, 45, 3, 16, 12
    k = torch.randn(B, T, Hkv, K, generator=g).bfloat16().requires_grad_()
    v = torch.randn(B, T, Hkv, V, generator=g).bfloat16().requires_grad_()
    S, z = D._HalfSegmentState.apply(k, v, feature_map, normalize)
    gS = torch.randn(S.shape, generator=g)
    loss = (S * gS).sum()
    if normalize:
        gz = torch.randn(z.shape, generator=g)
        loss = loss + (z * gz).sum()
    loss.backward()

    k64, v64 = (x.detach().double().requires_grad_() for x in (k, v))
    kf = D.apply_feature_map(k64, feature_map)
    S64, z64 = torch.einsum("btjk,btjv->bjkv", kf, v64), kf.sum(1)
    loss64 = (S64 * gS.double()).sum() + ((z64 * gz.double()).sum() if normalize else 0)
    loss64.backward()
    rel = lambda x, ref: ((x.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    tol = 2 * 2.0 ** -8
    assert S.dtype == torch.float32 and rel(S, S64) < tol
    if normalize:
        assert rel(z, z64) < tol
    assert rel(k.grad, k64.grad) < tol, "dk"
    assert rel(v.grad, v64.grad) < tol, "dv"
