"""`tripod train-rm` end to end on a tiny Qwen2 (fresh score head) and preference pairs + ranked lists: the same
training at TP2, PP2 and DP2 as on one rank (within the arithmetic's bound, tests/helpers/trainer_runs.py), an exact
resume from a mid-run checkpoint, and an export that transformers loads as Qwen2ForSequenceClassification and that
scores like the trained model. The module's runs are made once by the `runs` fixture (the runs of one world size in
one torchrun world, tests/helpers/trainer_runs.py's train_in_worlds); the tests assert on their outputs."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.ppo_setup import make_ppo_setup
from tests.helpers.preference_data import make_preference_files
from tests.helpers.trainer_runs import REL, OutOfBounds, train_in_world, train_in_worlds, weight_violations

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_rm")
    setup = make_ppo_setup(tmp)
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
        got = _metrics(dirs[name])
        violations = []
        for a, b in zip(base_metrics, got):
            assert a["step"] == b["step"]
            for k, scale in METRIC_SCALE.items():
                if k in a:
                    bound, diff = REL * (abs(a[k]) + scale), abs(b[k] - a[k])
                    if diff > bound:
                        violations.append((diff / bound, f"step {a['step']} {k}: {b[k]} vs {a[k]} (bound {bound:.3g})"))
            for k in ("train/accuracy", "val/accuracy"):  # functions of score orderings: identical unless a tie
                if k in a and a[k] != b[k]:
                    violations.append((float("inf"), f"step {a['step']} {k}: {b[k]} vs {a[k]}"))
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
def test_the_export_is_an_hf_classifier_that_reproduces_the_validation(runs):
    """transformers loads `<run>/hf` as Qwen2ForSequenceClassification; its pairwise accuracy on the validation
    pairs equals the run's last val/accuracy, and its mean margin matches val/margin to fp32 (1e-5)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tripod.engine.reward_training.config import PreferenceDataConfig
    from tripod.engine.reward_training.data import preference_pairs

    setup, dirs, _ = runs
    hf = os.path.join(dirs["dp2"], "hf")
    model = AutoModelForSequenceClassification.from_pretrained(hf, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    tok = AutoTokenizer.from_pretrained(hf)
    pairs = preference_pairs([setup["val"]], tok, PreferenceDataConfig())
    with torch.no_grad():
        score = lambda ids: float(model(input_ids=torch.tensor([ids])).logits[0, 0])  # noqa: E731
        margins = torch.tensor([score(c) - score(r) for c, r in pairs], dtype=torch.float64)
    last = _metrics(dirs["dp2"])[-1]
    assert float((margins > 0).double().mean()) == last["val/accuracy"]
    assert float(margins.mean()) == pytest.approx(last["val/margin"], abs=1e-5)
