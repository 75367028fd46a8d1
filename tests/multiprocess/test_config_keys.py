"""Every config key is read or refused: a walk over every leaf of the schema fails for a key that nothing reads.

How "read" is established (tests/multiprocess/workers/config_reads.py): two tiny trainings run in-process with every config
dataclass instrumented, one per side of each branch the trainer takes (a critic-based run with KL in the reward,
and a critic-free GRPO run with the KL loss, dynamic micro-batches and a reward model). A key counts as read when tripod's engine
code (not the config loader or validator) reads it during CLI preflight, trainer construction, the training steps,
validation or checkpointing, or when it feeds by interpolation (`${...}`) a key that is read.

Keys that cannot be exercised on this machine or are being implemented on other branches right now are listed in
NOT_EXERCISED, each with its reason; the list must stay tiny, and an entry that becomes read must be removed.

The critic run is also DAPO's real run: dynamic sampling (generation batches of 4 prompts until 4 groups are kept)
with a reward that keeps exactly the odd-answer prompts (tests/helpers/dapo_reward.py), and overlong shaping; its
metrics and saved data position are held against the closed form from the data.
"""
import fnmatch
import json
import os
import re

import pytest

from tests.helpers import dapo_reward
from tests.helpers.common import REPO_ROOT, launch_world, make_tiny_hf_model
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides

NOT_EXERCISED = {
    "actor_rollout_ref.rollout.mem_fraction_static": "SGLang backend only (needs a GPU and sglang)",
    "actor_rollout_ref.ref.megatron.recompute_*": "the frozen reference has no backward: refused when set "
                                                 "(parallel/precision.py)",
    "actor_rollout_ref.ref.megatron.[og]*_offload": "optimizer_offload, optimizer_cpu_offload, grad_offload: the "
                                                   "reference has no optimizer or gradients: refused when set",
    "reward_model.megatron.recompute_*": "the frozen reward model has no backward: refused when set (parallel/precision.py)",
    "reward_model.megatron.[og]*_offload": "optimizer_offload, optimizer_cpu_offload, grad_offload: the reward model "
                                           "has no optimizer or gradients: refused when set",
    "async_training.*": "read by a rollout on its own ranks (engine/async_rollout/: tests/multiprocess/test_async.py); "
                        "require_batches and partial_rollout are checked against the rest, not read (docs/async.md)",
    "*.model.lora.[ademt]*": "alpha, dropout, target_modules, exclude_modules, merge, adapter_path: read once "
                             "lora.rank > 0 (tests/multiprocess/test_lora.py trains actor and critic LoRA)",
    "actor_rollout_ref.rollout.multi_turn.[afimst]*": "read once multi_turn.enable is on "
                                                     "(tests/multiprocess/test_agent_rollout.py, test_agent_loop.py); "
                                                     "tokenization_sanity_check_mode is checked, not read",
    "actor_rollout_ref.rollout.multi_turn.[nu]*": "num_repeat_rollouts, use_inference_chat_template: keys verl 0.9.1 no "
                                                 "longer reads; only null / false are accepted (engine/config/rollout.py)",
    "actor_rollout_ref.rollout.agent.*": "verl 0.9.1's agent-loop worker keys: accepted where they agree with tripod, "
                                         "refused otherwise (engine/config/rollout.py); nothing reads them",
    "data.return_raw_chat": "tripod keeps each prompt's chat messages always, as verl 0.9.1 does",
    "trainer.divergence_guard.max_rollbacks": "read once the guard is on and trips (tests/multiprocess/test_guard.py)",
    "trainer.divergence_guard.remedy_[ck]*": "remedy_clip_ratio, remedy_kl_coef_add: read once the guard is on and trips "
                                             "(tests/multiprocess/test_guard.py)",
    "trainer.max_restarts": "read by the Ray driver (trainer.launcher=ray: tests/multiprocess/test_launch_ray.py)",
    "ray_kwargs.*": "the Ray cluster of trainer.launcher=ray (tests/multiprocess/test_launch_ray.py, make test-launch)",
    # issue 48 (docs/algorithms.md): verl keys accepted at their defaults and refused otherwise
    "algorithm.use_pf_ppo": "PF-PPO's row resampling: refused when true (engine/config/algorithm.py); checked, not read",
    "algorithm.pf_ppo.*": "PF-PPO's settings, read only with use_pf_ppo, which is refused",
    "algorithm.gdpo_reward_*": "GDPO's per-component rewards: refused when set (tripod's rewards are one float)",
    # issue 48, on-policy distillation (docs/distillation.md)
    "distillation.[dtn]*": "distillation_loss.*, teacher_models.*: read once distillation.enabled "
                           "(tests/multiprocess/test_distillation.py); teacher_key, n_gpus_per_node, nnodes and a "
                           "teacher's key / num_replicas: verl's multi-teacher pool, accepted and unused",
}

CRITIC_RUN = ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k3",
              "algorithm.kl_ctrl.type=adaptive", "actor_rollout_ref.ref.offload=true",
              "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=512", "data.val_batch_size=3",
              "trainer.test_freq=1", "trainer.save_freq=1", "actor_rollout_ref.actor.target_kl=10",
              "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.shuffle=true",
              "trainer.total_training_steps=1", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
              "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
              "actor_rollout_ref.actor.megatron.recompute_granularity=full",
              "critic.megatron.recompute_granularity=full", "trainer.divergence_guard.enabled=true",
              # DAPO: data.train_batch_size=4 groups of rollout.n=2, gathered from batches of 4 prompts
              "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
              "algorithm.filter_groups.max_num_gen_batches=8", "data.gen_batch_size=4",
              "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
              "reward_model.overlong_buffer.penalty_factor=0.5"]
GRPO_RUN = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=k2",
            "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512",
            "trainer.total_training_steps=null", "trainer.total_epochs=1",
            # a reward model summed with the rule reward (its path is added by _reads)
            "reward_model.enable=true", "reward_model.combine=sum", "reward_model.reward_weight=0.5",
            "reward_model.micro_batch_size_per_gpu=2", "reward_model.offload=true"]


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


def _start_reads(tmp_path, name, overrides, n_train=32, train_source=None):
    """Start one instrumented training (a 1-rank test world of its own, one thread); `_finish_reads` waits for it.
    `train_source` replaces the train rows' data_source."""
    from tripod.engine.data import make_arithmetic_rows, write_prompt_parquet

    setup = make_ppo_setup(tmp_path / name, n_train=n_train)
    if "reward_model.enable=true" in overrides:
        from tripod.engine.data.char_tokenizer import char_tokenizer

        rm = make_tiny_hf_model(tmp_path / name, "qwen2", subdir="rm", sequence_classification=True, vocab_size=128,
                                max_position_embeddings=256)
        char_tokenizer().save_pretrained(rm)
        overrides = [*overrides, f"reward_model.model.path={rm}"]
    rows = make_arithmetic_rows(n_train, seed=0, max_digits=1, instruction="Answer as #### N.")  # make_ppo_setup's
    if train_source:
        for row in rows:
            row["data_source"] = train_source
        setup["train"] = str(tmp_path / name / "train_source.parquet")
        write_prompt_parquet(rows, setup["train"])
    out = tmp_path / f"{name}.json"
    args = tiny_overrides(setup, str(tmp_path / name / "run"), steps=1) + [f"data.tokenizer={setup['model']}"]
    log = tmp_path / f"{name}.log"
    proc = launch_world("config_reads.py", 1, str(out), *args, *overrides, log=log)  # a 1-rank test world
    return proc, out, log, str(tmp_path / name / "run"), rows


def _finish_reads(proc, out, log, run_dir, rows):
    """(keys read, the run's directory, its train rows) of a run `_start_reads` started."""
    proc.wait(timeout=900)
    assert proc.returncode == 0, log.read_text()[-5000:]
    return set(json.loads(out.read_text())), run_dir, rows


def honoured(reads: set[str]) -> set[str]:
    """Read keys, plus (to a fixed point) every key that a read or allow-listed key takes its default from."""
    leaves, feeds = _leaves_and_interpolations()
    done = set(reads) | {k for k in leaves if _allowed(k)}
    while True:
        more = {src for key in done for src in feeds.get(key, [])} - done
        if not more:
            return done
        done |= more


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two instrumented trainings, side by side (one process and one thread each: the 2-core box runs both at
    once): {"critic": (keys read, run dir, train rows), "grpo": (...)}."""
    tmp = tmp_path_factory.mktemp("keys")
    started = {"critic": _start_reads(tmp, "critic", CRITIC_RUN, train_source=dapo_reward.DATA_SOURCE),
               "grpo": _start_reads(tmp, "grpo", GRPO_RUN, n_train=4)}
    try:
        return {name: _finish_reads(*run) for name, run in started.items()}
    finally:  # a failed or timed-out run leaves no process behind
        for proc, *_ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def critic_run(runs):
    return runs["critic"]


@pytest.mark.dist
def test_every_config_key_is_read(runs):
    reads = runs["critic"][0] | runs["grpo"][0]
    leaves, _ = _leaves_and_interpolations()
    done = honoured(reads)  # once: it walks the whole schema
    unread = [k for k in leaves if k not in done]
    assert unread == [], (f"config keys nothing reads: {unread}. Make the engine honour each, or refuse it at start "
                          "with one line (engine/config/ check or config_validation), and drop it from the schema")
    stale = [p for p in NOT_EXERCISED if any(fnmatch.fnmatchcase(k, p) for k in reads)]
    assert stale == [], f"now read, remove from NOT_EXERCISED: {stale}"


def test_the_walk_sees_an_unread_key():
    """The closure does not hide keys: with nothing read, every leaf outside the allowlist is reported."""
    leaves, _ = _leaves_and_interpolations()
    assert len(leaves) > 100
    done = honoured(set())
    unread = [k for k in leaves if k not in done]
    assert "data.val_batch_size" in unread and "actor_rollout_ref.actor.optim.min_lr_ratio" in unread
    # a read key pulls in what it interpolates: critic.ppo_epochs follows actor.ppo_epochs
    assert "actor_rollout_ref.actor.ppo_epochs" in honoured({"critic.ppo_epochs"})
    # SGLang-only, the frozen models' refusals, guard remedies, async-only, LoRA's and multi-turn's own keys, verl
    # 0.9.1's keys that tripod accepts without reading, the Ray launcher's, verl's refused estimator options and the
    # distillation keys read only when it is on
    assert len(NOT_EXERCISED) <= 19


def test_reads_in_preflight_do_not_count():
    """Only the engine's use of a key counts: preflight's checks (engine/preflight.py) read keys without honouring
    them; launch.check_world's reads count (its world size is how many ranks `tripod train` starts)."""
    import dataclasses

    from tests.multiprocess.workers.config_reads import record_reads
    from tripod.engine.config import load_config
    from tripod.engine.launch import Launch, check_world
    from tripod.engine.preflight import check_resume

    cfg = load_config(str(REPO_ROOT / "recipes" / "defaults.yaml"))
    classes, todo = set(), [cfg]
    while todo:
        obj = todo.pop()
        classes.add(type(obj))
        todo += [getattr(obj, f.name) for f in dataclasses.fields(obj) if dataclasses.is_dataclass(getattr(obj, f.name))]
    try:
        reads = record_reads(cfg)
        check_resume(cfg, None, 1)  # preflight: reads trainer.resume ("auto": nothing to check)
        assert reads == set(), f"reads by preflight counted: {sorted(reads)}"
        assert check_world(cfg, Launch("local", 0)) == 1
        assert reads == {"trainer", "trainer.launcher", "trainer.nnodes", "trainer.n_gpus_per_node", "rollout",
                         "rollout.nnodes", "rollout.n_gpus_per_node"}, sorted(reads)  # + the sections
    finally:
        for cls in classes:
            if "__getattribute__" in vars(cls):
                del cls.__getattribute__


@pytest.mark.dist
def test_dynamic_sampling_refills_the_batch(critic_run):
    """The critic run's one step: batches of 4 prompts (data.shuffle=false: in file order) are generated until 4 odd-
    answer prompts are kept. With make_ppo_setup's data (answers 14, 1, 10, 5 | -7, -4, 0, 6 | 6, 4, 7, 4 ...) that is
    3 generation batches, 8 groups dropped; computed here from the rows, not typed in. The checkpoint's data position
    counts every generation batch (a resume draws the next one), and the logged score is the shaped reward: each kept
    group scores 1 and 0, so its mean is 0.5 plus the mean overlong penalty."""
    _, run_dir, rows = critic_run
    kept = gen_batches = 0
    while kept < 4:
        kept += sum(dapo_reward.kept_by_design(r["reward_model"]["ground_truth"])
                    for r in rows[4 * gen_batches:4 * gen_batches + 4])
        gen_batches += 1
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        step = [m for m in map(json.loads, f) if m["step"] == 1][0]
    assert gen_batches > 1 and 4 * gen_batches - kept > 0  # the data makes dynamic sampling work for it
    assert step["train/num_gen_batches"] == gen_batches
    assert step["dynamic_sampling/extra_gen_batches"] == gen_batches - 1
    assert step["dynamic_sampling/groups_dropped"] == 4 * gen_batches - kept
    assert step["dynamic_sampling/groups_kept"] == kept and step["dynamic_sampling/groups_surplus"] == kept - 4
    assert step["dynamic_sampling/kept_frac"] == pytest.approx(kept / (4 * gen_batches))
    penalty = step["reward/overlong_penalty_mean"]
    assert -0.5 <= penalty <= 0 and 0 <= step["reward/overlong_frac"] <= 1
    # per row -max(0, L - 4) / 4 * 0.5 <= -(L - 4) / 8 (response length L <= 8): so is the mean
    assert penalty <= -(step["response_length/mean"] - 4) / 8 + 1e-9
    assert step["critic/score/mean"] == pytest.approx(0.5 + penalty, abs=1e-9)
    with open(os.path.join(run_dir, "checkpoints", "global_step_1", "trainer_state.json")) as f:
        data = json.load(f)["data"]
    assert (data["epoch"], data["offset"], data["batch_size"]) == (0, gen_batches, 4)
