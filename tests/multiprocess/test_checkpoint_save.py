"""tripod/parallel/megatron_patches/checkpoint_save.py: a synchronous dist-checkpoint save without megatron's
spawned results Manager writes the same checkpoint, and megatron's own save still starts that Manager (the canary)."""
import pytest

from tests.helpers.common import run_torchrun


@pytest.mark.dist
def test_synchronous_save_needs_no_spawned_manager(tmp_path):
    out = run_torchrun("checkpoint_save_worker.py", 2, str(tmp_path), timeout=300).stdout
    assert "CKPT_SAVE patched: loads back bit for bit, no Manager" in out, out[-3000:]
    assert "CKPT_SAVE plain: megatron still starts its Manager" in out, out[-3000:]
