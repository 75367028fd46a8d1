"""Up-front validation of a whole `TripodConfig` against the world it will run in.

`validate_config(cfg, world_size)` runs every section's own `check()` (engine/config/, beside the fields) and then
the checks that need several sections or the world size (layouts, verl's batch divisibility rules, which models the
algorithm needs). It raises one `ConfigError` listing every problem, each naming its key and the fix. This module
imports engine.config; engine.config never imports it.
"""
from __future__ import annotations

import os
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from tripod.engine.config import ConfigError, MegatronConfig, TripodConfig
from tripod.parallel.precision import DTYPES

FROZEN = ("actor_rollout_ref.ref", "reward_model")  # models that never train


def _layout_fits(errors: list[str], key: str, m: MegatronConfig, world_size: int) -> bool:
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if tp < 1 or pp < 1 or cp < 1:
        return False  # reported by MegatronConfig.check
    if cp > 1 and key == "reward_model.megatron":
        errors.append(f"{key}.context_parallel_size={cp}: the reward model does not run context parallel; set it to 1")
        return False
    if world_size % (tp * pp * cp):
        what = "tensor_model_parallel_size * pipeline_model_parallel_size"
        what += " * context_parallel_size" if cp > 1 else ""
        sizes = f"{tp}*{pp}*{cp}" if cp > 1 else f"{tp}*{pp}"
        errors.append(f"{key}: {what} = {sizes} = {tp * pp * cp} "
                      f"does not divide the world size {world_size}; pick sizes whose product divides "
                      f"{world_size} (DP = world / (TP*CP*PP))")
        return False
    return True


def _check_batches(errors: list[str], key: str, mini: int, micro: Optional[int], dynamic: bool,
                   train_batch: int, n: int, dp: int) -> None:
    """verl's rules: the train batch splits into mini batches; each mini batch (x n responses) splits evenly over
    DP ranks, and each rank's share into micro batches."""
    if mini < 1:
        return  # reported by the section check
    if train_batch % mini:
        errors.append(f"data.train_batch_size={train_batch} is not divisible by {key}.ppo_mini_batch_size={mini}; "
                      "make the train batch a multiple of the mini batch")
    if (mini * n) % dp:
        errors.append(f"{key}.ppo_mini_batch_size * rollout.n = {mini}*{n} = {mini * n} responses do not split "
                      f"over data-parallel size {dp}; make it a multiple of {dp}")
    elif not dynamic and micro is not None and micro >= 1 and (mini * n // dp) % micro:
        errors.append(f"{key}.ppo_mini_batch_size * rollout.n / DP = {mini}*{n}/{dp} = {mini * n // dp} "
                      f"responses per rank is not divisible by {key}.ppo_micro_batch_size_per_gpu={micro}; "
                      "pick a micro batch that divides it")


def _check_model(errors: list[str], key: str, path: Optional[str]) -> None:
    if not path:
        errors.append(f"{key} is not set; give a Hugging Face model directory (config.json + weights)")
    elif not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        errors.append(f"{key}={path} has no config.json; give a Hugging Face model directory "
                      "(made with save_pretrained)")


def _dapo_problems(cfg: TripodConfig) -> list[str]:
    """DAPO's dynamic sampling (algorithm.filter_groups, data.gen_batch_size) and overlong buffer against the rest."""
    d, fg, rollout = cfg.data, cfg.algorithm.filter_groups, cfg.actor_rollout_ref.rollout
    ob, e = cfg.reward_model.overlong_buffer, []
    if fg.enable and rollout.n < 2:
        e.append(f"algorithm.filter_groups.enable=true drops groups whose responses all score alike, and "
                 f"actor_rollout_ref.rollout.n={rollout.n} makes every group one response; set "
                 "actor_rollout_ref.rollout.n >= 2 (DAPO: 16) or algorithm.filter_groups.enable=false")
    if fg.enable and cfg.trainer.total_training_steps is None:
        e.append("algorithm.filter_groups.enable=true uses a varying number of prompts per PPO step, so epochs do not "
                 "count steps; set trainer.total_training_steps")
    if fg.enable and fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        e.append("algorithm.filter_groups.metric=seq_final_reward: tripod applies the KL-in-reward penalty after "
                 "filtering; use metric=seq_reward (the same reward without the KL term) or acc")
    if not fg.enable and d.gen_batch_size != d.train_batch_size:
        e.append(f"data.gen_batch_size={d.gen_batch_size} differs from data.train_batch_size={d.train_batch_size} "
                 "but algorithm.filter_groups.enable=false; set algorithm.filter_groups.enable=true or drop "
                 "data.gen_batch_size")
    if ob.enable and not 0 < ob.len <= rollout.response_length:
        e.append(f"reward_model.overlong_buffer.len={ob.len} must be in (0, actor_rollout_ref.rollout.response_length="
                 f"{rollout.response_length}] with reward_model.overlong_buffer.enable=true (DAPO: 4096 of 20480)")
    return e


def _adapter_sync_problems(cfg: TripodConfig) -> list[str]:
    """lora.merge=false (adapters only to the rollout) where the rollout cannot serve LoRA."""
    lora, name = cfg.actor_rollout_ref.model.lora, cfg.actor_rollout_ref.rollout.name
    key = "actor_rollout_ref.model.lora.merge=false"
    if lora.rank <= 0 or lora.merge:
        return []
    if name != "vllm":
        return [f"{key} with rollout.name={name}: only the vLLM backend serves LoRA adapters (tripod's embedded and "
                "SGLang backends load merged weights); set actor_rollout_ref.rollout.name=vllm or lora.merge=true"]
    if cfg.separate_rollout:
        return [f"{key}: the rollout on its own ranks receives each weight version as full tensors over the bridge "
                "(engine/async_rollout/weights.py), which carries no adapters for their vLLM to serve; set "
                "lora.merge=true (merged weights, any backend)"]
    return []


def _async_problems(cfg: TripodConfig) -> list[str]:
    """The rollout's own ranks (`rollout.*`) and the staleness keys (`async_training.*`) against the rest; refused
    combinations each name the key to change (docs/async.md says why)."""
    r, a, rollout = cfg.rollout, cfg.async_training, cfg.actor_rollout_ref.rollout
    e = r.check()
    if not cfg.separate_rollout or e:
        return e
    e += a.check()
    rtp, mini = rollout.tensor_model_parallel_size, cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    if rtp >= 1 and r.ranks % rtp:
        e.append(f"rollout.nnodes x rollout.n_gpus_per_node = {r.ranks} rollout ranks do not split into TP groups of "
                 f"actor_rollout_ref.rollout.tensor_model_parallel_size={rtp}; use a multiple of {rtp} rollout ranks")
    if a.require_batches * mini != cfg.data.train_batch_size:
        e.append(f"async_training.require_batches x actor.ppo_mini_batch_size = {a.require_batches}x{mini} must equal "
                 f"data.train_batch_size={cfg.data.train_batch_size} (one trainer step); set async_training."
                 f"require_batches={max(cfg.data.train_batch_size // max(mini, 1), 1)}")
    refused = [("reward_model.enable=true with algorithm.filter_groups.enable=true",
                cfg.reward_model.enable and cfg.algorithm.filter_groups.enable,
                "the filter needs every row's final score before the batch leaves the rollout ranks, and the reward "
                "model scores on the trainer's ranks (engine/rewards/scorer.py); use one of the two, or colocate"),
               (f"actor_rollout_ref.rollout.name={rollout.name}", rollout.name not in ("embedded", "vllm", "sglang"),
                "use embedded, vllm or sglang")]
    e += [f"{key} with rollout on its own ranks (rollout.nnodes): {why}" for key, on, why in refused if on]
    partial_refused = [(f"actor_rollout_ref.rollout.name={rollout.name}", rollout.name != "embedded",
                        "only the embedded engine switches weights between two tokens; use embedded"),
                       ("actor_rollout_ref.rollout.multi_turn.enable=true", rollout.multi_turn.enable,
                        "a switch is placed by its decode step within one generate call, and a multi-turn row spans "
                        "several calls with tool and user tokens between them"),
                       ("algorithm.filter_groups.enable=true", cfg.algorithm.filter_groups.enable,
                        "a step's rows would come from several generation batches with their own switches"),
                       ("trainer.divergence_guard.enabled=true", cfg.trainer.divergence_guard.enabled,
                        "a rollback restarts the rollout where it waits for weights, which a partial rollout does "
                        "between two tokens of a batch")]
    e += [f"async_training.partial_rollout=true with {key}: {why}; or set async_training.partial_rollout=false"
          for key, on, why in partial_refused if a.partial_rollout and on]
    return e


def validate_config(cfg: TripodConfig | DictConfig, world_size: int) -> None:
    """Check `cfg` for a run on `world_size` ranks; raise one ConfigError listing every problem."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_object(cfg)
    d, arr, alg, tr = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    actor, rollout, ref, critic = arr.actor, arr.rollout, arr.ref, cfg.critic
    use_critic, use_ref = cfg.uses_critic, cfg.uses_reference

    e: list[str] = []
    if world_size < 1:
        e.append(f"world_size={world_size} must be >= 1")
        world_size = 1
    # each section's own checks; a model the run does not build is not checked
    e += d.check() + actor.check() + rollout.check() + alg.check() + cfg.reward_model.check() + tr.check()
    e += cfg.global_profiler.check(tr.device)
    e += critic.check() if use_critic else []
    e += ref.check() if use_ref else []
    e += arr.model.lora.check("actor_rollout_ref.model.lora") + (critic.model.lora.check("critic.model.lora")
                                                                  if use_critic else [])
    e += _adapter_sync_problems(cfg)

    if tr.n_gpus_per_node * tr.nnodes != world_size:
        e.append(f"trainer.n_gpus_per_node * trainer.nnodes = {tr.n_gpus_per_node}*{tr.nnodes} does not match the "
                 f"world size {world_size}; set trainer.n_gpus_per_node={world_size // max(tr.nnodes, 1)}")
    if not d.val_files and (tr.val_before_train or tr.test_freq > 0 or tr.val_only):
        e.append("data.val_files is empty but validation is on (trainer.val_before_train / trainer.test_freq / "
                 "trainer.val_only); give validation parquet files or set trainer.val_before_train=false "
                 "trainer.test_freq=-1 trainer.val_only=false")
    from tripod.engine.algorithms import OUTCOME_GROUP_ESTIMATORS  # need rollout.n >= 2

    if alg.adv_estimator in OUTCOME_GROUP_ESTIMATORS and rollout.n < 2:
        e.append(f"algorithm.adv_estimator={alg.adv_estimator} needs a group of responses per prompt; set "
                 f"actor_rollout_ref.rollout.n >= 2 (it is {rollout.n})")
    # the policy loss against rollout correction's bypass mode
    loss_key, loss_mode = "actor_rollout_ref.actor.policy_loss.loss_mode", actor.policy_loss.loss_mode
    if loss_mode == "bypass_mode" and not alg.rollout_correction.bypass_mode:
        e.append(f"{loss_key}=bypass_mode needs algorithm.rollout_correction.bypass_mode=true (the rollout's log-probs "
                 "as the old ones; verl sets this loss_mode from that key)")
    if alg.rollout_correction.bypass_mode and loss_mode not in ("vanilla", "bypass_mode"):
        e.append(f"algorithm.rollout_correction.bypass_mode=true runs verl's bypass_mode loss (PPO clip on the "
                 f"rollout's log-probs), not {loss_key}={loss_mode}; set loss_mode=vanilla or bypass_mode")

    e += _dapo_problems(cfg)
    e += _async_problems(cfg)
    from tripod.parallel.router_replay import replay_problems  # MoE routing replay keys

    e += replay_problems(cfg)

    # models and layouts
    _check_model(e, "actor_rollout_ref.model.path", arr.model.path)
    if use_critic:  # defaults to the actor's model
        _check_model(e, "critic.model.path", critic.model.path)
    layouts = [("actor_rollout_ref.actor", actor.megatron)]
    layouts += [("critic", critic.megatron)] if use_critic else []
    layouts += [("actor_rollout_ref.ref", ref.megatron)] if use_ref else []
    if cfg.reward_model.enable:
        _check_model(e, "reward_model.model.path", cfg.reward_model.model.path)
        layouts += [("reward_model", cfg.reward_model.megatron)]
    layout_ok = {key: _layout_fits(e, f"{key}.megatron", m, world_size) for key, m in layouts}
    # distillation: the teacher's keys, its own layout, the student's tokenizer
    e += cfg.distillation.check()
    if cfg.distillation.enabled and not e:
        from tripod.engine.config.distillation import tokenizer_problem

        name, teacher = cfg.distillation.teacher()
        _layout_fits(e, f"distillation.teacher_models.{name}.megatron", teacher.megatron, world_size)
        e += [p for p in [tokenizer_problem(cfg)] if p]

    for key, m in [("actor_rollout_ref.actor", actor)] + ([("critic", critic)] if use_critic else []):
        if m.megatron.use_distributed_optimizer and m.optim.optimizer != "adam":
            e.append(f"{key}.megatron.use_distributed_optimizer=true needs {key}.optim.optimizer=adam (megatron's "
                     "DistributedOptimizer supports Adam only); turn one of them off")
    e += precision_problems(cfg, world_size, [(f"{key}.megatron", m, key not in FROZEN) for key, m in layouts])

    # rollout TP groups partition the world (parallel/hybrid_engine: micro-DP groups when rollout TP divides the
    # actor's TP, else point-to-point regrouping across DP replicas / PP stages)
    rtp = rollout.tensor_model_parallel_size
    if rtp < 1 or world_size % rtp:
        e.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rtp} must divide the world size "
                 f"{world_size} (rollout DP = world / rollout TP); use one of "
                 f"{[x for x in range(1, world_size + 1) if world_size % x == 0]}")
    elif (d.train_batch_size * rollout.n) % (world_size // rtp):
        e.append(f"data.train_batch_size * rollout.n = {d.train_batch_size * rollout.n} responses do not split over "
                 f"the {world_size // rtp} rollout data-parallel groups; make it a multiple of {world_size // rtp}")

    # batch sizes per trained model (verl's divisibility rules)
    seq_len = d.max_prompt_length + rollout.response_length
    models = [("actor_rollout_ref.actor", actor)] + ([("critic", critic)] if use_critic else [])
    for key, m in models:
        if layout_ok.get(key, False):
            _check_batches(e, key, m.ppo_mini_batch_size, m.ppo_micro_batch_size_per_gpu, m.use_dynamic_bsz,
                           d.train_batch_size, rollout.n, m.megatron.data_parallel_size(world_size))
    budgets = [(f"{key}.ppo_max_token_len_per_gpu", m.ppo_max_token_len_per_gpu, m.use_dynamic_bsz)
               for key, m in models]
    budgets.append(("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                    rollout.log_prob_max_token_len_per_gpu, rollout.log_prob_use_dynamic_bsz))
    budgets.append(("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                    cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu,
                    cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz))
    if use_critic:
        budgets.append(("critic.forward_max_token_len_per_gpu", critic.forward_max_token_len_per_gpu,
                        critic.use_dynamic_bsz))
    for key, budget, on in budgets:
        if on and budget < seq_len:
            e.append(f"{key}={budget} is below one full sequence (data.max_prompt_length + rollout.response_length = "
                     f"{seq_len}); raise it to >= {seq_len}")

    if e:
        raise ConfigError(f"{len(e)} configuration problem(s):\n  - " + "\n  - ".join(e))


def precision_problems(cfg, world_size: int, models: list[tuple[str, MegatronConfig, bool]]) -> list[str]:
    """One line per bad precision / memory key (`megatron.param_dtype`, `recompute_*`, `*_offload`,
    `use_distributed_optimizer`, `optimizer_cpu_offload`, `rollout.dtype`; what they mean: parallel/precision.py and
    runtime/offload.py). `models`: (config key, MegatronConfig, trainable) of the models the run builds."""
    from tripod.engine.config import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS

    e: list[str] = []
    on_cpu = cfg.trainer.device != "cuda"
    for key, m, trainable in models:
        if m.param_dtype not in DTYPES:
            e.append(f"{key}.param_dtype={m.param_dtype!r} is not one of {list(DTYPES)}")
        if m.recompute_granularity is not None and m.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            e.append(f"{key}.recompute_granularity={m.recompute_granularity!r} is not one of "
                     f"{list(RECOMPUTE_GRANULARITIES)} (or null for off)")
        if m.recompute_method not in RECOMPUTE_METHODS:
            e.append(f"{key}.recompute_method={m.recompute_method!r} is not one of {list(RECOMPUTE_METHODS)}")
        if m.recompute_num_layers is not None:
            if m.recompute_granularity != "full":
                e.append(f"{key}.recompute_num_layers={m.recompute_num_layers} needs {key}.recompute_granularity=full;"
                         " set it to null or turn full recomputation on")
            elif m.recompute_num_layers < 1:
                e.append(f"{key}.recompute_num_layers={m.recompute_num_layers} must be >= 1 (or null for 1)")
        if on_cpu:  # the moves would save nothing: the "device" is host memory already
            e += [f"{key}.{name}=true moves {what} to host memory between phases on CUDA; this run computes on "
                  f"the CPU (trainer.device={cfg.trainer.device}), where they already live in host memory, so it "
                  "would save nothing: set it to false (`tripod plan ... trainer.device=cuda` shows what it saves)"
                  for name, what in (("param_offload", "parameters"), ("grad_offload", "gradient buffers"),
                                     ("optimizer_offload", "optimizer states"))
                  if getattr(m, name) and (trainable or name == "param_offload")]
        if not trainable:
            for name, value, default in (("use_distributed_optimizer", m.use_distributed_optimizer, None),
                                         ("grad_offload", m.grad_offload, False),
                                         ("optimizer_offload", m.optimizer_offload, False),
                                         ("optimizer_cpu_offload", m.optimizer_cpu_offload, False),
                                         ("recompute_granularity", m.recompute_granularity, None)):
                if value != default:
                    e.append(f"{key}.{name}={value} has no effect on a frozen model (no optimizer, no backward); "
                             f"leave it at {default}")
            continue
        if m.optimizer_cpu_offload:
            if on_cpu:
                e.append(f"{key}.optimizer_cpu_offload=true needs trainer.device=cuda (megatron's HybridDeviceOptimizer "
                         "runs on CUDA streams; on CPU the optimizer states already live in host memory); set it "
                         "to false")
            dist_opt = m.use_distributed_optimizer is not False  # null = auto: on at DP > 1 with Adam
            if not dist_opt or m.weight_replicas(world_size) <= 1:
                e.append(f"{key}.optimizer_cpu_offload=true needs the distributed optimizer (megatron offloads its "
                         f"shards); set {key}.use_distributed_optimizer=true")
        if m.optimizer_offload and m.optimizer_cpu_offload:
            e.append(f"{key}.optimizer_offload=true and {key}.optimizer_cpu_offload=true: the second already keeps "
                     "the optimizer states on the host; set one of them to false")
        if m.param_dtype == "fp16" and on_cpu:
            e.append(f"{key}.param_dtype=fp16 needs trainer.device=cuda (CPU kernels lack fp16 matmuls); use bf16 "
                     "or fp32 on CPU")
    rdt = cfg.actor_rollout_ref.rollout.dtype
    if rdt is not None and rdt not in DTYPES:
        e.append(f"actor_rollout_ref.rollout.dtype={rdt!r} is not one of {list(DTYPES)} (or null for bf16 "
                 "on CUDA, fp32 on CPU)")
    elif rdt == "fp16" and on_cpu:
        e.append("actor_rollout_ref.rollout.dtype=fp16 needs trainer.device=cuda; use bf16 or fp32 on CPU")
    if cfg.actor_rollout_ref.rollout.engine_kwargs and cfg.actor_rollout_ref.rollout.name == "embedded":
        e.append("actor_rollout_ref.rollout.engine_kwargs is only read by rollout.name=sglang / vllm; the embedded "
                 "engine takes no extra options, so leave it empty")
    return e
