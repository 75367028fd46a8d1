"""`tripod train-rm` without a model: the Bradley-Terry loss and its gradients against the closed form (float64),
the preference data's all-pairs expansion of a ranking, its per-prompt / per-pair weighting in closed form, the pad
token the export gets, the one-line refusals, and the per-step pair schedule."""
import math

import pytest
import torch

from tripod.engine.reward_training.config import PreferenceDataConfig
from tripod.engine.reward_training.data import Pair, PairSchedule, pair_weight, preference_pairs, score_pad_token
from tripod.engine.reward_training.trainer import _pair_batch, bradley_terry_loss, pair_metrics, weighted_pair_sums


def test_bradley_terry_loss_and_gradients_match_the_closed_form():
    g = torch.Generator().manual_seed(0)
    chosen = (torch.randn(64, generator=g, dtype=torch.float64) * 3).requires_grad_()
    rejected = (torch.randn(64, generator=g, dtype=torch.float64) * 3).requires_grad_()
    with torch.no_grad():  # margins far in both tails too, where a naive log(sigmoid(.)) over/underflows
        chosen[:2] = torch.tensor([60.0, -60.0], dtype=torch.float64)
        rejected[:2] = torch.tensor([-60.0, 60.0], dtype=torch.float64)
    loss = bradley_terry_loss(chosen, rejected)
    d = (chosen - rejected).tolist()
    want = [math.log1p(math.exp(-x)) if x > 0 else -x + math.log1p(math.exp(x)) for x in d]  # -log sigmoid(d)
    assert torch.allclose(loss, torch.tensor(want, dtype=torch.float64), rtol=1e-15, atol=0)
    loss.sum().backward()
    sig_neg = torch.tensor([1 / (1 + math.exp(x)) for x in d], dtype=torch.float64)  # sigmoid(-d)
    # d/dr_chosen = -sigmoid(-d), d/dr_rejected = +sigmoid(-d)
    assert torch.allclose(chosen.grad, -sig_neg, rtol=1e-15, atol=1e-300)
    assert torch.allclose(rejected.grad, sig_neg, rtol=1e-15, atol=1e-300)
    assert loss[1].item() == pytest.approx(120.0, rel=1e-15)  # a confidently wrong pair costs its margin


def test_pair_metrics():
    m = pair_metrics(torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64), torch.tensor([0.0, 1.0, 1.5], dtype=torch.float64))
    assert m["accuracy"] == pytest.approx(2 / 3) and m["margin"] == pytest.approx(0.5 / 3)
    margins = (1.0, -1.0, 0.5)
    assert m["loss"] == pytest.approx(sum(math.log1p(math.exp(-x)) for x in margins) / 3, rel=1e-15)


@pytest.fixture(scope="module")
def tokenizer():
    from tripod.engine.data.char_tokenizer import char_tokenizer

    return char_tokenizer()


def _write(path, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return str(path)


def test_a_ranking_trains_on_all_its_ordered_pairs(tmp_path, tokenizer):
    path = _write(tmp_path / "p.parquet", prompt=["Q ", "R "], chosen=["a", None], rejected=["b", None],
                  ranking=[None, ["x", "y", "z"]])
    pairs = preference_pairs([path], tokenizer, PreferenceDataConfig())
    seq = lambda prompt, response: tokenizer(prompt + response, add_special_tokens=False)["input_ids"] + [  # noqa: E731
        tokenizer.eos_token_id]
    assert pairs == [Pair(seq("Q ", "a"), seq("Q ", "b"), 2), Pair(seq("R ", "x"), seq("R ", "y"), 3),
                     Pair(seq("R ", "x"), seq("R ", "z"), 3), Pair(seq("R ", "y"), seq("R ", "z"), 3)]


def test_rankings_are_weighted_per_prompt_in_closed_form(tmp_path, tokenizer):
    """A pair row and rankings of 3 and 4 responses with known scores: per_prompt (the default) makes the loss, the
    accuracy and the margin the mean over the three prompts of each prompt's mean over its pairs (InstructGPT's
    1/C(K,2)); per_pair the plain mean over all 1 + 3 + 6 pairs. Computed here by hand in float64."""
    from tripod.engine.reward_training.config import RMTrainConfig

    assert RMTrainConfig().reward_model.ranking_weight == "per_prompt"
    rows = {"Q ": ["a", "b"], "R ": ["x", "y", "z"], "S ": ["k", "l", "m", "n"]}
    value = {"a": 0.3, "b": 1.1, "x": 2.0, "y": -0.5, "z": 0.7, "k": 1.5, "l": 0.2, "m": 0.9, "n": -3.0}
    path = _write(tmp_path / "p.parquet", prompt=list(rows), chosen=["a", None, None], rejected=["b", None, None],
                  ranking=[None, rows["R "], rows["S "]])
    pairs = preference_pairs([path], tokenizer, PreferenceDataConfig())
    text = {tuple(tokenizer(p + r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]): r
            for p, rs in rows.items() for r in rs}
    chosen = torch.tensor([value[text[tuple(p.chosen)]] for p in pairs], dtype=torch.float64)
    rejected = torch.tensor([value[text[tuple(p.rejected)]] for p in pairs], dtype=torch.float64)

    nll = lambda c, r: math.log1p(math.exp(-(value[c] - value[r])))  # noqa: E731  -log sigmoid(r_c - r_r)
    ordered = lambda rs: [(rs[i], rs[j]) for i in range(len(rs)) for j in range(i + 1, len(rs))]  # noqa: E731
    by_prompt = [ordered(rs) for rs in rows.values()]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    want = {"per_prompt": {"loss": mean([mean([nll(c, r) for c, r in ps]) for ps in by_prompt]),
                           "accuracy": mean([mean([float(value[c] > value[r]) for c, r in ps]) for ps in by_prompt]),
                           "margin": mean([mean([value[c] - value[r] for c, r in ps]) for ps in by_prompt])},
            "per_pair": {"loss": mean([nll(c, r) for ps in by_prompt for c, r in ps]),
                         "accuracy": mean([float(value[c] > value[r]) for ps in by_prompt for c, r in ps]),
                         "margin": mean([value[c] - value[r] for ps in by_prompt for c, r in ps])}}
    assert want["per_prompt"]["loss"] != pytest.approx(want["per_pair"]["loss"], rel=1e-3)  # the weighting matters
    for mode, expected in want.items():
        weight = torch.tensor([pair_weight(p, mode) for p in pairs], dtype=torch.float64)
        assert weight.tolist() == ([1.0] + [1 / 3] * 3 + [1 / 6] * 6 if mode == "per_prompt" else [1.0] * 10)
        got = pair_metrics(chosen, rejected, weight)
        for k, v in expected.items():
            assert got[k] == pytest.approx(v, rel=1e-14, abs=1e-15), (mode, k)
        # the training step's loss: weighted sums over micro-batches (each carrying its pairs' weights on both rows),
        # divided by the step's total weight
        sums = [weighted_pair_sums(chosen[s], rejected[s], _pair_batch(pairs[s], 0, mode)["weight"].chunk(2)[0])
                for s in (slice(0, 4), slice(4, 10))]
        step_loss = sum(float(x["loss"]) for x in sums) / sum(pair_weight(p, mode) for p in pairs)
        assert step_loss == pytest.approx(expected["loss"], rel=1e-14)


def test_the_reward_model_pad_token_is_never_the_eos():
    """transformers scores a *ForSequenceClassification at the rightmost token that is not its pad token: the pad the
    export gets must differ from the EOS tripod reads the score at. Kept when it differs; else the unknown token;
    refused in one line when the tokenizer has nothing but its EOS."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from tripod.engine.data.char_tokenizer import char_tokenizer

    tokenizer = char_tokenizer()  # a fresh one: this test changes its pad token
    assert score_pad_token(tokenizer) == "<pad>"
    tokenizer.pad_token = tokenizer.eos_token
    assert tokenizer.pad_token_id == tokenizer.eos_token_id and score_pad_token(tokenizer) == "<pad>"
    tokenizer.pad_token = "<bos>"
    assert score_pad_token(tokenizer) == "<bos>"
    only_eos = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<eos>": 0, "a": 1}, unk_token="<eos>")),
                                       eos_token="<eos>", pad_token="<eos>", unk_token="<eos>")
    with pytest.raises(ValueError, match=r"no token but its EOS '<eos>' to pad with.*add a pad_token") as e:
        score_pad_token(only_eos)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("columns,message", [
    (dict(prompt=["Q"], chosen=["a"]), r"p\.parquet: no 'rejected' column .* and no 'ranking' column"),
    (dict(question=["Q"], chosen=["a"], rejected=["b"]), r"p\.parquet: no 'prompt' column \(data\.prompt_key\)"),
    (dict(prompt=["Q", "Q2"], chosen=["a", "same"], rejected=["b", "same"]),
     r"p\.parquet row 1: identical responses in 'chosen/rejected'"),
    (dict(prompt=["Q"], ranking=[["only one"]]), r"p\.parquet row 0: 'ranking' has 1 response\(s\); a ranking needs >= 2"),
    (dict(prompt=["Q"], chosen=["a" * 600], rejected=["b"]), r"p\.parquet row 0: 602 tokens .* > data\.max_length=512"),
], ids=["no_rejected", "no_prompt", "identical", "short_ranking", "too_long"])
def test_bad_preference_rows_are_refused_in_one_line(tmp_path, tokenizer, columns, message):
    path = _write(tmp_path / "p.parquet", **columns)
    with pytest.raises(ValueError, match=message) as e:
        preference_pairs([path], tokenizer, PreferenceDataConfig())
    assert "\n" not in str(e.value)


def test_the_pair_schedule_is_a_seeded_permutation_per_epoch():
    s = PairSchedule(num_pairs=10, batch_size=3, shuffle=True, seed=7)
    assert s.steps_per_epoch == 3
    epoch0 = [i for step in range(3) for i in s.batch(step)]
    assert len(set(epoch0)) == 9 and s.batch(1) == PairSchedule(10, 3, True, 7).batch(1)  # resumable: f(step) only
    assert s.batch(3) != s.batch(0)  # the next epoch reshuffles
    assert PairSchedule(10, 3, False, 7).batch(1) == [3, 4, 5]
