"""engine/checkpoints/optimizer_state.py: the distributed optimizer's state streamed to disk a chunk at a time writes
the checkpoint megatron's whole-state gather writes, bit for bit (fp32 and bf16 parameters, DP2), and a staged save
is the state at planning."""
import pytest

from tests.helpers.common import make_tiny_hf_model, run_torchrun


@pytest.mark.dist
def test_streamed_optimizer_save_equals_megatrons(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path, "llama", seed=5)
    out = run_torchrun("optimizer_save_worker.py", 2, hf_dir, str(tmp_path / "ckpt"), timeout=300).stdout
    for dtype in ("torch.float32", "torch.bfloat16"):
        assert f"OPTIM_SAVE {dtype}: " in out and "equal megatron's, staged equal too" in out, out[-3000:]
