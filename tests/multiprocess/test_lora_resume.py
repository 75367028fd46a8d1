"""A LoRA run's checkpoint (actor and critic adapters, distributed optimizer holding only the adapters and the value
head) resumes exactly: at the same layout bit for bit the uninterrupted step, at another layout (TP2 x DP1 from
TP1 x DP2) within the layout bound the full-parameter resume test uses (tests/multiprocess/test_precision.py, whose
runs and helpers this reuses); Adam's exp_avg_sq zeroed on load (a planted bug) breaks that bound."""
import pytest

from tests.helpers.ppo_setup import make_ppo_setup
from tests.helpers.trainer_runs import metric_violations, train_in_worlds, train_together
from tests.multiprocess.test_precision import (
    COMPARED,
    UPDATE_REL,
    _dp2_args,
    _metrics,
    _resume_args,
    _update_differences,
    _weights,
)

LORA = ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.target_modules=[all-linear]",
        "critic.model.lora.rank=4",
        # the actor recomputes every block: its adapters inside megatron's checkpointed blocks
        # must still get a gradient (the frozen embedding's output is marked as requiring one: parallel/lora/apply.py)
        "actor_rollout_ref.actor.megatron.recompute_granularity=full"]


@pytest.mark.dist
def test_lora_checkpoint_resumes_at_another_layout(tmp_path):
    import os

    import torch

    setup = make_ppo_setup(tmp_path)
    train_together({"dp2": _dp2_args(tmp_path, setup, LORA)}, str(tmp_path))
    dp_dir = str(tmp_path / "dp2")
    ckpt = os.path.join(dp_dir, "checkpoints", "global_step_1")
    dp2 = _metrics(dp_dir)
    w1, w2 = _weights(dp_dir, 1, tmp_path), _weights(dp_dir, 2, tmp_path)
    for model in ("actor", "critic"):  # the adapters train (B moves off zero), not only weight decay on A
        assert any(w2[n].abs().max() > 0 for n in w2 if n.startswith(f"{model}/") and ".lora.lora_B." in n), model
    assert all(m["actor/grad_norm"] > 0 for m in dp2.values()), dp2
    resumes = {"dp2_resumed": (1, None), "tp2_resumed": (2, None), "tp2_no_exp_avg_sq": (2, "adam_exp_avg_sq_on_load")}
    train_in_worlds({name: (2, _resume_args(setup, tmp_path / name, ckpt, tp) + LORA, plant)
                     for name, (tp, plant) in resumes.items()}, str(tmp_path))
    same, tp2 = (_metrics(str(tmp_path / n)) for n in ("dp2_resumed", "tp2_resumed"))
    assert sorted(same) == [2], sorted(same)
    assert {k: same[2][k] for k in COMPARED} == {k: dp2[2][k] for k in COMPARED}
    same_w = _weights(tmp_path / "dp2_resumed", 2, tmp_path)
    assert same_w.keys() == w2.keys() and all(torch.equal(same_w[n], w2[n]) for n in w2)
    violations = metric_violations([dp2[2]], [tp2[2]])
    assert not violations, violations
    moved = _update_differences(w1, w2, _weights(tmp_path / "tp2_resumed", 2, tmp_path))
    lost = _update_differences(w1, w2, _weights(tmp_path / "tp2_no_exp_avg_sq", 2, tmp_path))
    print(f"LoRA resume at TP2: step-2 update differs by {moved}; with exp_avg_sq zeroed on load {lost} (relative)")
    assert all(v <= UPDATE_REL for v in moved.values()), moved
    assert any(v > UPDATE_REL for v in lost.values()), f"the check missed Adam's exp_avg_sq lost on load: {lost}"
