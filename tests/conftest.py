"""pytest setup shared by all tripod tests: keeps the shared 2-core CPU quiet (one torch thread per test process),
and runs Triton in its interpreter on CPU."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# No huge pages in the processes tests start (tripod's own ranks get them: engine/launch.py), whatever the caller's
# environment: tests hold RSS growth against a plan's bytes, which 2 MB pages would round up. Forced, because the
# forked worlds' preloaded server (tests/helpers/forked_worlds.py) fixes its allocator for every world it forks.
os.environ["THP_MEM_ALLOC_ENABLE"] = "0"


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


# Without CUDA the Triton kernels can only run in the interpreter: forced (an inherited TRITON_INTERPRET=0 would
# otherwise skip the kernel tests silently). Must be set before anything imports triton.
if not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

# What tripod's entry points do first (parallel/megatron_patches): the tests that import megatron in this process get
# its import-time compilation deferred. `import tripod` alone patches nothing.
from tripod.parallel.megatron_patches import apply_megatron_patches  # noqa: E402
from tripod.parallel.megatron_patches.known_warnings import KNOWN  # noqa: E402

apply_megatron_patches()


def pytest_configure(config):
    """The known third-party warnings quiet in pytest's summary too: pytest restores the warning filters around
    conftest loading and each test, so they go in as its own `filterwarnings` lines."""
    for message, _module, _why in KNOWN:
        config.addinivalue_line("filterwarnings", f"ignore:{message}:UserWarning")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass
    yield


@pytest.fixture
def tool_configs_load(monkeypatch):
    """For tests that only build tools from a config (their names, schemas), never running the Python tool: where this
    machine has no user namespaces its sandbox refuses to start (engine/agent/sandbox.py), so the probe is taken as
    passing here. Tests that run code through the sandbox skip instead (`needs_sandbox`)."""
    from tripod.engine.agent import sandbox

    if sandbox.namespace_problem() is not None:
        monkeypatch.setattr(sandbox, "namespace_problem", lambda: None)


@pytest.fixture
def needs_sandbox():
    """Skip where the Python tool's namespaced sandbox cannot run (the reason is the probe's)."""
    from tripod.engine.agent import sandbox

    problem = sandbox.namespace_problem()
    if problem is not None:
        pytest.skip(f"no namespaced sandbox here: {problem}")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are collected everywhere and skipped, with the reason, where CUDA is absent; on the lent
    GPU machine docs/gpu_check.md runs them with `pytest -m gpu`."""
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: runs on a GPU machine (docs/gpu_check.md: pytest -m gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `"gpu" in item.keywords`: that matches a folder name
            item.add_marker(skip)
