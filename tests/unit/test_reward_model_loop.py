"""The reward model in the PPO loop, without a model: how its score combines with the rule rewards, which rows the
rule pool scores, and the one-line refusals of a bad `reward_model.model.path` before anything is built."""
import pytest

from tests.helpers.common import make_tiny_hf_model
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tripod.engine.launch import Launch
from tripod.engine.preflight import prepare_train
from tripod.engine.workers.reward_model import combine_rewards, rule_rewards_where_defined

RM_ON = ["reward_model.enable=true"]


def test_fallback_uses_the_rule_where_there_is_one_and_the_weighted_model_elsewhere():
    scores, m = combine_rewards([1.0, None, 0.0, None], [0.3, -0.7, 2.0, 0.25], "fallback", 2.0)
    assert scores == [1.0, -1.4, 0.0, 0.5]
    assert m == {"reward/model_mean": pytest.approx(0.4625), "reward/rule_frac": 0.5, "reward/rule_mean": 0.5}


def test_sum_adds_the_weighted_model_score_to_every_rule_reward():
    scores, m = combine_rewards([1.0, None, 0.5], [0.25, -0.5, 1.5], "sum", 0.5)
    assert scores == [1.125, -0.25, 1.25]
    assert m["reward/rule_frac"] == pytest.approx(2 / 3) and m["reward/rule_mean"] == 0.75


def test_the_rule_pool_scores_only_rows_whose_data_source_has_a_rule():
    class Pool:  # records what it was asked; the real pool refuses unknown data sources
        def score(self, texts, gts, sources, infos):
            self.seen = (texts, sources)
            return [float(len(t)) for t in texts], {"reward/num_timeouts": 0.0}

    pool = Pool()
    out, metrics = rule_rewards_where_defined(pool, ["a", "bb", "ccc"], ["1", "2", "3"],
                                              ["arithmetic", "chat_no_rule", "gsm8k"], None)
    assert out == [1.0, None, 3.0] and pool.seen == (["a", "ccc"], ["arithmetic", "gsm8k"])
    assert metrics == {"reward/num_timeouts": 0.0}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tripod.engine.data.char_tokenizer import char_tokenizer

    tmp = tmp_path_factory.mktemp("rm")
    paths = make_ppo_setup(tmp)
    shape = dict(vocab_size=128, max_position_embeddings=256)
    paths["rm"] = make_tiny_hf_model(tmp, "qwen2", subdir="rm", sequence_classification=True, **shape)
    char_tokenizer().save_pretrained(paths["rm"])
    paths["rm_other_tok"] = make_tiny_hf_model(tmp, "qwen2", subdir="rm_tok", sequence_classification=True, **shape)
    char_tokenizer(extra_chars=["é"]).save_pretrained(paths["rm_other_tok"])
    paths["causal"] = make_tiny_hf_model(tmp, "qwen2", subdir="causal", **shape)
    paths["run"] = str(tmp / "run")
    return paths


def _prepare(setup, *extra):
    return prepare_train(None, tiny_overrides(setup, setup["run"]) + RM_ON + list(extra), Launch("local", 0))


def test_a_reward_model_with_the_actors_tokenizer_passes(setup):
    cfg, world = _prepare(setup, f"reward_model.model.path={setup['rm']}")
    assert cfg.reward_model.enable and world == 1


@pytest.mark.parametrize("which,extra,message", [
    ("causal", [], r"reward_model\.model\.path=.*architectures=\['Qwen2ForCausalLM'\] has no score head; point it at"),
    ("rm_other_tok", [], r"reward_model\.model\.path=.*its tokenizer differs from the actor's \(100 vs 99 tokens, 1 "
                         r"token ids differ\); set reward_model\.retokenize=true"),
    ("rm", ["reward_model.combine=max"], r"reward_model\.combine='max' is not one of \['fallback', 'sum'\]"),
    ("rm", ["reward_model.micro_batch_size_per_gpu=0"], r"reward_model\.micro_batch_size_per_gpu=0 must be >= 1"),
    ("rm", ["reward_model.megatron.tensor_model_parallel_size=2"], r"reward_model\.megatron: tensor_model_parallel_"
                                                                   r"size \* pipeline_model_parallel_size = 2\*1"),
], ids=["no_score_head", "other_tokenizer", "combine", "micro", "layout"])
def test_bad_reward_model_settings_are_refused_in_one_line(setup, which, extra, message):
    with pytest.raises(Exception, match=message) as e:
        _prepare(setup, f"reward_model.model.path={setup[which]}", *extra)
    assert "\n" not in str(e.value).split("problem(s):\n  - ")[-1]


def test_another_tokenizer_is_accepted_with_retokenize(setup):
    cfg, _ = _prepare(setup, f"reward_model.model.path={setup['rm_other_tok']}", "reward_model.retokenize=true")
    assert cfg.reward_model.retokenize


def test_weights_without_the_score_head_are_refused(setup, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "no_score"
    shutil.copytree(setup["rm"], broken)
    state = load_file(broken / "model.safetensors")
    del state["score.weight"]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"its weights have no score\.weight .*re-save the reward model"):
        _prepare(setup, f"reward_model.model.path={broken}")
