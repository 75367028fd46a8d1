"""A reward model (HF `*ForSequenceClassification`, one label) in tripod: the megatron GPTModel with the family
table's `score` row scores like transformers (fp32, 1e-5) at (1,1,1), TP2 and PP2, and exports back to the same HF
tensors (Llama untied, Qwen2 with tie_word_embeddings=true, which a classification model ignores); the PPO loop's
`RewardModelWorker.score` (engine/workers/reward_model.py) reads the same scores at TP2xDP2 and PP2xDP2."""
import json
import re

import pytest
import torch

from tests.helpers.bounds import worst
from tests.helpers.common import make_tiny_hf_model, run_torchrun

FLOAT = r"(-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf)"
MODELS = {"llama_rm": ("llama", {}), "qwen2_rm_tied": ("qwen2", {"tie_word_embeddings": True})}
LAYOUTS = ["TP1PP1DP1", "TP2PP1DP1", "TP1PP2DP1"]


def _right_padded_batch(seed: int, vocab: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4 rows of random lengths, right-padded with `pad`; real tokens never equal `pad` (HF scores the last
    non-pad token)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [17, 9, 23, 12]
    ids = torch.full((len(lengths), max(lengths)), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


@pytest.mark.dist
def test_reward_scores_match_transformers_and_export_round_trips(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    cases, originals = [], {}
    for seed, (name, (family, overrides)) in enumerate(MODELS.items()):
        hf_dir = make_tiny_hf_model(tmp_path, family, seed=seed + 7, subdir=name, sequence_classification=True,
                                    **overrides)
        model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
        ids, mask = _right_padded_batch(seed, model.config.vocab_size, model.config.pad_token_id)
        with torch.no_grad():
            ref = model(input_ids=ids).logits.squeeze(-1)  # HF: the logit at the last non-pad token
        assert ref.abs().min() > 1e-3  # scores are not trivially zero
        cases.append({"name": name, "hf_dir": hf_dir, "input_ids": ids, "attention_mask": mask, "ref_scores": ref})
        originals[name] = (load_file(f"{hf_dir}/model.safetensors"), json.load(open(f"{hf_dir}/config.json")))
    torch.save(cases, tmp_path / "cases.pt")
    out = run_torchrun("rm_parity_worker.py", 4, tmp_path / "cases.pt", tmp_path / "exported", timeout=400).stdout

    seen = {(m.group(1), m.group(2)) for m in re.finditer(r"RM_PARITY (\S+) (\S+) maxdiff", out)}
    assert seen == {(m, lay) for m in MODELS for lay in LAYOUTS}, out[-3000:]
    assert worst(re.findall(rf"RM_PARITY \S+ \S+ maxdiff {FLOAT}", out)) < 1e-5
    worker = re.findall(rf"RM_WORKER \S+ \S+ rank \d maxdiff {FLOAT}", out)  # the PPO loop's scorer, every rank
    assert len(worker) == len(MODELS) * 2 * 4 and worst(worker) < 1e-5, out[-3000:]
    exports = re.findall(r"RM_EXPORT (\S+) (\S+) (\S+)", out)
    assert len(exports) == 2 * len(MODELS), out[-3000:]
    for name, _, target in exports:
        weights, config = originals[name]
        back = load_file(f"{target}/model.safetensors")
        assert set(back) == set(weights) and "score.weight" in back and "lm_head.weight" not in back
        for k, t in weights.items():
            assert torch.equal(back[k], t), k
        assert json.load(open(f"{target}/config.json"))["architectures"] == config["architectures"]
