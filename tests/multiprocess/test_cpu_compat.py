"""Canary for parallel/megatron_patches/cpu_compat.py: megatron-core must reach no CUDA call site that is not in
the documented allow-list during a TP2xPP2 (+sequence parallel, +full recomputation, +distributed optimizer) train
step."""
import re

import pytest
import torch

from tests.helpers.common import make_tiny_hf_model, run_torchrun


def test_apply_is_idempotent_and_cpu_only():
    from tripod.parallel.megatron_patches.cpu_compat import apply_cpu_compat, cpu_compat_applied

    if torch.cuda.is_available():
        assert apply_cpu_compat() is False and not cpu_compat_applied()
        return
    assert apply_cpu_compat() is True
    device = torch.cuda.current_device()
    assert apply_cpu_compat() is True and torch.cuda.current_device() == device == torch.device("cpu")
    assert torch.zeros(2, device="cuda").device.type == "cpu"  # the mode rewrites device="cuda"
    assert torch.ones(3).type() == "torch.FloatTensor"  # spoofed only for megatron callers


@pytest.mark.dist
def test_no_unlisted_cuda_call_site_in_a_tp2_pp2_sp_distopt_step(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", seed=5, num_hidden_layers=2)
    out = run_torchrun("canary_model_worker.py", 4, hf_dir, timeout=300).stdout
    assert out.count("CANARY_STEP 1") == 4, out[-3000:]
    traced = set(re.findall(r"TRACED (\S+) (\S+):\d+ (\S+)", out))
    shims = {shim for shim, _, _ in traced}
    # every shim is exercised by this step (so the allow-list is actually checked)
    assert {"current_device", "cuda_device_arg", "tensor_type", "sp_torch_norm", "rng_tracker",
            "recompute_rng"} <= shims, shims
    unexpected = sorted(set(re.findall(r"UNEXPECTED (.*)", out)))
    assert not unexpected, ("megatron reached CUDA call sites not in "
                            "parallel.megatron_patches.cpu_compat.ALLOWED_CALL_SITES (check they are safe on CPU, then "
                            "list them):\n" + "\n".join(unexpected))
