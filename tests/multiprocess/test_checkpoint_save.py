"""tripod/parallel/megatron_patches/checkpoint_save.py: a dist-checkpoint save written by the rank from the live
tensors (no clone, no fork, no spawned Manager) loads back bit for bit, a staged one is a snapshot, and megatron's own
save still forks and starts its Manager (the canary)."""
import pytest

from tests.helpers.common import run_torchrun


@pytest.mark.dist
def test_save_writes_live_tensors_without_forks_or_manager(tmp_path):
    out = run_torchrun("checkpoint_save_worker.py", 2, str(tmp_path), timeout=300).stdout
    assert "CKPT_SAVE patched: loads back bit for bit, written from the live tensor, no fork, no Manager" in out, \
        out[-3000:]
    assert "CKPT_SAVE staged: the checkpoint is the state at planning" in out, out[-3000:]
    assert "CKPT_SAVE plain: megatron still forks its writers and starts its Manager" in out, out[-3000:]
