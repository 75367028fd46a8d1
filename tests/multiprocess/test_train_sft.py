"""`tripod train-sft` end to end on a tiny Qwen2 and calculator conversations (tool calls, tool turns, multi-turn):
the loss tripod logs equals transformers' causal-LM loss (labels -100 outside the assistant tokens transformers'
own return_assistant_tokens_mask marks, token mean over the batch) at TP1, TP2 and PP2: train/loss of a step on the
weights a mid-run checkpoint holds, val/loss before training and on each run's export after it; the layouts train
alike (tests/helpers/trainer_runs.py's bounds); a TP2 Adam run resumed from its step-2 checkpoint ends
bit-identical, with trainer.max_ckpt_to_keep honoured. The runs are made once by the `runs` fixture (one torchrun
world per world size). (The random model's first losses are near log(vocab) whatever the mask: the checks on
trained weights are the sharp ones.)"""
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.ppo_setup import make_ppo_setup
from tests.helpers.sft_data import TOOL_TEMPLATE, make_sft_files
from tests.helpers.trainer_runs import (
    REL,
    OutOfBounds,
    metric_violations,
    train_in_world,
    train_in_worlds,
    weight_violations,
)

STEPS = 3
BATCH = 8
LAYOUTS = {"base": (1, 1, 1), "tp2": (2, 2, 1), "pp2": (2, 1, 2)}  # world, tp, pp
# Same arithmetic in every compared run: plain SGD (trainer_runs explains why not Adam), warm-up + cosine, 8
# conversations per step in micro-batches of 4 (packed without padding: short and long conversations share rows)
COMMON = [f"data.train_batch_size={BATCH}", "data.micro_batch_size_per_gpu=4", "data.max_length=256",
          "optim.optimizer=sgd", "optim.lr=0.05", "optim.weight_decay=0.0", "optim.lr_warmup_steps=1",
          "optim.lr_decay_style=cosine", "optim.min_lr_ratio=0.1", f"trainer.total_training_steps={STEPS}",
          "trainer.test_freq=1", "trainer.logger=[jsonl,tensorboard]"]
METRIC_SCALE = {"train/loss": 0.0, "val/loss": 0.0, "train/grad_norm": 0.0}  # means / norms of positive terms
EXACT = ("train/tokens",)
RESUME_STEPS = 4
RESUME = ("resume", (2, 2, 1), ["optim.optimizer=adam", "optim.lr=1e-2", "trainer.save_freq=1",
                                f"trainer.total_training_steps={RESUME_STEPS}", "trainer.max_ckpt_to_keep=3"])
TRAIN_SFT = ("train-sft", "recipes/sft/defaults.yaml")


def _overrides(setup, run_dir, world, tp, pp, *extra):
    return [f"model.path={setup['model']}", f"data.train_files=[{setup['train']}]", f"data.val_files=[{setup['val']}]",
            f"trainer.default_local_dir={run_dir}", f"trainer.n_gpus_per_node={world}",
            f"megatron.tensor_model_parallel_size={tp}", f"megatron.pipeline_model_parallel_size={pp}", *COMMON, *extra]


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def hf_loss(model_dir, conversations, tokenizer_dir=None) -> float:
    """transformers' loss of a batch of conversations: right-padded, labels -100 outside the assistant tokens of
    the template's {% generation %} blocks (transformers' return_assistant_tokens_mask), mean over those tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir or model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rendered = [tok.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                for c in conversations]
    width = max(len(r["input_ids"]) for r in rendered)
    ids = torch.zeros(len(rendered), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    attention = torch.zeros_like(ids)
    for i, r in enumerate(rendered):
        n, row = len(r["input_ids"]), torch.tensor(r["input_ids"])
        ids[i, :n], attention[i, :n] = row, 1
        labels[i, :n] = torch.where(torch.tensor(r["assistant_masks"]) > 0, row, -100)
    with torch.no_grad():
        return float(model(input_ids=ids, attention_mask=attention, labels=labels).loss)


def _check_close(label, got, want, problems):
    bound, diff = REL * abs(want), abs(got - want)
    if not diff <= bound:  # a NaN fails
        problems.append(f"{label}: tripod {got:.7g}, transformers {want:.7g}, |diff| {diff:.3g} > bound {bound:.3g}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("train_sft")
    setup = make_ppo_setup(tmp)
    tok = AutoTokenizer.from_pretrained(setup["model"])
    tok.chat_template = TOOL_TEMPLATE  # renders tool calls, marks assistant turns for transformers' mask
    tok.save_pretrained(setup["model"])
    setup.update(make_sft_files(tmp))
    dirs = {name: str(tmp / name) for name in LAYOUTS}
    plan = {name: (LAYOUTS[name][0], _overrides(setup, dirs[name], *LAYOUTS[name], "trainer.save_freq=1"), None)
            for name in LAYOUTS}
    name, layout, extra = RESUME
    dirs[name] = str(tmp / name)
    plan[name] = (layout[0], _overrides(setup, dirs[name], *layout, *extra), None)
    train_in_worlds(plan, str(tmp), command=TRAIN_SFT)  # one 1-rank world, one 2-rank world
    return setup, dirs, tmp


@pytest.mark.dist
def test_loss_equals_transformers_at_every_layout(runs, tmp_path):
    """Every run: step 1's train/loss (the initial weights on the first batch), step 0's val/loss (initial weights,
    every held-out conversation), the last val/loss (transformers on the run's export) and step 3's train/loss
    (transformers on the step-2 checkpoint, exported, and step 3's batch)."""
    from tests.helpers.trainer_runs import tripod_in_one_world
    from tripod.engine.reward_training.data import PairSchedule

    setup, dirs, _ = runs
    train, val = setup["train_conversations"], setup["val_conversations"]
    batch = lambda step: [train[i] for i in PairSchedule(len(train), BATCH, True, 1).batch(step)]  # noqa: E731
    want_train, want_val = hf_loss(setup["model"], batch(0)), hf_loss(setup["model"], val)
    step2 = {name: str(tmp_path / name) for name in dirs}
    tripod_in_one_world([["export", os.path.join(d, "checkpoints", "global_step_2", "actor"), step2[name]]
                         for name, d in dirs.items()], 1)
    problems = []
    for name, run_dir in dirs.items():
        m = _metrics(run_dir)
        _check_close(f"{name} step 1 train/loss", m[1]["train/loss"], want_train, problems)
        _check_close(f"{name} step 0 val/loss", m[0]["val/loss"], want_val, problems)
        _check_close(f"{name} step 3 train/loss", m[3]["train/loss"], hf_loss(step2[name], batch(2), setup["model"]), problems)
        _check_close(f"{name} last val/loss (export)", m[-1]["val/loss"], hf_loss(os.path.join(run_dir, "hf"), val),
                     problems)
        assert m[-1]["val/loss"] < m[0]["val/loss"] - 0.1, (name, m[0]["val/loss"], m[-1]["val/loss"])  # it learns
    assert not problems, "\n".join(problems)


@pytest.mark.dist
def test_every_layout_trains_like_one_rank(runs):
    setup, dirs, _ = runs
    w0 = load_file(os.path.join(setup["model"], "model.safetensors"))
    base_metrics, base_w = _metrics(dirs["base"]), load_file(os.path.join(dirs["base"], "hf", "model.safetensors"))
    for name in ("tp2", "pp2"):
        violations = metric_violations(base_metrics, _metrics(dirs[name]), METRIC_SCALE, EXACT)
        violations += weight_violations(w0, base_w, load_file(os.path.join(dirs[name], "hf", "model.safetensors")),
                                        STEPS)
        if violations:
            raise OutOfBounds(f"{name} vs one rank", violations)


@pytest.mark.dist
def test_resume_from_a_mid_run_checkpoint_is_exact(runs):
    """The TP2 Adam run kept its newest 3 checkpoints (trainer.max_ckpt_to_keep=3); run again from step 2 (the later
    checkpoints and the export removed, as a run killed after step 2 leaves it), it logs the same steps 3 and 4 and
    exports bit-identical weights (weights, Adam states, LR schedule and data order restored)."""
    setup, dirs, tmp = runs
    name, layout, extra = RESUME
    kept = ["global_step_2", "global_step_3", "global_step_4"]
    assert sorted(os.listdir(os.path.join(dirs[name], "checkpoints"))) == kept
    resumed = str(tmp / "resumed")
    shutil.copytree(dirs[name], resumed)
    for later in kept[1:]:
        shutil.rmtree(os.path.join(resumed, "checkpoints", later))
    shutil.rmtree(os.path.join(resumed, "hf"))
    proc = train_in_world(_overrides(setup, resumed, *layout, *extra), layout[0], os.path.join(tmp, "resumed.log"),
                          command=TRAIN_SFT)
    assert proc.returncode == 0 and "resumed from" in proc.stdout and "global_step_2" in proc.stdout, proc.stdout[-3000:]
    want, got = _metrics(dirs[name]), _metrics(resumed)
    assert [m["step"] for m in got] == list(range(RESUME_STEPS + 1)) and got[3:] == want[3:]
    a = load_file(os.path.join(dirs[name], "hf", "model.safetensors"))
    b = load_file(os.path.join(resumed, "hf", "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_input_is_one_line_before_any_model(tmp_path, capsys):
    """A file without the messages column, a conversation longer than data.max_length (truncation=error), a wrong
    truncation value, a chat template that drops tool calls: `tripod train-sft` exits 2 with one line naming the
    key or the file and row, and the run directory is never made (nothing was built)."""
    from transformers import AutoTokenizer

    from tests.helpers.sft_data import write_chat_parquet
    from tripod.engine.cli import main

    setup = make_ppo_setup(tmp_path)
    tok = AutoTokenizer.from_pretrained(setup["model"])
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(tmp_path / "tool_tokenizer")
    files = make_sft_files(tmp_path)
    wrong = write_chat_parquet(tmp_path / "wrong_key.parquet", files["train_conversations"], key="conversation")
    run_dir = tmp_path / "run"
    capsys.readouterr()  # the setup's progress bars
    base = [f"model.path={setup['model']}", f"trainer.default_local_dir={run_dir}", f"data.val_files=[{files['val']}]",
            f"data.tokenizer={tmp_path / 'tool_tokenizer'}"]
    cases = [([f"data.train_files=[{wrong}]"], r"wrong_key\.parquet: no column 'messages' \(data\.messages_key\)"),
             ([f"data.train_files=[{files['train']}]", "data.max_length=40"],
              r"sft_train\.parquet row \d+: \d+ tokens > data\.max_length=40 \(data\.truncation=error\)"),
             ([f"data.train_files=[{files['train']}]", "data.truncation=middle"],
              r"data\.truncation='middle' is not one of \['error', 'left', 'right'\]"),
             ([f"data.train_files=[{files['train']}]", "data.tokenizer=null"],  # the model's plain template
              r"sft_train\.parquet row \d+: message 1: the chat template does not render its tool call to 'calculator'")]
    for extra, pattern in cases:
        assert main(["train-sft", TRAIN_SFT[1], *base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(pattern, err), (pattern, err)
        assert not run_dir.exists()
