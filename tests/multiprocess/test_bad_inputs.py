"""Bad launches and inputs, one table: each row stops in config/preflight (in-process, before any model or
process) with one line naming the key or file, or continues where that is right (a scorer that raises or hangs
scores 0 and is counted). An existing checkpoint in the run directory is byte-for-byte unchanged after every row."""
import errno
import hashlib
import json
import os
import shutil
import subprocess
import time

import pytest

from tests.helpers.common import REPO_ROOT, make_tiny_hf_model
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tripod.engine.launch import Launch, detect_launch, error_line
from tripod.engine.preflight import prepare_train
from tripod.engine.rewards import RewardPool, register_reward

RECIPE = str(REPO_ROOT / "recipes" / "defaults.yaml")
LOCAL = Launch("local", 0)


@register_reward("test_raises")
def _raises(solution_str, ground_truth, extra_info=None):
    raise ZeroDivisionError("scorer bug")


@register_reward("test_hangs")
def _hangs(solution_str, ground_truth, extra_info=None):
    time.sleep(60)
    return 1.0


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The tiny setup, a real checkpoint of a *different* model (Llama, 2 layers) and a run directory holding it."""
    from tripod.engine.cli import main

    tmp = tmp_path_factory.mktemp("bad")
    setup = make_ppo_setup(tmp)
    other = make_tiny_hf_model(tmp, "llama", num_hidden_layers=2, vocab_size=128)
    run_dir = tmp / "run"
    step = run_dir / "checkpoints" / "global_step_1"
    assert main(["convert", other, str(step / "actor")]) == 0
    (step / "COMPLETE").write_text("1\n")
    (step / "trainer_state.json").write_text(json.dumps({"step": 1, "world_size": 1}))
    return dict(setup=setup, tmp=tmp, run_dir=str(run_dir), other_ckpt=str(step))


def _digest(root):
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            h.update(path.encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def _parquet(e, name, table=None, raw=None):
    path = str(e["tmp"] / name)
    if raw is not None:
        with open(path, "wb") as f:
            f.write(raw)
    else:
        import pyarrow.parquet as pq
        pq.write_table(table, path)
    return path


def _model_copy(e, name, mutate):
    dst = str(e["tmp"] / name)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(e["setup"]["model"], dst)
    mutate(dst)
    return dst


def _truncate(d):
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _garbage_header(d):
    with open(os.path.join(d, "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 16)


def _bad_generation_config(d):
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": "<eos>"}, f)


def _no_column(e):
    import pyarrow as pa
    return _parquet(e, "nocol.parquet", pa.table({"prompt": ["1+1?"], "data_source": ["arithmetic"]}))


def _empty(e):
    import pyarrow as pa
    return _parquet(e, "empty.parquet", pa.table({
        "prompt": pa.array([], pa.string()), "data_source": pa.array([], pa.string()),
        "reward_model": pa.array([], pa.struct([("ground_truth", pa.string())]))}))


def _unknown_source(e):
    from tripod.engine.data import write_prompt_parquet
    path = str(e["tmp"] / "unknown_source.parquet")
    write_prompt_parquet([{"data_source": "nope", "prompt": [{"role": "user", "content": "1+1?"}],
                           "reward_model": {"ground_truth": "2"}}] * 8, path)
    return path


def _null_ground_truth(e):
    """Two of eight rows with a null reward_model.ground_truth: str(None) would be trained on with reward 0."""
    from tripod.engine.data import write_prompt_parquet
    path = str(e["tmp"] / "null_truth.parquet")
    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"{i}+1?"}],
             "reward_model": {"ground_truth": None if i in (3, 6) else str(i + 1)}} for i in range(8)]
    write_prompt_parquet(rows, path)
    return path


RECIPE_TEXTS = {"recipe_key_typo": "trainer:\n  total_trainig_steps: 3\n",
                "recipe_not_yaml": "trainer:\n  total_training_steps: 3\n   save_freq: [1\n"}


def _recipe(e, row):
    path = str(e["tmp"] / f"{row}.yaml")
    with open(path, "w") as f:
        f.write(RECIPE_TEXTS[row])
    return path


# id -> (overrides or a function of the fixture returning them, launch, expected text in the one line)
ROWS = {
    "torchrun_world_too_big": ([], Launch("torchrun", 4, 0, 0, 2, 2), "trainer.nnodes=2 trainer.n_gpus_per_node=2"),
    "torchrun_nodes_swapped": (["trainer.n_gpus_per_node=2"], Launch("torchrun", 2, 0, 0, 1, 2),
                               "trainer.nnodes=2 trainer.n_gpus_per_node=1"),
    "srun_task_count": (["trainer.n_gpus_per_node=2"], detect_launch({
        "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "3"}), "srun with 3 tasks"),
    "recipe_key_typo": ("recipe", LOCAL, "did you mean 'trainer.total_training_steps'"),
    "recipe_not_yaml": ("recipe", LOCAL, "recipe_not_yaml.yaml is not valid YAML at line 3"),
    "override_key_typo": (["actor_rollout_ref.actor.clip_ration=0.1"], LOCAL,
                          "did you mean 'actor_rollout_ref.actor.clip_ratio'"),
    "override_wrong_type": (["data.train_batch_size=many"], LOCAL, "data.train_batch_size"),
    "override_without_equals": (["trainer.total_training_steps"], LOCAL, "key=value"),
    "tp_not_dividing_kv_heads": (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                                  "trainer.n_gpus_per_node=4"], LOCAL, "tensor_model_parallel_size"),
    "pp_not_dividing_layers": (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=8",
                                "trainer.n_gpus_per_node=8"], LOCAL, "pipeline_model_parallel_size"),
    "uneven_stages_not_summing": (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                                   "actor_rollout_ref.actor.megatron.num_layers_in_first_pipeline_stage=1",
                                   "actor_rollout_ref.actor.megatron.num_layers_in_last_pipeline_stage=2",
                                   "trainer.n_gpus_per_node=2"], LOCAL,
                                  "actor_rollout_ref.actor.megatron.num_layers_in_first_pipeline_stage=1 + "
                                  "num_layers_in_last_pipeline_stage=2 = 3 must sum to num_hidden_layers=4"),
    "uneven_middle_stages_not_dividing": (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4",
                                           "actor_rollout_ref.actor.megatron.num_layers_in_first_pipeline_stage=2",
                                           "trainer.n_gpus_per_node=4"], LOCAL,
                                          "leave 2 of num_hidden_layers=4 layers for the 3 middle stage(s)"),
    "world_not_multiple_of_tp": (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                  "trainer.n_gpus_per_node=3"], LOCAL, "tensor_model_parallel_size"),
    "world_not_multiple_of_cp": (["actor_rollout_ref.actor.megatron.context_parallel_size=2",
                                  "trainer.n_gpus_per_node=3"], LOCAL,
                                 "tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size"),
    "cp_with_transformer_engine": (["actor_rollout_ref.actor.megatron.context_parallel_size=2",
                                    "actor_rollout_ref.actor.megatron.use_te=true", "trainer.n_gpus_per_node=2"],
                                   LOCAL, "actor_rollout_ref.actor.megatron.context_parallel_size=2 with use_te=true "
                                   "runs Transformer Engine's CP attention, which needs TE and CUDA"),
    "mini_batch_not_dividing": (["actor_rollout_ref.actor.ppo_mini_batch_size=3"], LOCAL, "ppo_mini_batch_size"),
    "rollout_tp_not_dividing": (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], LOCAL,
                                "tensor_model_parallel_size"),
    "unknown_adv_estimator": (["algorithm.adv_estimator=ppo2"], LOCAL, "algorithm.adv_estimator"),
    "stop_id_outside_vocab": (["actor_rollout_ref.rollout.stop_token_ids=[5,128]"], LOCAL,
                              "actor_rollout_ref.rollout.stop_token_ids=[5, 128]: [128] outside the model's vocabulary"),
    "generation_config_eos_not_ids": (lambda e: [
        f"actor_rollout_ref.model.path={_model_copy(e, 'bad_generation_config', _bad_generation_config)}"], LOCAL,
        "generation_config.json: eos_token_id='<eos>' must be a token id or a list of token ids"),
    "missing_parquet": (lambda e: [f"data.train_files={e['tmp']}/nowhere.parquet"], LOCAL, "nowhere.parquet"),
    "corrupt_parquet": (lambda e: [f"data.train_files={_parquet(e, 'corrupt.parquet', raw=os.urandom(2048))}"],
                        LOCAL, "corrupt.parquet is not a readable parquet"),
    "parquet_missing_column": (lambda e: [f"data.train_files={_no_column(e)}"], LOCAL,
                               "no column 'reward_model.ground_truth'"),
    "empty_parquet": (lambda e: [f"data.train_files={_empty(e)}"], LOCAL, "empty.parquet is empty"),
    "null_ground_truth": (lambda e: [f"data.train_files={_null_ground_truth(e)}"], LOCAL,
                          "null_truth.parquet: 2 of 8 rows have no reward_model.ground_truth"),
    "unknown_data_source": (lambda e: [f"data.train_files={_unknown_source(e)}"], LOCAL, "no reward function"),
    "prompts_too_long": (["data.max_prompt_length=4"], LOCAL, "data.max_prompt_length"),
    "model_path_missing": (lambda e: [f"actor_rollout_ref.model.path={e['tmp']}/no_model"], LOCAL,
                           "actor_rollout_ref.model.path"),
    "truncated_safetensors": (lambda e: [f"actor_rollout_ref.model.path={_model_copy(e, 'trunc', _truncate)}"],
                              LOCAL, "model.safetensors is truncated"),
    "corrupt_safetensors": (lambda e: [f"actor_rollout_ref.model.path={_model_copy(e, 'garbage', _garbage_header)}"],
                            LOCAL, "not a readable safetensors file"),
    "tokenizer_missing": (lambda e: [f"data.tokenizer={e['tmp']}/no_tokenizer"], LOCAL, "data.tokenizer"),
    "resume_other_model": (lambda e: [f"trainer.resume={e['other_ckpt']}"], LOCAL, "holds a different model"),
    "resume_not_a_checkpoint": (lambda e: [f"trainer.resume={e['tmp']}"], LOCAL, "not a complete tripod checkpoint"),
    "guard_without_checkpoints": (["trainer.divergence_guard.enabled=true", "trainer.save_freq=-1"], LOCAL,
                                  "trainer.save_freq"),
    "read_only_run_dir": ("read_only", LOCAL, "is not writable"),
    # the project venv has no vLLM (a vLLM venv says the tiny model's head_dim 16 has no CPU kernel): same key
    "rollout_vllm_unavailable": (["actor_rollout_ref.rollout.name=vllm"], LOCAL, "actor_rollout_ref.rollout.name=vllm"),
    "filter_groups_one_response": (["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=1"], LOCAL,
                                   "actor_rollout_ref.rollout.n=1 makes every group one response; set "
                                   "actor_rollout_ref.rollout.n >= 2"),
    "rollout_correction_bypass_with_rejection": (["algorithm.rollout_correction.bypass_mode=true",
                                                  "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
                                                  "algorithm.rollout_correction.rollout_rs_threshold=0.01"], LOCAL,
                                                 "algorithm.rollout_correction.bypass_mode=true skips the old-log-prob "
                                                 "recompute that algorithm.rollout_correction.rollout_rs=seq_mean_k3 "
                                                 "needs"),
    "rollout_correction_threshold_not_positive": (["algorithm.rollout_correction.rollout_is=token",
                                                   "algorithm.rollout_correction.rollout_is_threshold=-2"], LOCAL,
                                                  "algorithm.rollout_correction.rollout_is_threshold=-2.0 must be > 0"),
}


def _forbid_heavy_work(monkeypatch) -> None:
    """Preflight must refuse before any process group, model or rank process exists."""
    import torch.distributed as dist

    import tripod.parallel.model as model

    def heavy(what):
        def refuse(*a, **k):
            raise AssertionError(f"{what} started before the input was checked")
        return refuse
    monkeypatch.setattr(dist, "init_process_group", heavy("torch.distributed.init_process_group"))
    monkeypatch.setattr(model, "build_gpt_model", heavy("build_gpt_model"))
    monkeypatch.setattr(subprocess, "Popen", heavy("a rank process"))


@pytest.mark.parametrize("row", sorted(ROWS))
def test_bad_input_stops_in_preflight_with_one_line(env, row, monkeypatch):
    overrides, launch, expect = ROWS[row]
    recipe, run_dir = RECIPE, env["run_dir"]
    args = tiny_overrides(env["setup"], run_dir)
    if overrides == "recipe":
        recipe = _recipe(env, row)
    elif overrides == "read_only":
        os.chmod(run_dir, 0o555)
        if os.geteuid() == 0:  # root writes through file modes: simulate the read-only mount at the OS call
            real_open = os.open

            def read_only_open(path, *a, **k):
                if str(path).startswith(run_dir):
                    raise OSError(errno.EROFS, "Read-only file system", path)
                return real_open(path, *a, **k)
            monkeypatch.setattr(os, "open", read_only_open)
    else:
        args += overrides(env) if callable(overrides) else overrides
    before = _digest(run_dir)
    _forbid_heavy_work(monkeypatch)
    try:
        with pytest.raises(Exception) as info:
            prepare_train(recipe, args, launch)
    finally:
        os.chmod(run_dir, 0o755)
    line = error_line(info.value)
    assert expect in line, line
    assert "\n" not in line and "Traceback" not in line
    from tripod.engine.launch import USER_ERRORS
    assert isinstance(info.value, USER_ERRORS), type(info.value)  # printed as this one line by `tripod`
    assert _digest(run_dir) == before, "the existing checkpoint changed"


def test_good_input_passes_the_same_checks(env):
    cfg, world = prepare_train(RECIPE, tiny_overrides(env["setup"], env["run_dir"]), LOCAL)
    assert world == 1 and cfg.trainer.default_local_dir == env["run_dir"]


@pytest.mark.parametrize("source,status", [("test_raises", "reward/num_errors"), ("test_hangs", "reward/num_timeouts")])
def test_broken_scorer_scores_zero_and_training_continues(source, status):
    """A scorer that raises or hangs must not stop training: 0 for that sample, counted in the metrics."""
    with RewardPool(num_workers=1, timeout_s=0.5) as pool:
        start = time.time()
        scores, metrics = pool.score(["#### 2", "#### 3"], ["2", "3"], ["arithmetic", source])
    assert scores == [1.0, 0.0] and metrics[status] == 1.0
    assert time.time() - start < 30
