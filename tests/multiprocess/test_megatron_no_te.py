"""Canaries for the megatron-core 0.16.1 bugs without Transformer Engine that parallel/megatron_patches/cpu_compat.py
works around (MoE forward NameError, MLA's TE mock check, MLA core-attention signature, MLA's RoPE-key gradient at TP > 1).
Each test fails when megatron fixes its bug (then drop the workaround) or when the workaround stops making the model run."""
import re
import subprocess
import sys

import pytest

from tests.helpers.common import run_torchrun

RAW_IMPORT = ("import megatron.core.transformer.moe.moe_utils as m, megatron.core.transformer.multi_latent_attention"
              " as a; print(hasattr(m, 'te_general_gemm'), a.HAVE_TE)")


def test_unpatched_megatron_still_has_the_bugs():
    """A fresh interpreter that never imports tripod: megatron as installed, before any workaround."""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", RAW_IMPORT], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"], (
        "megatron-core now defines moe_utils.te_general_gemm or sets multi_latent_attention.HAVE_TE=False without "
        f"TE ({out.stdout!r}): drop the matching workaround in parallel/megatron_patches/cpu_compat.py")


@pytest.mark.dist
def test_moe_and_mla_run_only_with_the_workarounds():
    out = run_torchrun("no_te_moe_worker.py", 1, timeout=300).stdout
    for name, error in (("moe_te_gemm", "NameError"), ("mla_have_te", "TypeError"), ("mla_core_attn", "TypeError")):
        assert f"BUG_STILL_PRESENT {name}: {error}" in out, (name, out[-3000:])
    assert "BUG_GONE" not in out
    assert out.count("FIXED_FORWARD") == 2, out[-3000:]


@pytest.mark.dist
def test_mla_gradients_at_tp2_match_transformers_only_with_the_rope_key_fix(tmp_path):
    """mla_rope_key_grad (parallel/megatron_patches/cpu_compat.py): TP2 gradients (sequence parallel) of a tiny DeepSeek-V3 equal
    transformers' own backward with the fix; megatron as installed (TP2, no SP) still gets them wrong (the canary).
    Both cases in one 2-rank world, the unfixed one last (undoing the fix lasts for the rest of the process)."""
    from tests.helpers.moe_models import make_tiny_moe_model

    hf = make_tiny_moe_model(tmp_path, "deepseek_v3", seed=1)
    out = run_torchrun("mla_tp_grad_worker.py", 2, hf, "1", "0:without_fix", timeout=400).stdout
    assert "GRAD_MATCH sp=1" in out, out[-3000:]
    raw = re.search(r"GRAD_MISMATCH sp=0 (.*)", out)
    assert raw and "linear_kv_down_proj" in raw.group(1), (
        "megatron now gets MLA's RoPE-key gradient right at TP > 1: drop mla_rope_key_grad", out[-3000:])
