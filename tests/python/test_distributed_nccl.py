"""context_parallel_linear_attn on its NCCL code path with one GPU (world size 1): what a one-GPU
machine can show of the multi-GPU path (test_distributed.py runs 2 and 4 ranks). With one rank the result
must equal the single-process op, forward and backward, for both schemes and both combines.
Skipped without CUDA and NCCL."""
import os

import pytest
import torch
import torch.distributed as dist

import attnrnn
from attnrnn.distributed import context_parallel_linear_attn
from conftest import HAS_CUDA, NCCL_ENV
from numerics import relative_rms

pytestmark = pytest.mark.skipif(not HAS_CUDA or not dist.is_nccl_available(), reason="no CUDA device / NCCL")



@pytest.fixture(scope="module")
def nccl_world():
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    yield dist.group.WORLD
    dist.destroy_process_group()


def _inputs(normalize, dtype, B=2, T=300, H=4, K=64):
    gen = torch.Generator(device="cpu").manual_seed(7)
    make = lambda *s: torch.randn(*s, generator=gen)
    q, k, v = (make(B, T, H, K).sigmoid(), make(B, T, H, K).sigmoid(), make(B, T, H, K))
    q, k, v = (t.to("cuda", dtype).requires_grad_() for t in (q, k, v))
    S0 = (0.1 * make(B, H, K, K)).cuda().requires_grad_()
    z0 = make(B, H, K).abs().cuda().requires_grad_() if normalize else None
    return q, k, v, S0, z0


def _compare(group, dtype, scheme, combine, normalize, tol):
    q, k, v, S0, z0 = _inputs(normalize, dtype)
    leaves = [t for t in (q, k, v, S0, z0) if t is not None]
    o_ref, st_ref = attnrnn.chunk_linear_attn(q, k, v, normalize=normalize, initial_state=(S0, z0),
                                              output_final_state=True)
    grads_ref = torch.autograd.grad((o_ref.float().square().sum() + st_ref.S.sum()), leaves)
    o, st = context_parallel_linear_attn(q, k, v, group=group, normalize=normalize, initial_state=(S0, z0),
                                         output_final_state=True, scheme=scheme, combine=combine)
    grads = torch.autograd.grad((o.float().square().sum() + st.S.sum()), leaves)
    assert relative_rms(o, o_ref) < tol
    assert relative_rms(st.S, st_ref.S) < 1e-6
    for name, g, g_ref in zip("q k v S0 z0".split(), grads, grads_ref):
        assert relative_rms(g, g_ref) < tol, name


@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
@pytest.mark.parametrize("combine", ["initial_state", "local"])
@pytest.mark.parametrize("scheme", ["allgather", "chain"])
def test_cuda_nccl_world_size_1_equals_single_process_fp32(nccl_world, scheme, combine, normalize):
    """One rank is the single-process computation plus an (empty) exchange: fp32 agrees to
    summation order."""
    _compare(nccl_world, torch.float32, scheme, combine, normalize, tol=1e-4)


@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
@pytest.mark.parametrize("scheme", ["allgather", "chain"])
def test_cuda_nccl_world_size_1_bf16_default_combine(nccl_world, scheme, normalize):
    """bf16 with the default combine: results differ from the single-process op by rounding only
    (measured 2.0e-3 to 2.8e-3 relative RMS on the H200; two bf16 unit roundoffs allowed). The
    "local" combine is left to the fp32 test: with normalize its bf16 dq differs by 1.2e-2 (the
    local output is rounded to bf16 before the prefix correction; docs/context_parallel.md)."""
    _compare(nccl_world, torch.bfloat16, scheme, "initial_state", normalize, tol=8e-3)
