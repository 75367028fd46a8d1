"""`tripod bench`: the summary arithmetic on random records, the bench.json schema and token counts of a real run
on a tiny model, and the on-policy skip of the old log-prob recompute (same gradient; a planted bug is caught).
Timings are never asserted."""
import json
import os
import random
import subprocess
import sys

import pytest

from tests.helpers.common import REPO_ROOT, run_torchrun
from tests.helpers.ppo_setup import make_ppo_setup
from tripod.engine.bench.summary import check_schema, compare, summarize


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env


def _random_raw(rng, steps=5, warmup=2, world=2):
    recs = []
    for i in range(steps + warmup):
        stages = {k: rng.uniform(0.1, 3.0) for k in ("reshard", "gen", "reward", "update_actor")}
        recs.append({"index": i, "warmup": i < warmup, "step_s": sum(stages.values()) + rng.uniform(0.0, 0.5),
                     "stages_s": stages, "prompts": 8, "samples": 32, "prompt_tokens": rng.randint(500, 900),
                     "response_tokens": rng.randint(100, 512),
                     "flops": {"gen": rng.uniform(1e9, 1e11), "update_actor": rng.uniform(1e11, 1e12)}})
    ranks = [{"rank": r, "peak_memory_gb": rng.uniform(1, 6), "threads": 1, "peak_flops": rng.uniform(5e10, 1e11)}
             for r in range(world)]
    return {"records": recs, "ranks": ranks, "world_size": world}


def test_summary_arithmetic_on_random_records():
    rng = random.Random(1234)
    raw = _random_raw(rng)
    s = summarize(raw)
    measured = [r for r in raw["records"] if not r["warmup"]]
    total_s = sum(r["step_s"] for r in measured)
    tokens = sum(r["prompt_tokens"] + r["response_tokens"] for r in measured)
    assert s["steps"] == 5
    assert s["tokens_per_s"] == pytest.approx(tokens / total_s, rel=1e-12)
    assert s["tokens_per_s_per_device"] == pytest.approx(tokens / total_s / 2, rel=1e-12)
    assert s["samples_per_s"] == pytest.approx(32 * 5 / total_s, rel=1e-12)
    assert sum(v["share"] for v in s["stages"].values()) == pytest.approx(1.0, abs=1e-12)
    other = sorted(r["step_s"] - sum(r["stages_s"].values()) for r in measured)
    assert s["stages"]["other"]["median_s"] == pytest.approx(other[2], rel=1e-12)
    assert s["stages"]["gen"]["min_s"] == min(r["stages_s"]["gen"] for r in measured)
    ceiling = max(r["peak_flops"] for r in raw["ranks"])
    gen_mfu = sum(r["flops"]["gen"] for r in measured) / sum(r["stages_s"]["gen"] for r in measured) / 2 / ceiling
    assert s["mfu"]["gen"] == pytest.approx(gen_mfu, rel=1e-12)
    assert s["decode_tokens_per_s"] == pytest.approx(
        sum(r["response_tokens"] for r in measured) / sum(r["stages_s"]["gen"] for r in measured), rel=1e-12)
    assert s["peak_memory_gb_max"] == max(r["peak_memory_gb"] for r in raw["ranks"])
    peer = summarize(_random_raw(rng))
    ratios = compare(s, peer)
    assert ratios["throughput_ratio"] == pytest.approx(s["tokens_per_s"] / peer["tokens_per_s"], rel=1e-12)
    with pytest.raises(ValueError, match="--steps"):
        summarize({**raw, "records": [r for r in raw["records"] if r["warmup"]]})


def test_bench_on_a_tiny_model_writes_schema_and_counts_tokens(tmp_path):
    """A real `tripod bench` (GRPO, 2 measured steps) with the plain-HF peer: schema, token counts, outputs."""
    setup = make_ppo_setup(tmp_path)
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "tripod", "bench", "recipes/bench/smollm2-135m-grpo.yaml",
           f"actor_rollout_ref.model.path={setup['model']}", f"data.train_files={setup['train']}",
           "data.max_prompt_length=64", "data.max_response_length=6", "data.train_batch_size=2",
           "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
           "actor_rollout_ref.rollout.n=2", "--steps", "2", "--warmup", "1", "--out", str(out), "--baseline", "hf"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    doc = json.loads((out / "bench.json").read_text())
    check_schema(doc)
    assert [r["label"] for r in doc["runs"]] == ["tripod", "hf"]
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| tripod |" in (out / "bench.md").read_text() and "| tripod |" in proc.stdout

    # prompt tokens: the tiny char tokenizer's own count of the first 2+1 prompts, times n, per step
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(setup["model"])
    rows = pq.read_table(setup["train"]).to_pylist()
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows[:6]]
    lens = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    raw = json.loads((out / "runs" / "tripod" / "raw.json").read_text())
    for rec, start in zip(raw["records"], (0, 2, 4)):
        assert rec["prompt_tokens"] == 2 * sum(lens[start:start + 2])
        assert 4 <= rec["response_tokens"] <= 4 * 6 and rec["samples"] == 4
    for run in doc["runs"]:
        s = run["summary"]
        assert sum(v["share"] for v in s["stages"].values()) == pytest.approx(1.0, abs=1e-9)
        assert s["samples_per_step"] == 4 and s["steps"] == 2
    tripod = doc["runs"][0]
    assert tripod["on_policy_old_log_probs_skipped"] is True
    assert "old_log_prob" not in tripod["summary"]["stages"] and "update_actor" in tripod["summary"]["mfu"]
    hf_raw = json.loads((out / "runs" / "hf" / "raw.json").read_text())
    assert [r["prompt_tokens"] for r in hf_raw["records"]] == [r["prompt_tokens"] for r in raw["records"]]


def _on_policy_child(model: str, train: str) -> None:
    """In a 1-rank world: the same GRPO step with the skip, with the recompute forced, and with a planted bug."""
    import dataclasses

    import torch

    from tripod.engine.config import load_config
    from tripod.engine.trainer import PPOTrainer

    cfg = load_config(os.path.join(REPO_ROOT, "recipes/bench/smollm2-135m-grpo.yaml"), [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", "data.max_prompt_length=64",
        "data.max_response_length=6", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", "trainer.logger=[]", "trainer.save_freq=-1",
        "algorithm.adv_estimator=gae"])  # a random critic gives non-zero advantages; rewards here are all 0
    runs = {}
    for name in ("skip", "recompute", "planted"):
        torch.manual_seed(0)
        t = PPOTrainer(cfg)
        if name != "skip":  # the plan's decision overridden: the old-log-prob pass runs
            assert t.plan.old_log_probs == "update", t.plan
            t.plan = dataclasses.replace(t.plan, old_log_probs="recompute")
        if name == "planted":  # old log-probs that are not the current policy's: the ratio is no longer 1
            real = t.actor.compute_log_probs
            t.actor.compute_log_probs = lambda *a, **k: (real(*a, **k)[0] + 0.5, None)
        steps = []
        for _ in range(2):
            m = t.train_step(next(iter(t.loader)))
            t.step += 1
            steps.append({k: m[k] for k in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl",
                                            "response_length/mean", "critic/score/mean")})
            steps[-1]["old_recomputed"] = "timing_s/old_log_prob" in m
        runs[name] = steps
        t.rewards.close()
    print("RESULT " + json.dumps(runs), flush=True)


def test_on_policy_update_skips_the_recompute_with_the_same_gradient(tmp_path):
    setup = make_ppo_setup(tmp_path)
    proc = run_torchrun("on_policy_skip.py", 1, setup["model"], setup["train"], timeout=600)
    runs = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    skip, rec, bug = runs["skip"], runs["recompute"], runs["planted"]
    assert [s["old_recomputed"] for s in skip] == [False, False] and rec[0]["old_recomputed"]
    for a, b in zip(skip, rec):
        assert a["actor/ppo_kl"] == 0.0 and abs(b["actor/ppo_kl"]) < 1e-6
        # same responses after the first update means the weights moved alike
        assert a["response_length/mean"] == b["response_length/mean"] and a["critic/score/mean"] == b["critic/score/mean"]
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-4, abs=1e-7)
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], rel=1e-4, abs=1e-7)
    assert skip[0]["actor/grad_norm"] > 0
    # the planted bug changes the ratio and so the gradient: this comparison would catch a wrong old log-prob
    assert bug[0]["actor/grad_norm"] != pytest.approx(skip[0]["actor/grad_norm"], rel=1e-2)


@pytest.mark.peers
@pytest.mark.parametrize("mini_batch", [2, 1])
def test_trl_baseline_runs_and_counts_its_real_completions(tmp_path, mini_batch):
    """The TRL peer end to end on a tiny model (creates .venv-trl on first use, ~3 min): its records count the tokens
    of TRL's own completions and say how many samples had a non-zero advantage. With 2 mini-batches (mini_batch 1)
    TRL takes 2 optimizer steps per generation batch (steps_per_generation) and they make one record."""
    setup = make_ppo_setup(tmp_path)
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "tripod", "bench", "recipes/bench/smollm2-135m-grpo.yaml",
           f"actor_rollout_ref.model.path={setup['model']}", f"data.train_files={setup['train']}",
           "data.max_prompt_length=64", "data.max_response_length=6", "data.train_batch_size=2",
           f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}", "actor_rollout_ref.rollout.n=2",
           "--steps", "1", "--warmup", "0", "--out", str(out), "--baseline", "trl"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("WARNING") < 5, "pip's output leaked into the bench's"
    doc = json.loads((out / "bench.json").read_text())
    check_schema(doc)
    assert [r["label"] for r in doc["runs"]] == ["tripod", "trl"]
    (rec,) = json.loads((out / "runs" / "trl" / "raw.json").read_text())["records"]
    assert rec["samples"] == 4 and 4 <= rec["response_tokens"] <= 4 * 6  # EOS-ended or 6 tokens each
    assert 0.0 <= rec["score_mean"] <= 1.0 and 0.0 <= rec["nonzero_adv_frac"] <= 1.0
    trl = doc["runs"][1]["summary"]
    assert trl["nonzero_adv_frac"] == rec["nonzero_adv_frac"] and trl["threads_per_process"][0] >= 1


def test_sweep_terms_pair_up():
    from tripod.engine.cli.bench import parse_sweep

    assert parse_sweep(None) == [{}]
    assert parse_sweep("data.train_batch_size=8,16") == [{"data.train_batch_size": "8"}, {"data.train_batch_size": "16"}]
    assert parse_sweep("trainer.n_gpus_per_node=2,1 rollout.n_gpus_per_node=0,1") == [
        {"trainer.n_gpus_per_node": "2", "rollout.n_gpus_per_node": "0"},
        {"trainer.n_gpus_per_node": "1", "rollout.n_gpus_per_node": "1"}]
    with pytest.raises(ValueError, match="as many values"):
        parse_sweep("a=1,2 b=1")


def test_bench_puts_sync_beside_the_rollout_on_its_own_rank(tmp_path):
    """`tripod bench --sweep` pairs the synchronous run on 2 ranks with 1 trainer + 1 rollout rank (docs/async.md):
    the same prompts and token counts (the rollout ranks draw what the trainer's loader would), the world of both
    kinds counted per device."""
    setup = make_ppo_setup(tmp_path)
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "tripod", "bench", "recipes/bench/smollm2-135m-grpo.yaml",
           f"actor_rollout_ref.model.path={setup['model']}", f"data.train_files={setup['train']}",
           "data.max_prompt_length=64", "data.max_response_length=6", "data.train_batch_size=2",
           "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
           "actor_rollout_ref.rollout.n=2", "async_training.staleness_threshold=1", "--steps", "2", "--warmup", "1",
           "--out", str(out), "--sweep", "trainer.n_gpus_per_node=2,1 rollout.n_gpus_per_node=0,1"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    doc = json.loads((out / "bench.json").read_text())
    check_schema(doc)
    labels = [r["label"] for r in doc["runs"]]
    assert labels == ["tripod-trainer.n_gpus_per_node=2,rollout.n_gpus_per_node=0",
                      "tripod-trainer.n_gpus_per_node=1,rollout.n_gpus_per_node=1"], labels
    raws = [json.loads((out / "runs" / label / "raw.json").read_text()) for label in labels]
    assert [r["world_size"] for r in raws] == [2, 2] and [r["rollout_ranks"] for r in raws] == [0, 1]
    assert [rec["prompt_tokens"] for rec in raws[0]["records"]] == [rec["prompt_tokens"] for rec in raws[1]["records"]]
    assert all("wait_rollout" in rec["stages_s"] for rec in raws[1]["records"])
