"""Host offload's state machine over a real 2-step PPO run on CPU (one rank, GAE with critic and reference, a save
after every step): with every offload kind of every model on (forced inside the manager by
tests/multiprocess/workers/train_with_hooks.py, since a CPU run refuses the keys), the trainer enters the phases in the
step's order and, after each, every kind is where verl keeps it: a model's params on the device only while a phase
computes with them, its grads and optimizer states only in its update (or a checkpoint save). On CPU nothing moves:
the manager records (`execute` false)."""
import json

import pytest

from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import train_in_world

D, H = "device", "host"
# actor params, grads, optim | critic params, grads, optim | reference params (tests/unit/test_offload.py: the table
# with per-kind keys; here every kind is on)
EXPECTED = {
    "idle":          (H, H, H, H, H, H, H),
    "rollout":       (D, H, H, H, H, H, H),
    "old_log_prob":  (D, H, H, H, H, H, H),
    "ref":           (H, H, H, H, H, H, D),
    "values":        (H, H, H, D, H, H, H),
    "update_critic": (H, H, H, D, D, D, H),
    "update_actor":  (D, D, D, H, H, H, H),
    "checkpoint":    (D, H, D, D, H, D, H),
}
STEP = ["rollout", "old_log_prob", "ref", "values", "update_critic", "update_actor", "checkpoint"]


@pytest.mark.dist
def test_two_step_run_records_where_every_kind_lives_after_each_phase(tmp_path):
    setup = make_ppo_setup(tmp_path, n_val=4)
    record = tmp_path / "offload.jsonl"
    args = tiny_overrides(setup, str(tmp_path / "run")) + [
        "trainer.save_freq=1", "trainer.val_before_train=false"]
    # tripod_commands.py runs train_with_hooks.py's module code, which records the phases on TRIPOD_TEST_OFFLOAD_RECORD
    proc = train_in_world(args, 1, tmp_path / "train.log", env=dict(TRIPOD_TEST_OFFLOAD_RECORD=str(record)),
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    phases = [r["phase"] for r in rows]
    # build, step 1 and its save, step 2, the last step's validation (a rollout), its save
    assert phases == ["idle"] + STEP + STEP[:-1] + ["rollout", "checkpoint"], phases
    assert not any(r["execute"] for r in rows)  # CPU: recorded, not moved
    for r in rows:
        w = r["where"]
        a, c, ref = w["actor"], w["critic"], w["reference"]
        assert (a["params"], a["grads"], a["optim"], c["params"], c["grads"], c["optim"], ref["params"]) == \
            EXPECTED[r["phase"]], r["phase"]
