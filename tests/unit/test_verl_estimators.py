"""The advantage estimators tripod takes from verl 0.9.1 beyond its first five (grpo_vectorized, grpo_passk, gdpo, opo,
gpg, rloo_vectorized) against verl's own compute_*_outcome_advantage (verl.trainer.ppo.core_algos, a reference:
tests/helpers/verl_reference.py) on fresh random rewards, with groups of 4, a group of one (where the estimator
allows it), continuous and 0/1 scores, and ragged masks; the refused ones are refused by name with their reason; and
planted bugs break the comparison."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.verl_reference import verl_core_algos
from tripod.engine.algorithms import REFUSED_ESTIMATORS, compute_advantage, list_adv_estimators, verl_estimators
from tripod.engine.config.algorithm import AlgorithmConfig

TOL = 2e-5  # verl's vectorised estimators reduce in float32


@pytest.fixture(scope="module")
def core_algos():
    return verl_core_algos()[0]


def rewards(seed: int, binary: bool, singleton: bool, T: int = 7):
    """(token rewards [B, T] float32, zero outside the mask; mask; group ids as verl's numpy uid array)."""
    g = torch.Generator().manual_seed(seed)
    groups = [4, 4, 4] + ([1] if singleton else [])
    index = np.array([f"uid-{k}" for k, n in enumerate(groups) for _ in range(n)], dtype=object)
    B = len(index)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    scores = (torch.rand(B, generator=g) < 0.5).float() if binary else torch.randn(B, generator=g)
    token_rewards = torch.zeros(B, T)
    token_rewards[torch.arange(B), lengths - 1] = scores  # the outcome reward on the last response token
    return token_rewards, mask, index


def verl_call(core_algos, name: str, token_rewards, mask, index, norm_by_std: bool):
    if name == "grpo_vectorized":
        return core_algos.compute_grpo_vectorized_outcome_advantage(token_rewards, mask, index,
                                                                    norm_adv_by_std_in_grpo=norm_by_std)
    if name == "grpo_passk":
        return core_algos.compute_grpo_passk_outcome_advantage(token_rewards, mask, index,
                                                               config={"norm_adv_by_std_in_grpo": norm_by_std})
    if name == "gdpo":
        return core_algos.compute_gdpo_outcome_advantage(token_rewards, mask, index, norm_adv_by_std_in_grpo=norm_by_std)
    fn = {"opo": core_algos.compute_opo_outcome_advantage, "gpg": core_algos.compute_gpg_outcome_advantage,
          "rloo_vectorized": core_algos.compute_rloo_vectorized_outcome_advantage}[name]
    return fn(token_rewards, mask, index)


CASES = [(name, nb) for name in ("grpo_vectorized", "grpo_passk", "gdpo") for nb in (True, False)] + \
        [(name, True) for name in ("opo", "gpg", "rloo_vectorized")]


def estimator_gap(core_algos, name: str, norm_by_std: bool, seed: int, binary: bool) -> float:
    singleton = name != "grpo_passk"  # Pass@k needs >= 2 responses per prompt (verl raises too)
    token_rewards, mask, index = rewards(seed, binary, singleton)
    options = {"norm_by_std": norm_by_std} if name in verl_estimators.NORM_BY_STD_ESTIMATORS else {}
    adv, ret = compute_advantage(name, token_rewards.clone(), mask, index=list(index), **options)
    want_adv, want_ret = verl_call(core_algos, name, token_rewards.clone(), mask, index, norm_by_std)
    scale = max(1.0, float(want_adv.abs().max()))
    return max(float((adv - want_adv).abs().max()), float((ret - want_ret).abs().max())) / scale


@pytest.mark.parametrize("name,norm_by_std", CASES)
def test_estimator_matches_verl(core_algos, name, norm_by_std):
    for seed, binary in ((0, False), (1, True), (2, False)):
        err = estimator_gap(core_algos, name, norm_by_std, seed, binary)
        assert err <= TOL, f"{name} norm_by_std={norm_by_std} seed={seed} binary={binary}: error {err:.3g}"


def test_every_verl_estimator_is_registered_or_refused(core_algos):
    verl_names = set(core_algos.ADV_ESTIMATOR_REGISTRY)
    assert verl_names == set(list_adv_estimators()) | set(REFUSED_ESTIMATORS), verl_names ^ (
        set(list_adv_estimators()) | set(REFUSED_ESTIMATORS))
    for name, reason in REFUSED_ESTIMATORS.items():
        errors = AlgorithmConfig(adv_estimator=name).check()
        assert errors == [f"algorithm.adv_estimator={name} is refused: {reason}"]
    (unknown,) = AlgorithmConfig(adv_estimator="nope").check()
    assert "grpo_passk" in unknown and "nope" in unknown


def test_grpo_passk_refuses_a_group_of_one():
    token_rewards, mask, index = rewards(3, False, singleton=True)
    with pytest.raises(ValueError, match="at least 2 responses per prompt"):
        compute_advantage("grpo_passk", token_rewards, mask, index=list(index))


_GROUP_MEAN_STD = verl_estimators.group_mean_std


def _population_std(scores, ids, num_groups):
    mean, std, size = _GROUP_MEAN_STD(scores, ids, num_groups)
    return mean, std * torch.sqrt((size - 1).clamp(min=1) / size), size


def _one_group(scores, index):
    return torch.zeros(len(scores), dtype=torch.long, device=scores.device), 1


@pytest.mark.parametrize("plant,attr,bug,name", [
    ("population_std", "group_mean_std", _population_std, "grpo_passk"),
    ("groups_merged", "_groups", _one_group, "opo"),
    ("groups_merged", "_groups", _one_group, "rloo_vectorized"),
])
def test_planted_bug_is_caught(core_algos, monkeypatch, plant, attr, bug, name):
    monkeypatch.setattr(verl_estimators, attr, bug)
    assert estimator_gap(core_algos, name, True, 0, False) > 1e-2, f"planted {plant} went unnoticed in {name}"
