"""Configs that document and check themselves: every field has a docstring, docs/config.md is generated from them,
choice lists follow the registries, and engine.config depends on nothing that depends on it."""
import ast
import importlib.util
import os
import sys

import pytest

from tests.helpers.common import REPO_ROOT

sys.path.insert(0, os.path.join(str(REPO_ROOT), "scripts"))
import gen_config_docs  # noqa: E402


def test_every_config_field_has_a_docstring():
    assert gen_config_docs.undocumented() == []


def test_a_field_without_a_docstring_is_caught():
    from dataclasses import dataclass

    @dataclass
    class Section:
        documented: int = 1
        """Has one."""
        bare: int = 2

    assert gen_config_docs.field_doc(Section, "documented") == "Has one."
    assert gen_config_docs.field_doc(Section, "bare") is None


def test_docs_config_md_is_generated_from_the_dataclasses():
    with open(gen_config_docs.DOC_PATH) as f:
        on_disk = f.read()
    assert on_disk == gen_config_docs.render(), "regenerate: python scripts/gen_config_docs.py"
    for key in gen_config_docs.leaf_keys():
        assert f"| `{key}` |" in on_disk, key


def test_critic_inherits_the_shared_fields_and_their_docs():
    from tripod.engine.config import ActorConfig, CriticConfig, PPOModelConfig

    assert issubclass(ActorConfig, PPOModelConfig) and issubclass(CriticConfig, PPOModelConfig)
    # re-declared in CriticConfig only to follow the actor's value: the docstring is the base class's
    assert gen_config_docs.field_doc(CriticConfig, "ppo_epochs") == gen_config_docs.field_doc(PPOModelConfig,
                                                                                               "ppo_epochs")


def test_a_newly_registered_estimator_is_accepted_by_the_config_check():
    from tripod.engine.algorithms import advantages, register_adv_est
    from tripod.engine.config import AlgorithmConfig

    assert AlgorithmConfig(adv_estimator="my_estimator").check() != []

    @register_adv_est("my_estimator")
    def my_estimator(token_rewards, mask, *, values, index, gamma, lam):
        return token_rewards, token_rewards

    try:
        assert AlgorithmConfig(adv_estimator="my_estimator").check() == []
    finally:
        advantages._ESTIMATORS.pop("my_estimator")


def _imports(path: str) -> set[str]:
    """Every module `path` imports, at top level or inside functions."""
    tree = ast.parse(open(path).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_engine_config_does_not_import_what_imports_it():
    """tripod.engine.config is a leaf of the engine: nothing it imports (even lazily) imports engine.config back."""
    package = os.path.join(str(REPO_ROOT), "src", "tripod", "engine", "config")
    own = lambda m: m == "tripod.engine.config" or m.startswith("tripod.engine.config.")  # noqa: E731
    config_imports = {m for f in os.listdir(package) if f.endswith(".py")
                      for m in _imports(os.path.join(package, f)) if m.startswith("tripod.") and not own(m)}
    assert "tripod.engine.algorithms" in config_imports, config_imports  # the walk sees the modules' lazy imports
    assert "tripod.engine.config_validation" not in config_imports
    for module in config_imports:
        spec = importlib.util.find_spec(module)
        paths = [spec.origin] if spec.origin.endswith(".py") else []
        if spec.submodule_search_locations:  # a package: all its modules
            root = spec.submodule_search_locations[0]
            paths = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")]
        for path in paths:
            back = {m for m in _imports(path) if own(m) or m == "tripod.engine.config_validation"}
            assert not back, (module, path, back)


@pytest.mark.parametrize("key, value, expected", [
    ("algorithm.kl_penalty", "k4", "algorithm.kl_penalty='k4' is not one of ['abs', 'k1'"),
    ("actor_rollout_ref.actor.loss_agg_mode", "sum", "['token-mean', 'token-sum', 'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm']"),
    ("trainer.logger", "[neptune]", "use any of ['console', 'tensorboard', 'jsonl', 'wandb', 'mlflow']"),
    ("global_profiler.tool", "perf", "global_profiler.tool='perf' is not one of ['torch', 'nsys']"),
])
def test_choice_lists_come_from_the_registries(key, value, expected):
    from tripod.engine.config import load_config

    cfg = load_config(None, [f"{key}={value}"])
    problems = (cfg.algorithm.check() + cfg.actor_rollout_ref.actor.check() + cfg.trainer.check()
                + cfg.global_profiler.check(cfg.trainer.device))
    assert any(expected in p for p in problems), problems
