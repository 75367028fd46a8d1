"""tripod/parallel/megatron_patches/cpu_adam.py in tripod's workers (plain and distributed optimizer, DP2): the
actor's Adam is torch's fused CPU kernel, and megatron alone still builds the unfused one (the canary).
The update's equivalence to torch's reference loop is tests/unit/test_cpu_adam.py."""
import pytest

from tests.helpers.common import make_tiny_hf_model, run_torchrun


@pytest.mark.dist
def test_workers_use_fused_cpu_adam(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path, "llama", seed=5)
    out = run_torchrun("cpu_adam_worker.py", 2, hf_dir, timeout=300).stdout
    for distributed in (False, True):
        assert f"CPU_ADAM tripod fused distributed={distributed}" in out, out[-3000:]
        assert f"CPU_ADAM megatron unfused distributed={distributed}" in out, out[-3000:]
