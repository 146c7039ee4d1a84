"""Shared fixtures: the attnrnn package (compiled ops), the pure-PyTorch reference, devices.

The reference (python/attnrnn/reference.py) imports only torch; it is loaded from its file when
the package itself cannot be imported (extension not built), so the reference tests always run.
Tests that need the compiled ops take the ``ar`` fixture, which fails (never skips) when the
extension is missing.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYDIR = ROOT / "python"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # numerics, cases

_IMPORT_ERROR = None
try:
    import attnrnn  # noqa: F401  (installed, or built in place)
except ImportError:
    sys.path.insert(0, str(PYDIR))
    sys.modules.pop("attnrnn", None)
    try:
        import attnrnn  # noqa: F401
    except Exception as e:  # noqa: BLE001  (reported by the `ar` fixture)
        _IMPORT_ERROR = e
        sys.modules.pop("attnrnn", None)


def load_reference():
    if _IMPORT_ERROR is None:
        import attnrnn.reference as ref
        return ref
    # The reference and its argument helpers from their files, in a package of their own that does
    # not run attnrnn/__init__.py (which needs the extension).
    package = types.ModuleType("attnrnn_reference")
    package.__path__ = [str(PYDIR / "attnrnn")]
    sys.modules["attnrnn_reference"] = package
    spec = importlib.util.spec_from_file_location("attnrnn_reference.reference", PYDIR / "attnrnn" / "reference.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


REF = load_reference()

HAS_CUDA = torch.cuda.is_available()
# NVLink multicast stays off in every process that uses NCCL (the GPU machines' rule: it can take
# a shared host's GPUs out of service); spawned ranks inherit it.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.requires_cuda),
]


# A test that needs a CUDA device carries `pytest.mark.requires_cuda` (reason= optional): skipped
# without one, and selected by `-k cuda`, the GPU suite's selection (scripts/gpu_suite.sh), whatever
# its name, since -k matches marker names too. Without a GPU, collection fails for a test skipped
# for CUDA's sake some other way that `-k cuda` would leave out, so that no CUDA test goes unrun.
def pytest_configure(config):
    config.addinivalue_line("markers", "requires_cuda(reason): skipped without a CUDA device; selected by -k cuda")


@pytest.hookimpl(tryfirst=True)  # before -k deselects
def pytest_collection_modifyitems(config, items):
    unselected = []
    for item in items:
        marker = item.get_closest_marker("requires_cuda")
        if marker is not None and not HAS_CUDA:
            reason = marker.args[0] if marker.args else marker.kwargs.get("reason", "no CUDA device")
            item.add_marker(pytest.mark.skip(reason=reason))
        if HAS_CUDA:
            continue
        selected = "cuda" in item.nodeid.lower() or any("cuda" in m.name for m in item.iter_markers())
        for skip in item.iter_markers("skipif"):
            condition = skip.args[0] if skip.args else skip.kwargs.get("condition")
            if condition is True and "cuda" in str(skip.kwargs.get("reason", "")).lower() and not selected:
                unselected.append(item.nodeid)
    if unselected:
        raise pytest.UsageError("tests skipped without CUDA that -k cuda does not select (mark them "
                                f"requires_cuda): {unselected[:5]}")


# The float64 reference must not see TF32 rounding on the GPU.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def ar():
    """The attnrnn package with its compiled ops."""
    if _IMPORT_ERROR is not None:
        pytest.fail(f"attnrnn (compiled extension) cannot be imported: {_IMPORT_ERROR!r}")
    import attnrnn
    return attnrnn


@pytest.fixture
def ref():
    """attnrnn.reference (pure PyTorch)."""
    return REF


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def forced_plan(ar):
    """forced_plan(mma_sync=False, segments=0, pairing="auto", separate_grad_kv=False): a context
    manager that forces the CUDA chunk plan's choices (attnrnn/testing.h) and restores the previous
    override on leaving, so that a test reaches a kernel its shape would not pick."""
    import contextlib

    pairings = {"auto": 0, "always": 1, "never": 2}

    @contextlib.contextmanager
    def force(mma_sync=False, segments=0, pairing="auto", separate_grad_kv=False):
        before = ar._C._plan_override()
        ar._C._set_plan_override(mma_sync, segments, pairings[pairing], separate_grad_kv)
        try:
            yield
        finally:
            ar._C._set_plan_override(*before)

    return force
