"""`tripod convert` / `tripod export` and dist-checkpoint resharding, end to end on gloo.

One module-scoped HF -> TP2xPP2 conversion (4 spawned processes) feeds most tests here; a reward model
(Qwen2ForSequenceClassification) makes the convert -> export round trip at TP2xPP2, and a critic checkpoint exports
as a one-label classifier that transformers scores like tripod's values.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.common import REPO_ROOT, make_tiny_hf_model, run_torchrun

pytestmark = pytest.mark.dist


def _tripod(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "tripod", *args], cwd=REPO_ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Qwen2 (GQA, QKV bias, tied embeddings, vocab 300: padded 384 at TP1, 512 at TP2) -> TP2xPP2."""
    root = tmp_path_factory.mktemp("convert")
    hf_dir = make_tiny_hf_model(root, "qwen2", seed=11, tie_word_embeddings=True, vocab_size=300)
    (Path(hf_dir) / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    ckpt = root / "ckpt_tp2pp2"
    proc = _tripod("convert", hf_dir, str(ckpt), "--tp", "2", "--pp", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, hf_dir, ckpt


def test_convert_export_round_trip_bit_exact(converted):
    import transformers

    root, hf_dir, ckpt = converted
    meta = json.loads((ckpt / "tripod_checkpoint.json").read_text())
    assert meta["saved_layout"] == {"tp": 2, "pp": 2, "dp": 1} and meta["saved_padded_vocab_size"] == 512
    out = root / "exported"
    proc = _tripod("export", str(ckpt), str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert (out / "tokenizer_config.json").exists()
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert back.config.tie_word_embeddings and back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, back(ids).logits)


@pytest.fixture(scope="module")
def resharded(converted, tmp_path_factory):
    """The reshard worker's run (tests/multiprocess/workers/ckpt_convert_reshard.py): (its output, its work dir)."""
    root, hf_dir, ckpt = converted
    tmp_path = tmp_path_factory.mktemp("reshard")
    llama_dir = make_tiny_hf_model(tmp_path, "llama", seed=12, tie_word_embeddings=False, vocab_size=300)
    proc = run_torchrun("ckpt_convert_reshard.py", 4, str(ckpt), hf_dir, llama_dir, str(tmp_path), timeout=400)
    return proc, tmp_path


def test_checkpoint_reshards_to_every_layout(resharded):
    proc, _ = resharded
    print("\n".join(line for line in proc.stdout.splitlines() if "] OK " in line))  # shown by pytest -rP
    for what in ("TP1xPP1", "TP1xPP2", "TP2xPP1", "TP2xPP2"):
        assert proc.stdout.count(f"OK qwen2 ckpt(TP2xPP2) -> {what}") == 4, proc.stdout[-3000:]
    assert proc.stdout.count("OK llama ckpt TP2xPP1 -> TP1xPP2") == 4
    assert proc.stdout.count("OK llama") == 8
    assert proc.stdout.count("OK tied qwen2 HF -> TP1xPP2") == 4
    assert proc.stdout.count("OK critic ckpt TP2xPP2 -> TP1xPP1") == 2


def test_a_critic_exports_as_a_classifier(resharded):
    """`tripod export` of a critic checkpoint (value head with a bias, on a causal LM's config) writes a one-label
    Qwen2ForSequenceClassification whose `score` is the value head: transformers' score of each row plus the bias
    (HF's score has none; config.json keeps it as tripod_value_bias and the CLI says so) is tripod's value at the
    row's last token, within 1e-5."""
    import transformers

    _, work = resharded
    out = work / "critic_hf"
    proc = _tripod("export", str(work / "critic"), str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Qwen2ForSequenceClassification" in proc.stdout and "value-head bias 0.375" in proc.stdout, proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["tripod_value_bias"] == 0.375
    assert "score.weight" in load_file(out / "model.safetensors")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.num_labels == 1
    saved = torch.load(work / "critic_values.pt")
    diffs = []
    for row, values in zip(saved["ids"], saved["values"]):
        # HF reads the rightmost token that is not its pad; the prefix ending there (causal: the same value in tripod)
        last = int(torch.nonzero(row != model.config.pad_token_id).max())
        with torch.no_grad():
            score = model(input_ids=row[None, :last + 1]).logits[0, 0]
        diffs.append(abs(float(score) + config["tripod_value_bias"] - float(values[last])))
    assert all(d <= 1e-5 for d in diffs), f"|HF score + bias - tripod value| = {diffs}"


def test_a_reward_model_converts_and_exports_bit_exact(tmp_path):
    """HF Qwen2ForSequenceClassification -> `tripod convert --tp 2 --pp 2` -> `tripod export --tp 2 --pp 2` (one
    4-rank world): every tensor bit for bit, the same architecture, labels and pad token, and transformers' scores
    of a right-padded batch identical."""
    import transformers

    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", seed=13, vocab_size=300, subdir="rm", sequence_classification=True)
    ckpt, out = tmp_path / "ckpt", tmp_path / "exported"
    commands = [["convert", hf_dir, str(ckpt), "--tp", "2", "--pp", "2"], ["export", str(ckpt), str(out), "--tp", "2",
                                                                        "--pp", "2"]]
    proc = run_torchrun("tripod_commands.py", 4, json.dumps(commands), timeout=400)
    assert "TRIPOD_COMMAND_OK 1" in proc.stdout, proc.stdout[-3000:]
    original, exported = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(original) and "score.weight" in exported
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    want, got = json.loads(Path(hf_dir, "config.json").read_text()), json.loads((out / "config.json").read_text())
    for key in ("architectures", "id2label", "pad_token_id", "eos_token_id"):
        assert got.get(key) == want.get(key), key
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
    back = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, 300, (3, 16), generator=torch.Generator().manual_seed(4))
    ids[0, 11:], ids[1, 5:] = want["pad_token_id"], want["pad_token_id"]  # right padding
    with torch.no_grad():
        a, b = ref(input_ids=ids).logits, back(input_ids=ids).logits
    assert a.shape == (3, 1) and torch.equal(a, b)


def _cli_error(capsys, *argv: str) -> str:
    from tripod.engine.cli import main

    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_bad_inputs_are_one_clear_line(converted, tmp_path, capsys):
    root, hf_dir, ckpt = converted
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    config = json.loads(Path(hf_dir, "config.json").read_text())

    def variant(name: str, tensors: dict, cfg: dict) -> str:
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d)

    gpt2 = variant("gpt2", state, {**config, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    assert "model_type='gpt2'" in _cli_error(capsys, "convert", gpt2, str(tmp_path / "o1"))
    missing = variant("missing", {k: v for k, v in state.items() if k != "model.layers.2.mlp.up_proj.weight"},
                      config)
    err = _cli_error(capsys, "convert", missing, str(tmp_path / "o2"), "--tp", "2")
    assert "missing 1 tensor(s): model.layers.2.mlp.up_proj.weight" in err, err
    extra = variant("extra", {**state, "model.layers.0.self_attn.q_norm.weight": torch.randn(16)}, config)
    err = _cli_error(capsys, "convert", extra, str(tmp_path / "o3"))
    assert "unexpected 1 tensor(s): model.layers.0.self_attn.q_norm.weight" in err, err
    err = _cli_error(capsys, "convert", hf_dir, str(tmp_path / "o4"), "--tp", "4")
    assert "--tp 4" in err and "num_key_value_heads=2" in err, err
    err = _cli_error(capsys, "convert", hf_dir, str(tmp_path / "o5"), "--pp", "3")
    assert "--pp 3" in err and "num_hidden_layers=4" in err, err
    err = _cli_error(capsys, "convert", str(tmp_path / "nowhere"), str(tmp_path / "o6"))
    assert "nowhere" in err and "config.json" in err, err

    err = _cli_error(capsys, "export", str(tmp_path / "no_ckpt"), str(tmp_path / "o7"))
    assert "no_ckpt does not exist" in err, err
    err = _cli_error(capsys, "export", hf_dir, str(tmp_path / "o8"))
    assert "not a tripod checkpoint" in err, err
    err = _cli_error(capsys, "convert", hf_dir, hf_dir)  # would write into the HF model dir
    assert "not a tripod checkpoint" in err and "new or empty directory" in err, err
    half = tmp_path / "half"
    (half / "model").mkdir(parents=True)
    err = _cli_error(capsys, "export", str(half), str(tmp_path / "o9"))
    assert "half-written" in err, err
    # and as a real console process: one line on stderr, exit code 2, no traceback
    proc = _tripod("export", str(tmp_path / "no_ckpt"), str(tmp_path / "o10"), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("tripod export: error:") and "no_ckpt" in proc.stderr
