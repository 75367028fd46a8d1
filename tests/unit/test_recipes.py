"""The shipped recipes: every YAML under recipes/ loads and passes the config checks (a `tripod train-rm` recipe,
named `*reward-model.yaml`, against train-rm's schema; a `tripod train-sft` one, `*-sft.yaml`, against train-sft's; a
multi-turn tool config, `*-tools.yaml`, builds its tools as the trainer does), and the Qwen3-8B dense recipe plans to fit one 8 x 80 GB node
with the architecture from recipes/model_configs/ (no weights, no hub), its parameter rows checked against an
independent count."""
from __future__ import annotations

import pytest

from tests.helpers.common import REPO_ROOT

# recipes/launch_*.yaml are cluster manifests (KubeRay, SkyPilot) that run a recipe: tests/unit/test_launch_examples.py
ALL = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "recipes").rglob("*.yaml")
             if p.name != "defaults.yaml" and not p.name.startswith("launch_"))
RM_RECIPES = [r for r in ALL if r.endswith("reward-model.yaml")]  # tripod train-rm's (engine/reward_training/config.py)
SFT_RECIPES = [r for r in ALL if r.endswith("-sft.yaml")]  # tripod train-sft's (engine/sft/config.py)
TOOL_CONFIGS = [r for r in ALL if r.endswith("-tools.yaml")]  # multi_turn.tool_config_path files (verl's `tools:`)
RECIPES = [r for r in ALL if r not in RM_RECIPES + SFT_RECIPES + TOOL_CONFIGS]
# what a recipe leaves to the machine it runs on: its data files and model directory (missing here, or given on the
# command line by the script that runs the recipe: scripts/demo.py, `tripod bench`)
ENVIRONMENT = ("does not exist", "has no config.json", "is empty", "is not set")


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_loads_and_validates(recipe):
    """Every recipe has only known keys of the right types, and its values pass validation for its own world, apart
    from the files it names (data and model directories live elsewhere)."""
    from tripod.engine.config import ConfigError, load_config
    from tripod.engine.config_validation import validate_config

    cfg = load_config(str(REPO_ROOT / recipe), [])
    try:
        validate_config(cfg, cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes)
    except ConfigError as e:
        problems = [p for p in str(e).split("\n  - ")[1:] if not any(s in p for s in ENVIRONMENT)]
        assert problems == [], problems


@pytest.mark.parametrize("recipe", RM_RECIPES)
def test_every_train_rm_recipe_loads_and_validates(recipe):
    from tripod.engine.config_loading import ConfigError
    from tripod.engine.reward_training.config import load_rm_config

    cfg = load_rm_config(str(REPO_ROOT / recipe), [])
    try:
        cfg.check(cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes)
    except ConfigError as e:
        problems = [p for p in str(e).split("\n  - ")[1:] if not any(s in p for s in ENVIRONMENT)]
        assert problems == [], problems


@pytest.mark.parametrize("recipe", SFT_RECIPES)
def test_every_train_sft_recipe_loads_and_validates(recipe):
    from tripod.engine.config_loading import ConfigError
    from tripod.engine.sft.config import load_sft_config

    cfg = load_sft_config(str(REPO_ROOT / recipe), [])
    try:
        cfg.check(cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes)
    except ConfigError as e:
        problems = [p for p in str(e).split("\n  - ")[1:] if not any(s in p for s in ENVIRONMENT)]
        assert problems == [], problems


@pytest.mark.parametrize("tool_config", TOOL_CONFIGS)
def test_every_tool_config_builds_its_tools_and_a_recipe_uses_it(tool_config, tool_configs_load):
    from tripod.engine.agent import load_tools
    from tripod.engine.config import load_config

    assert load_tools(str(REPO_ROOT / tool_config))
    users = [r for r in RECIPES if load_config(str(REPO_ROOT / r), []).actor_rollout_ref.rollout.multi_turn
             .tool_config_path == tool_config]
    assert users, f"no recipe's multi_turn.tool_config_path is {tool_config}"


def test_tripod_plan_of_the_qwen3_8b_recipe_counts_its_parameters_and_fits_80_gb(capsys, monkeypatch):
    """The plan's per-rank parameters within 5% of an independent count from config.json (tests/helpers/
    hf_param_count.py: the layout splits the whole model; replicated norms and the vocab padding differ), and its
    verdict against 8 x 80 GB."""
    from tests.helpers.hf_param_count import expected_rank_params, plan_row_params
    from tripod.engine.cli import main

    monkeypatch.chdir(REPO_ROOT)
    assert main(["plan", "recipes/qwen3/8b-gsm8k-grpo.yaml"]) == 0
    out = capsys.readouterr().out
    assert "Qwen--Qwen3-8B.json" in out and "train layout   TP=2 PP=2 DP=2 (world 8)" in out
    layout, dtype, mib = plan_row_params(out)
    assert layout == "TP2xPP2xDP2" and dtype == "bfloat16"
    expected = expected_rank_params(REPO_ROOT / "recipes/model_configs/Qwen--Qwen3-8B.json", tp=2, pp=2)
    assert abs(mib * 2 ** 20 / 2 / expected - 1) <= 0.05, (mib, expected)
    assert "verdict vs 80 GiB per device: fits" in out
