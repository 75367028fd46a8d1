"""Up-front validation of a `TripodConfig` against the world it will run in (see engine/config.py).

`validate_config(cfg, world_size)` raises one `ConfigError` listing every problem, each naming its key and the fix.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from engine.config import (ADV_ESTIMATORS, DEVICES, KL_PENALTIES, LOGGER_BACKENDS, LOSS_AGG_MODES, LR_DECAY_STYLES,
                           OPTIMIZERS, ROLLOUT_NAMES, ConfigError, MegatronConfig, TripodConfig)


def data_parallel_size(megatron: MegatronConfig, world_size: int) -> int:
    """DP = world / (TP * PP) of one model (actor, critic or reference)."""
    return world_size // (megatron.tensor_model_parallel_size * megatron.pipeline_model_parallel_size)


def _check_layout(errors: list[str], key: str, m: MegatronConfig, world_size: int) -> bool:
    tp, pp, vpp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
    ok = True
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if value < 1:
            errors.append(f"{key}.{name}={value} must be >= 1")
            ok = False
    if ok and world_size % (tp * pp):
        errors.append(f"{key}: tensor_model_parallel_size * pipeline_model_parallel_size = {tp}*{pp} = {tp * pp} "
                      f"does not divide the world size {world_size}; pick TP and PP whose product divides "
                      f"{world_size} (DP = world / (TP*PP))")
        ok = False
    if vpp is not None and (vpp < 1 or pp < 2):
        errors.append(f"{key}.virtual_pipeline_model_parallel_size={vpp} needs an integer >= 1 and "
                      f"pipeline_model_parallel_size >= 2 (it is {pp}); set it to null to disable interleaving")
    return ok


def _check_batches(errors: list[str], key: str, mini: int, micro: Optional[int], dynamic: bool,
                   train_batch: int, n: int, dp: int) -> None:
    """verl's rules: the train batch splits into mini batches; each mini batch (x n responses) splits evenly over
    DP ranks, and each rank's share into micro batches."""
    if mini < 1:
        errors.append(f"{key}.ppo_mini_batch_size={mini} must be >= 1")
        return
    if train_batch % mini:
        errors.append(f"data.train_batch_size={train_batch} is not divisible by {key}.ppo_mini_batch_size={mini}; "
                      "make the train batch a multiple of the mini batch")
    if (mini * n) % dp:
        errors.append(f"{key}.ppo_mini_batch_size * rollout.n = {mini}*{n} = {mini * n} responses do not split "
                      f"over data-parallel size {dp}; make it a multiple of {dp}")
    elif not dynamic:
        if micro is None or micro < 1:
            errors.append(f"{key}.ppo_micro_batch_size_per_gpu={micro} must be >= 1 (or set "
                          f"{key}.use_dynamic_bsz=true)")
        elif (mini * n // dp) % micro:
            errors.append(f"{key}.ppo_mini_batch_size * rollout.n / DP = {mini}*{n}/{dp} = {mini * n // dp} "
                          f"responses per rank is not divisible by {key}.ppo_micro_batch_size_per_gpu={micro}; "
                          "pick a micro batch that divides it")


def _check_choice(errors: list[str], key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        errors.append(f"{key}={value!r} is not one of {list(allowed)}")


def _check_files(errors: list[str], key: str, files: list[str]) -> None:
    for path in files:
        if not os.path.isfile(os.path.expanduser(path)):
            errors.append(f"{key}: file {path} does not exist; point {key} at existing parquet files "
                          "(scripts/preprocess_gsm8k.py or scripts/make_arithmetic_data.py write them)")


def _check_model(errors: list[str], key: str, path: Optional[str]) -> None:
    if not path:
        errors.append(f"{key} is not set; give a Hugging Face model directory (config.json + weights)")
    elif not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        errors.append(f"{key}={path} has no config.json; give a Hugging Face model directory "
                      "(made with save_pretrained)")


def validate_config(cfg: TripodConfig | DictConfig, world_size: int) -> None:
    """Check `cfg` for a run on `world_size` ranks; raise one ConfigError listing every problem."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_object(cfg)
    e: list[str] = []
    d, arr, alg, tr = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    actor, rollout, ref, critic = arr.actor, arr.rollout, arr.ref, cfg.critic
    use_critic = alg.adv_estimator == "gae"
    use_ref = actor.use_kl_loss or alg.use_kl_in_reward

    if world_size < 1:
        e.append(f"world_size={world_size} must be >= 1")
        world_size = 1
    if tr.n_gpus_per_node * tr.nnodes != world_size:
        e.append(f"trainer.n_gpus_per_node * trainer.nnodes = {tr.n_gpus_per_node}*{tr.nnodes} does not match the "
                 f"world size {world_size}; set trainer.n_gpus_per_node={world_size // max(tr.nnodes, 1)}")

    # data
    if not d.train_files:
        e.append("data.train_files is empty; give one or more parquet files")
    _check_files(e, "data.train_files", d.train_files)
    _check_files(e, "data.val_files", d.val_files)
    if not d.val_files and (tr.val_before_train or tr.test_freq > 0):
        e.append("data.val_files is empty but validation is on (trainer.val_before_train / trainer.test_freq); "
                 "give validation parquet files or set trainer.val_before_train=false trainer.test_freq=-1")
    for key, value in (("data.max_prompt_length", d.max_prompt_length),
                       ("data.max_response_length", d.max_response_length),
                       ("data.train_batch_size", d.train_batch_size),
                       ("actor_rollout_ref.rollout.response_length", rollout.response_length),
                       ("actor_rollout_ref.rollout.n", rollout.n),
                       ("actor_rollout_ref.rollout.val_kwargs.n", rollout.val_kwargs.n),
                       ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs),
                       ("trainer.total_epochs", tr.total_epochs),
                       ("reward_model.num_workers", cfg.reward_model.num_workers)):
        if value < 1:
            e.append(f"{key}={value} must be a positive integer")
    if d.val_batch_size is not None and d.val_batch_size < 1:
        e.append(f"data.val_batch_size={d.val_batch_size} must be >= 1 (or null for the whole validation set)")
    if tr.total_training_steps is not None and tr.total_training_steps < 1:
        e.append(f"trainer.total_training_steps={tr.total_training_steps} must be >= 1 (or null)")
    if cfg.reward_model.timeout_s <= 0:
        e.append(f"reward_model.timeout_s={cfg.reward_model.timeout_s} must be > 0 seconds")

    # models and layouts
    _check_model(e, "actor_rollout_ref.model.path", arr.model.path)
    if use_critic:  # defaults to the actor's model
        _check_model(e, "critic.model.path", critic.model.path)
    layouts = [("actor_rollout_ref.actor.megatron", actor.megatron)]
    layouts += [("critic.megatron", critic.megatron)] if use_critic else []
    layouts += [("actor_rollout_ref.ref.megatron", ref.megatron)] if use_ref else []
    layout_ok = {key: _check_layout(e, key, m, world_size) for key, m in layouts}

    # rollout
    _check_choice(e, "actor_rollout_ref.rollout.name", rollout.name, ROLLOUT_NAMES)
    rtp, amp = rollout.tensor_model_parallel_size, (actor.megatron.tensor_model_parallel_size
                                                    * actor.megatron.pipeline_model_parallel_size)
    if rtp < 1 or world_size % rtp or (layout_ok["actor_rollout_ref.actor.megatron"] and amp % rtp):
        e.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rtp} must divide the actor's model-parallel "
                 f"size TP*PP={amp} (generation groups are carved out of the actor's TP x PP ranks) and the world "
                 f"size {world_size}; use a divisor of {amp}")
    elif (d.train_batch_size * rollout.n) % (world_size // rtp):
        e.append(f"data.train_batch_size * rollout.n = {d.train_batch_size * rollout.n} responses do not split over "
                 f"the {world_size // rtp} rollout data-parallel groups; make it a multiple of {world_size // rtp}")
    if rollout.temperature < 0:
        e.append(f"actor_rollout_ref.rollout.temperature={rollout.temperature} must be >= 0")
    if not 0 < rollout.top_p <= 1:
        e.append(f"actor_rollout_ref.rollout.top_p={rollout.top_p} must be in (0, 1]")
    if rollout.top_k == 0 or rollout.top_k < -1:
        e.append(f"actor_rollout_ref.rollout.top_k={rollout.top_k} must be -1 (off) or >= 1")
    if rollout.prompt_length < d.max_prompt_length:
        e.append(f"actor_rollout_ref.rollout.prompt_length={rollout.prompt_length} is shorter than "
                 f"data.max_prompt_length={d.max_prompt_length}; leave it at its default (the same value)")
    if alg.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and rollout.n < 2:
        e.append(f"algorithm.adv_estimator={alg.adv_estimator} needs a group of responses per prompt; set "
                 f"actor_rollout_ref.rollout.n >= 2 (it is {rollout.n})")

    # batch sizes per model (verl's divisibility rules)
    seq_len = d.max_prompt_length + rollout.response_length
    models = [("actor_rollout_ref.actor", actor)] + ([("critic", critic)] if use_critic else [])
    for key, m in models:
        if layout_ok.get(f"{key}.megatron", False):
            _check_batches(e, key, m.ppo_mini_batch_size, m.ppo_micro_batch_size_per_gpu, m.use_dynamic_bsz,
                           d.train_batch_size, rollout.n, data_parallel_size(m.megatron, world_size))
        if m.use_dynamic_bsz and m.ppo_max_token_len_per_gpu < seq_len:
            e.append(f"{key}.ppo_max_token_len_per_gpu={m.ppo_max_token_len_per_gpu} is below one full sequence "
                     f"(data.max_prompt_length + rollout.response_length = {seq_len}); raise it to >= {seq_len}")
        _check_choice(e, f"{key}.loss_agg_mode", m.loss_agg_mode, LOSS_AGG_MODES)
        if m.grad_clip <= 0:
            e.append(f"{key}.grad_clip={m.grad_clip} must be > 0")
        o = m.optim
        if o.lr < 0:
            e.append(f"{key}.optim.lr={o.lr} must be >= 0")
        if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
            e.append(f"{key}.optim.betas={list(o.betas)} must be two numbers in [0, 1)")
        _check_choice(e, f"{key}.optim.lr_decay_style", o.lr_decay_style, LR_DECAY_STYLES)
        _check_choice(e, f"{key}.optim.optimizer", o.optimizer, OPTIMIZERS)

    # PPO / KL
    if not (actor.clip_ratio_low > 0 and actor.clip_ratio_high > 0):
        e.append(f"actor_rollout_ref.actor.clip_ratio_low/high = {actor.clip_ratio_low}/{actor.clip_ratio_high} "
                 "must be > 0")
    if actor.clip_ratio_c <= 1:
        e.append(f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1 (dual-clip bound)")
    if actor.target_kl is not None and actor.target_kl <= 0:
        e.append(f"actor_rollout_ref.actor.target_kl={actor.target_kl} must be > 0 (or null to disable early stop)")
    if use_critic and critic.cliprange_value <= 0:
        e.append(f"critic.cliprange_value={critic.cliprange_value} must be > 0")
    _check_choice(e, "algorithm.adv_estimator", alg.adv_estimator, ADV_ESTIMATORS)
    _check_choice(e, "algorithm.kl_penalty", alg.kl_penalty, KL_PENALTIES)
    _check_choice(e, "actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type, KL_PENALTIES)
    _check_choice(e, "algorithm.kl_ctrl.type", alg.kl_ctrl.type, ("fixed", "adaptive"))
    if alg.kl_ctrl.type == "adaptive" and (alg.kl_ctrl.target_kl <= 0 or alg.kl_ctrl.horizon < 1):
        e.append(f"algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl > 0 and horizon >= 1 "
                 f"(they are {alg.kl_ctrl.target_kl}, {alg.kl_ctrl.horizon})")
    if not 0 <= alg.gamma <= 1 or not 0 <= alg.lam <= 1:
        e.append(f"algorithm.gamma={alg.gamma} and algorithm.lam={alg.lam} must be in [0, 1]")

    # trainer
    bad_loggers = [b for b in tr.logger if b not in LOGGER_BACKENDS]
    if bad_loggers:
        e.append(f"trainer.logger has unknown backends {bad_loggers}; use any of {list(LOGGER_BACKENDS)}")
    _check_choice(e, "trainer.device", tr.device, DEVICES)
    if tr.resume not in ("auto", "disable") and not os.path.isdir(os.path.expanduser(tr.resume)):
        e.append(f"trainer.resume={tr.resume!r} is neither 'auto', 'disable' nor an existing checkpoint directory")

    if e:
        raise ConfigError(f"{len(e)} configuration problem(s):\n  - " + "\n  - ".join(e))

