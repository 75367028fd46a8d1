"""Config: defaults, YAML + override merging, saving, and validation errors that name their keys."""
import os

import pytest
from omegaconf import OmegaConf

from tripod.engine.config import ConfigError, TripodConfig, load_config, save_resolved_config
from tripod.engine.config_validation import validate_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




# A valid 4-rank run: actor TP2 (DP2), critic/ref follow the actor, rollout TP2 (2 generation groups).
VALID = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n=2",
         "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
         "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=4",
         "actor_rollout_ref.actor.use_kl_loss=true"]


def test_defaults_load_with_verl_values_and_interpolations():
    cfg = load_config(None, [])
    assert isinstance(cfg, TripodConfig)
    assert cfg.data.prompt_key == "prompt" and cfg.data.train_files == [] and cfg.algorithm.adv_estimator == "gae"
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == cfg.actor_rollout_ref.actor.clip_ratio == 0.2
    assert cfg.actor_rollout_ref.rollout.response_length == cfg.data.max_response_length
    assert cfg.trainer.default_local_dir == "outputs/tripod/run"
    assert cfg.trainer.logger == ["console", "jsonl", "tensorboard"]
    assert cfg.critic.optim.lr == 1e-5 and cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.actor_rollout_ref.actor.target_kl is None and cfg.data.reward_fn_key == "data_source"


def test_recipes_defaults_yaml_matches_the_dataclasses():
    with open(os.path.join(REPO, "recipes", "defaults.yaml")) as f:
        on_disk = OmegaConf.create(f.read())
    assert on_disk == OmegaConf.structured(TripodConfig), "regenerate: python -m tripod.engine.config > recipes/defaults.yaml"


def test_yaml_and_overrides_merge_in_order(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("data:\n  train_files: a.parquet\n  train_batch_size: 64\n"
                      "actor_rollout_ref:\n  actor:\n    clip_ratio: 0.1\n    megatron:\n"
                      "      pipeline_model_parallel_size: 2\n"
                      "trainer:\n  experiment_name: demo\n  logger: [console]\n")
    cfg = load_config(recipe, ["data.train_batch_size=32", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                               "critic.megatron.tensor_model_parallel_size=2"])
    assert cfg.data.train_files == ["a.parquet"]  # a single path becomes a list
    assert cfg.data.train_batch_size == 32  # the override beats the YAML
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 0.1 and cfg.actor_rollout_ref.actor.clip_ratio_high == 0.28
    assert cfg.actor_rollout_ref.ref.megatron.pipeline_model_parallel_size == 2  # ref follows the actor
    assert cfg.critic.megatron.pipeline_model_parallel_size == 2 and cfg.critic.megatron.tensor_model_parallel_size == 2
    assert cfg.trainer.default_local_dir == "outputs/tripod/demo" and cfg.trainer.logger == ["console"]
    assert cfg.data.max_prompt_length == 512  # untouched keys keep their defaults
    saved = save_resolved_config(cfg, tmp_path / "run")
    assert load_config(saved, []) == cfg


def test_unknown_keys_and_bad_values_are_named(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("data:\n  train_batch_sise: 4\nalgorithm:\n  kl_ctrl:\n    kl_coeff: 0.1\ncritc: {}\n")
    with pytest.raises(ConfigError) as err:
        load_config(recipe, [])
    message = str(err.value)
    assert str(recipe) in message
    assert "data.train_batch_sise: unknown key; did you mean 'data.train_batch_size'?" in message
    assert "algorithm.kl_ctrl.kl_coeff: unknown key; did you mean 'algorithm.kl_ctrl.kl_coef'?" in message
    assert "critc: unknown key; did you mean 'critic'?" in message
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.temprature: unknown key; did you mean "
                                          r"'actor_rollout_ref\.rollout\.temperature'"):
        load_config(None, ["actor_rollout_ref.rollout.temprature=0.7"])
    with pytest.raises(ConfigError, match=r"bad value for data\.train_batch_size: Value 'many'"):
        load_config(None, ["data.train_batch_size=many"])
    with pytest.raises(ConfigError, match=r"not of the form key=value"):
        load_config(None, ["data.shuffle"])
    with pytest.raises(ConfigError, match=r"reward_model\.reward_fn_key: not a tripod key; .* set data\.reward_fn_key"):
        load_config(None, ["reward_model.reward_fn_key=source"])
    # the profiler's keys are verl's (the seeds' `global_profiler.steps=[1,5,10]`); tripod's old spelling is refused
    profiled = load_config(None, ["global_profiler.steps=[1,5,10]", "global_profiler.tool=torch"])
    assert profiled.global_profiler.steps == [1, 5, 10] and profiled.global_profiler.tool == "torch"
    for old, new in (("trainer.profile_steps=[1]", "global_profiler.steps"), ("trainer.profile_tool=nsys",
                                                                             "global_profiler.tool")):
        with pytest.raises(ConfigError, match=rf"{old.split('=')[0]}: not a tripod key; .* set {new} instead"):
            load_config(None, [old])
    with pytest.raises(ConfigError, match="missing.yaml does not exist"):
        load_config(tmp_path / "missing.yaml", [])


def test_a_valid_config_passes(run_files):
    validate_config(load_config(None, run_files + VALID), world_size=4)
    grpo = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "trainer.device=cuda"]
    validate_config(load_config(None, run_files + VALID + grpo), world_size=4)
    dynamic = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
               "critic.ppo_micro_batch_size_per_gpu=2", "data.val_batch_size=3",
               "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
               "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"]
    validate_config(load_config(None, run_files + VALID + dynamic), world_size=4)


@pytest.mark.parametrize("overrides, world_size, expected", [
    (["data.train_batch_size=6"], 4, "data.train_batch_size=6 is not divisible by "
                                     "actor_rollout_ref.actor.ppo_mini_batch_size=4"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], 4,
     "4 responses per rank is not divisible by actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=1", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=1"],
     4, "actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n = 1*1 = 1 responses do not split over "
        "data-parallel size 2"),
    (["critic.ppo_micro_batch_size_per_gpu=3"], 4, "critic.ppo_micro_batch_size_per_gpu=3"),
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3", "actor_rollout_ref.rollout."
      "tensor_model_parallel_size=1"], 4, "actor_rollout_ref.actor.megatron: tensor_model_parallel_size * "
                                          "pipeline_model_parallel_size = 3*1 = 3 does not divide the world size 4"),
    (["critic.megatron.pipeline_model_parallel_size=8"], 4, "critic.megatron: tensor_model_parallel_size"),
    (["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=8"], 4, "actor_rollout_ref.ref.megatron"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=8"], 4,
     "actor_rollout_ref.rollout.tensor_model_parallel_size=8 must divide the world size 4"),
    (["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"], 4,
     "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2 needs"),
    (["trainer.n_gpus_per_node=2"], 4, "trainer.n_gpus_per_node * trainer.nnodes = 2*1"),
    (["data.train_files=/no/such/train.parquet"], 4, "data.train_files: file /no/such/train.parquet does not exist"),
    (["data.val_files=[]"], 4, "data.val_files is empty but validation is on"),
    (["actor_rollout_ref.model.path=/no/model"], 4, "actor_rollout_ref.model.path=/no/model has no config.json"),
    (["algorithm.adv_estimator=ppo2"], 4, "algorithm.adv_estimator='ppo2' is not one of ['gae', 'gdpo'"),
    (["algorithm.kl_penalty=k9"], 4, "algorithm.kl_penalty='k9' is not one of"),
    (["actor_rollout_ref.actor.kl_loss_type=kl9"], 4, "actor_rollout_ref.actor.kl_loss_type='kl9'"),
    (["actor_rollout_ref.rollout.name=trtllm"], 4, "actor_rollout_ref.rollout.name='trtllm' is not one of "
                                                    "['embedded', 'sglang', 'vllm']"),
    (["data.max_prompt_length=0"], 4, "data.max_prompt_length=0 must be a positive integer"),
    (["data.max_response_length=-5"], 4, "data.max_response_length=-5 must be a positive integer"),
    (["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=8"], 4,
     "algorithm.adv_estimator=grpo needs a group of responses per prompt; set actor_rollout_ref.rollout.n >= 2"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100"], 4,
     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100 is below one full sequence"),
    (["actor_rollout_ref.actor.loss_agg_mode=mean"], 4, "actor_rollout_ref.actor.loss_agg_mode='mean'"),
    (["trainer.logger=[console,neptune]"], 4, "trainer.logger has unknown backends ['neptune']"),
    (["global_profiler.steps=[0,3]"], 4, "global_profiler.steps=[0, 3] must hold PPO step numbers >= 1"),
    (["global_profiler.tool=nsys", "global_profiler.steps=[2]"], 4,
     "global_profiler.tool=nsys records CUDA ranges; use global_profiler.tool=torch on cpu"),
    (["trainer.max_actor_ckpt_to_keep=0"], 4, "trainer.max_actor_ckpt_to_keep=0 must be >= 1 (null: keep every"),
    (["trainer.max_critic_ckpt_to_keep=-2"], 4, "trainer.max_critic_ckpt_to_keep=-2 must be >= 1"),
    (["trainer.log_val_generations=-1"], 4, "trainer.log_val_generations=-1 must be >= 0 (0: none)"),
    (["trainer.resume=/no/ckpt"], 4, "trainer.resume='/no/ckpt' is neither"),
    (["algorithm.kl_ctrl.type=pid"], 4, "algorithm.kl_ctrl.type='pid'"),
    (["actor_rollout_ref.rollout.top_p=0"], 4, "actor_rollout_ref.rollout.top_p=0.0 must be in (0, 1]"),
    (["actor_rollout_ref.actor.target_kl=0"], 4, "actor_rollout_ref.actor.target_kl=0.0 must be > 0"),
    (["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
      "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=100"], 4,
     "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=100 is below one full sequence"),
    (["actor_rollout_ref.actor.optim.lr_decay_style=exponential"], 4,
     "actor_rollout_ref.actor.optim.lr_decay_style='exponential' is not one of ['constant', 'linear', 'cosine']"),
    (["critic.optim.lr_warmup_steps_ratio=1.0"], 4, "critic.optim.lr_warmup_steps_ratio=1.0 must be in [0, 1)"),
    (["critic.optim.min_lr_ratio=2"], 4, "critic.optim.min_lr_ratio=2.0 must be in [0, 1]"),
    (["data.val_batch_size=0"], 4, "data.val_batch_size=0 must be >= 1"),
    (["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=0"], 4,
     "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=0 must be >= 1"),
    (["algorithm.rollout_correction.rollout_is=tokens"], 4,
     "algorithm.rollout_correction.rollout_is='tokens' is not one of ['token', 'sequence', 'auto', None]"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=0"], 4,
     "algorithm.rollout_correction.rollout_is_threshold=0.0 must be > 0"),
    (["algorithm.rollout_correction.rollout_rs=seq_mean_k3"], 4,
     "algorithm.rollout_correction.rollout_rs=seq_mean_k3 needs algorithm.rollout_correction.rollout_rs_threshold"),
    (["algorithm.rollout_correction.rollout_rs=seq_mean_k3", "algorithm.rollout_correction.rollout_rs_threshold=-0.1"],
     4, "algorithm.rollout_correction.rollout_rs_threshold=-0.1 must be > 0"),
    (["algorithm.rollout_correction.rollout_rs=seq_mean_k1", "algorithm.rollout_correction.rollout_rs_threshold=0.5"],
     4, "algorithm.rollout_correction.rollout_rs_threshold=0.5 must be > 1 with rollout_rs=seq_mean_k1"),
    (["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=sequence"], 4,
     "algorithm.rollout_correction.bypass_mode=true skips the old-log-prob recompute that "
     "algorithm.rollout_correction.rollout_is=sequence needs"),
])
def test_each_validation_error_names_its_key(run_files, overrides, world_size, expected):
    cfg = load_config(None, run_files + VALID + overrides)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size)
    assert expected in str(err.value)
    assert isinstance(err.value, ValueError)


def test_all_problems_are_reported_at_once(run_files):
    cfg = load_config(None, run_files + VALID + ["data.train_batch_size=6", "algorithm.adv_estimator=nope",
                                                 "actor_rollout_ref.rollout.name=trtllm", "data.max_prompt_length=0"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, 4)
    message = str(err.value)
    assert message.startswith("4 configuration problem(s):")
    for key in ("data.train_batch_size=6", "algorithm.adv_estimator='nope'", "actor_rollout_ref.rollout.name='trtllm'",
                "data.max_prompt_length=0"):
        assert key in message
