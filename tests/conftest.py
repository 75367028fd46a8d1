"""pytest setup shared by all tripod tests: keeps the shared 2-core CPU quiet (one torch thread per test process),
and runs Triton in its interpreter on CPU."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


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


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass
    yield
