"""Every config key is read or refused: a walk over every leaf of the schema fails for a key that nothing reads.

How "read" is established (tests/multiprocess/workers/config_reads.py): two tiny trainings run in-process with every config
dataclass instrumented, one per side of each branch the trainer takes (a critic-based run with KL in the reward,
and a critic-free GRPO run with the KL loss and dynamic micro-batches). A key counts as read when tripod's engine
code (not the config loader or validator) reads it during CLI preflight, trainer construction, the training steps,
validation or checkpointing, or when it feeds by interpolation (`${...}`) a key that is read.

Keys that cannot be exercised on this machine or are being implemented on other branches right now are listed in
NOT_EXERCISED, each with its reason; the list must stay tiny, and an entry that becomes read must be removed.
"""
import fnmatch
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.common import DIST_DIR, REPO_ROOT
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides

NOT_EXERCISED = {
    "actor_rollout_ref.rollout.mem_fraction_static": "SGLang backend only (needs a GPU and sglang)",
    "actor_rollout_ref.ref.megatron.recompute_*": "the frozen reference has no backward: refused when set "
                                                 "(engine/precision.py)",
    "actor_rollout_ref.ref.megatron.optimizer_offload": "the reference has no optimizer: refused when set",
    "trainer.divergence_guard.max_rollbacks": "read once the guard is on and trips (tests/multiprocess/test_guard.py)",
    "trainer.divergence_guard.remedy_clip_ratio": "read once the guard is on and trips (tests/multiprocess/test_guard.py)",
    "trainer.divergence_guard.remedy_kl_coef_add": "read once the guard is on and trips (tests/multiprocess/test_guard.py)",
}

CRITIC_RUN = ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k3",
              "algorithm.kl_ctrl.type=adaptive", "actor_rollout_ref.ref.offload=true",
              "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=512", "data.val_batch_size=3",
              "trainer.test_freq=1", "trainer.save_freq=1", "actor_rollout_ref.actor.target_kl=10",
              "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.shuffle=true",
              "trainer.total_training_steps=1", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
              "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
              "actor_rollout_ref.actor.megatron.recompute_granularity=full",
              "critic.megatron.recompute_granularity=full", "trainer.divergence_guard.enabled=true"]
GRPO_RUN = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=k2",
            "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512",
            "trainer.total_training_steps=null", "trainer.total_epochs=1"]


def _leaves_and_interpolations():
    """Every leaf key of the schema, and {key: keys its default interpolates}."""
    from omegaconf import OmegaConf

    from tripod.engine.config import TripodConfig

    raw = OmegaConf.to_container(OmegaConf.structured(TripodConfig), resolve=False)
    leaves, feeds = [], {}

    def walk(node, prefix):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, key + ".")
                continue
            leaves.append(key)
            for ref in re.findall(r"\$\{([^}]+)\}", v) if isinstance(v, str) else []:
                feeds.setdefault(key, []).append(prefix + ref[1:] if ref.startswith(".") else ref)

    walk(raw, "")
    return leaves, feeds


def _allowed(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in NOT_EXERCISED)


def _reads(tmp_path, name, overrides, n_train=32):
    setup = make_ppo_setup(tmp_path / name, n_train=n_train)
    out = tmp_path / f"{name}.json"
    args = tiny_overrides(setup, str(tmp_path / name / "run"), steps=1) + [f"data.tokenizer={setup['model']}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(DIST_DIR / "config_reads.py"), str(out), *args, *overrides],
                          cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return set(json.loads(out.read_text()))


def honoured(reads: set[str]) -> set[str]:
    """Read keys, plus (to a fixed point) every key that a read or allow-listed key takes its default from."""
    leaves, feeds = _leaves_and_interpolations()
    done = set(reads) | {k for k in leaves if _allowed(k)}
    while True:
        more = {src for key in done for src in feeds.get(key, [])} - done
        if not more:
            return done
        done |= more


@pytest.mark.dist
def test_every_config_key_is_read(tmp_path):
    reads = _reads(tmp_path, "critic", CRITIC_RUN) | _reads(tmp_path, "grpo", GRPO_RUN, n_train=4)
    leaves, _ = _leaves_and_interpolations()
    unread = [k for k in leaves if k not in honoured(reads)]
    assert unread == [], (f"config keys nothing reads: {unread}. Make the engine honour each, or refuse it at start "
                          "with one line (engine/config.py check or config_validation), and drop it from the schema")
    stale = [p for p in NOT_EXERCISED if any(fnmatch.fnmatchcase(k, p) for k in reads)]
    assert stale == [], f"now read, remove from NOT_EXERCISED: {stale}"


def test_the_walk_sees_an_unread_key():
    """The closure does not hide keys: with nothing read, every leaf outside the allowlist is reported."""
    leaves, _ = _leaves_and_interpolations()
    assert len(leaves) > 100
    unread = [k for k in leaves if k not in honoured(set())]
    assert "data.val_batch_size" in unread and "actor_rollout_ref.actor.optim.min_lr_ratio" in unread
    # a read key pulls in what it interpolates: critic.ppo_epochs follows actor.ppo_epochs
    assert "actor_rollout_ref.actor.ppo_epochs" in honoured({"critic.ppo_epochs"})
    assert len(NOT_EXERCISED) <= 6  # SGLang-only, reference-only refusals and the guard's on-trip remedies
