"""`tripod train-rm` end to end on a tiny Qwen2 (fresh score head) and preference pairs + ranked lists: the same
training at TP2, PP2 and DP2 as on one rank (within the arithmetic's bound, tests/helpers/trainer_runs.py), an exact
resume from a mid-run checkpoint, and an export that transformers loads as Qwen2ForSequenceClassification and that
scores every sequence as tripod does, though the tokenizer pads with its EOS (as SmolLM2's does). The module's runs are made once by the `runs` fixture (the runs of one world size in
one torchrun world, tests/helpers/trainer_runs.py's train_in_worlds); the tests assert on their outputs."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.ppo_setup import make_ppo_setup
from tests.helpers.preference_data import make_preference_files
from tests.helpers.trainer_runs import (
    OutOfBounds,
    metric_violations,
    train_in_world,
    train_in_worlds,
    weight_violations,
)

STEPS = 3
LAYOUTS = {"base": (1, 1, 1), "tp2": (2, 2, 1), "pp2": (2, 1, 2), "dp2": (2, 1, 1)}  # world, tp, pp
# Same arithmetic in every run: plain SGD (megatron's momentum 0.9; see trainer_runs for why not Adam), a warm-up +
# cosine LR schedule, 4 pairs per step in one-pair micro-batches. lr 0.05 moves every matrix >= 10x its fp32 rounding.
COMMON = ["data.train_batch_size=4", "data.micro_batch_size_per_gpu=1", "data.shuffle=true", "optim.optimizer=sgd",
          "optim.lr=0.05", "optim.weight_decay=0.0", "optim.lr_warmup_steps=1", "optim.lr_decay_style=cosine",
          "optim.min_lr_ratio=0.1", f"trainer.total_training_steps={STEPS}", "trainer.test_freq=1",
          "trainer.logger=[jsonl,tensorboard]"]
# train/loss is a mean of softplus values (positive terms: no cancellation); the margin a mean of differences of
# scores of magnitude < 1 (scale 1, as pg_loss in trainer_runs)
METRIC_SCALE = {"train/loss": 0.0, "train/margin": 1.0, "val/loss": 0.0, "val/margin": 1.0, "train/grad_norm": 0.0}
EXACT = ("train/accuracy", "val/accuracy")  # functions of score orderings: identical unless a tie


RESUME = ["optim.optimizer=adam", "optim.lr=1e-3", "trainer.save_freq=1"]


TRAIN_RM = ("train-rm", "recipes/reward_model/defaults.yaml")


def _overrides(setup, run_dir, world, tp, pp, *extra):
    return [f"model.path={setup['model']}", f"data.train_files=[{setup['train']}]", f"data.val_files=[{setup['val']}]",
            f"trainer.default_local_dir={run_dir}", f"trainer.n_gpus_per_node={world}",
            f"megatron.tensor_model_parallel_size={tp}", f"megatron.pipeline_model_parallel_size={pp}", *COMMON, *extra]


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _initial_weights(model_dir):
    """The run's w_0: the causal LM's weights without its LM head, and the score head megatron's ValueHead draws
    (seeded by megatron.seed, 42)."""
    from tripod.parallel.model import ValueHead

    w0 = {k: v for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items() if k != "lm_head.weight"}
    w0["score.weight"] = ValueHead(64, torch.float32, False, None, seed=42, bias=False).weight.detach()
    return w0


def _pad_with_eos(model_dir):
    """The tokenizer pads with its EOS, as SmolLM2's (make demo-rm's model) and many others do: the export must still
    be scored at the EOS tripod trains on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.eos_token
    tok.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_rm")
    setup = make_ppo_setup(tmp)
    _pad_with_eos(setup["model"])
    setup.update(make_preference_files(tmp))
    dirs = {name: str(tmp / name) for name in LAYOUTS}
    plan = {name: (LAYOUTS[name][0], _overrides(setup, dirs[name], *LAYOUTS[name]), None) for name in LAYOUTS}
    # the resume run: Adam (whose states the checkpoint must restore; tripod's checkpoints hold Adam's, not SGD's
    # momentum) and a checkpoint per step
    dirs["resume"] = str(tmp / "resume")
    plan["resume"] = (LAYOUTS["tp2"][0], _overrides(setup, dirs["resume"], *LAYOUTS["tp2"], *RESUME), None)
    train_in_worlds(plan, str(tmp), command=TRAIN_RM)  # one 1-rank world, one 2-rank world
    return setup, dirs, tmp


@pytest.mark.dist
def test_every_layout_trains_like_one_rank(runs):
    setup, dirs, _ = runs
    w0 = _initial_weights(setup["model"])
    base_metrics, base_w = _metrics(dirs["base"]), load_file(os.path.join(dirs["base"], "hf", "model.safetensors"))
    assert set(base_w) == set(w0) and "score.weight" in base_w
    assert [m["step"] for m in base_metrics] == [0, 1, 2, 3]
    assert base_metrics[-1]["train/loss"] < base_metrics[1]["train/loss"]  # it learns
    for name in ("tp2", "pp2", "dp2"):
        violations = metric_violations(base_metrics, _metrics(dirs[name]), METRIC_SCALE, EXACT)
        violations += weight_violations(w0, base_w, load_file(os.path.join(dirs[name], "hf", "model.safetensors")),
                                        STEPS)
        if violations:
            raise OutOfBounds(f"{name} vs one rank", violations)


@pytest.mark.dist
def test_resume_from_a_mid_run_checkpoint_is_exact(runs):
    """A TP2 Adam run again from its step-2 checkpoint (step 3's checkpoint and export removed): the same step-3
    metrics and bit-identical exported weights (weights, Adam states, LR schedule and data order restored)."""
    setup, dirs, tmp = runs
    resumed = str(tmp / "resumed")
    shutil.copytree(dirs["resume"], resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "global_step_3"))
    shutil.rmtree(os.path.join(resumed, "hf"))
    proc = train_in_world(_overrides(setup, resumed, *LAYOUTS["tp2"], *RESUME), LAYOUTS["tp2"][0],
                          os.path.join(tmp, "resumed.log"), command=TRAIN_RM)
    assert proc.returncode == 0 and "resumed from" in proc.stdout and "global_step_2" in proc.stdout, proc.stdout[-3000:]
    want, got = _metrics(dirs["resume"]), _metrics(resumed)
    assert [m["step"] for m in got] == [0, 1, 2, 3] and got[3] == want[3]
    a = load_file(os.path.join(dirs["resume"], "hf", "model.safetensors"))
    b = load_file(os.path.join(resumed, "hf", "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.dist
def test_the_export_scores_in_transformers_as_in_tripod(runs, tmp_path):
    """transformers loads `<run>/hf` as Qwen2ForSequenceClassification with a pad token that is not the EOS (the
    tokenizer trained with pads with its EOS). Its scores of every validation sequence, in one batch right-padded by
    the exported tokenizer, equal tripod's scores of the export (the scorer validation uses) within 1e-5 each; and
    per prompt (a ranking's 3 pairs weighing 1/3 each: reward_model.ranking_weight=per_prompt, the default) they give
    the run's last val/accuracy, val/margin and val/loss."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tests.helpers.common import run_torchrun
    from tripod.engine.reward_training.config import PreferenceDataConfig
    from tripod.engine.reward_training.data import preference_pairs

    setup, dirs, _ = runs
    hf = os.path.join(dirs["dp2"], "hf")
    model = AutoModelForSequenceClassification.from_pretrained(hf, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    tok = AutoTokenizer.from_pretrained(hf)
    assert model.config.pad_token_id == tok.pad_token_id != tok.eos_token_id
    pairs = preference_pairs([setup["val"]], tok, PreferenceDataConfig())
    seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    batch = tok.pad({"input_ids": seqs}, return_tensors="pt")
    assert tok.padding_side == "right" and (batch["attention_mask"] == 0).any()  # some rows really are padded
    with torch.no_grad():
        hf_scores = model(**batch).logits[:, 0].double()
    (tmp_path / "seqs.json").write_text(json.dumps(seqs))
    run_torchrun("rm_scores.py", 1, hf, tmp_path / "seqs.json", tmp_path / "scores.json", timeout=300)
    tripod_scores = torch.tensor(json.loads((tmp_path / "scores.json").read_text()), dtype=torch.float64)
    diff = float((hf_scores - tripod_scores).abs().max())
    assert diff <= 1e-5, f"max |transformers - tripod| = {diff} over {len(seqs)} sequences"

    chosen, rejected = hf_scores.chunk(2)
    per_prompt, i = [], 0  # the closed form: a row's pairs are consecutive, C(N,2) of them
    while i < len(pairs):
        n = pairs[i].responses * (pairs[i].responses - 1) // 2
        c, r = chosen[i:i + n], rejected[i:i + n]
        per_prompt.append(((c > r).double().mean(), (c - r).mean(), torch.nn.functional.softplus(r - c).mean()))
        i += n
    assert any(pairs[j].responses == 3 for j in range(len(pairs)))  # the validation set holds rankings
    accuracy, margin, loss = (float(sum(x[k] for x in per_prompt) / len(per_prompt)) for k in range(3))
    last = _metrics(dirs["dp2"])[-1]
    assert accuracy == pytest.approx(last["val/accuracy"], abs=1e-12)
    assert abs(margin - last["val/margin"]) <= 1e-5 and abs(loss - last["val/loss"]) <= 1e-5, (margin, loss, last)
