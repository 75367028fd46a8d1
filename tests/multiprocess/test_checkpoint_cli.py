"""`tripod convert` / `tripod export` and dist-checkpoint resharding, end to end on gloo.

One module-scoped HF -> TP2xPP2 conversion (4 spawned processes) feeds every test here.
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


def test_checkpoint_reshards_to_every_layout(converted, tmp_path):
    root, hf_dir, ckpt = converted
    llama_dir = make_tiny_hf_model(tmp_path, "llama", seed=12, tie_word_embeddings=False, vocab_size=300)
    proc = run_torchrun("ckpt_convert_reshard.py", 4, str(ckpt), hf_dir, llama_dir, str(tmp_path), timeout=400)
    print("\n".join(line for line in proc.stdout.splitlines() if "] OK " in line))  # shown by pytest -rP
    for what in ("TP1xPP1", "TP1xPP2", "TP2xPP1", "TP2xPP2"):
        assert proc.stdout.count(f"OK qwen2 ckpt(TP2xPP2) -> {what}") == 4, proc.stdout[-3000:]
    assert proc.stdout.count("OK llama ckpt TP2xPP1 -> TP1xPP2") == 4
    assert proc.stdout.count("OK llama") == 8
    assert proc.stdout.count("OK tied qwen2 HF -> TP1xPP2") == 4
    assert proc.stdout.count("OK critic ckpt TP2xPP2 -> TP1xPP1") == 2


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
