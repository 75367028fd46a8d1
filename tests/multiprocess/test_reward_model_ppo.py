"""PPO with a reward model end to end (`tripod train`, 2 gloo ranks, 2 steps): the actor at DP2, the reward model
(a tiny Qwen2ForSequenceClassification with the actor's tokenizer) on its own layout TP2 and offloaded between
phases, its score summed with the arithmetic rule reward; both are logged and the step's score is their sum."""
import pytest

from tests.helpers.common import make_tiny_hf_model
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import metrics, train_in_world


@pytest.mark.dist
def test_ppo_with_a_reward_model_on_its_own_layout(tmp_path):
    from tripod.engine.data.char_tokenizer import char_tokenizer

    setup = make_ppo_setup(tmp_path)
    rm = make_tiny_hf_model(tmp_path, "qwen2", seed=3, subdir="rm", sequence_classification=True, vocab_size=128,
                            max_position_embeddings=256)
    char_tokenizer().save_pretrained(rm)
    run_dir = str(tmp_path / "run")
    args = tiny_overrides(setup, run_dir, world=2) + [
        "reward_model.enable=true", f"reward_model.model.path={rm}", "reward_model.combine=sum",
        "reward_model.reward_weight=0.5", "reward_model.micro_batch_size_per_gpu=2", "reward_model.offload=true",
        "reward_model.megatron.tensor_model_parallel_size=2", "trainer.val_before_train=false"]
    proc = train_in_world(args, 2, tmp_path / "train.log")
    assert proc.returncode == 0, proc.stdout[-5000:]
    steps = [m for m in metrics(run_dir) if "reward/model_mean" in m]
    assert [m["step"] for m in steps] == [1, 2], proc.stdout[-3000:]
    for m in steps:
        assert m["reward/rule_frac"] == 1.0  # every arithmetic row has its rule
        assert m["reward/model_mean"] != 0.0
        # sum: each row scores rule + 0.5 x model, so the means add (8 fp32 scores summed in float64: exact to 1e-12)
        assert m["critic/score/mean"] == pytest.approx(m["reward/rule_mean"] + 0.5 * m["reward/model_mean"], abs=1e-9)
    assert "val/reward_mean" in metrics(run_dir)[-1]
