"""pytest setup shared by all tripod tests: puts tests/ on sys.path (for `from utils import ...`)
and keeps the shared 2-core CPU quiet (one torch thread per test process)."""
import os
import sys
from pathlib import Path

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass
    yield
