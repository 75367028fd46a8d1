"""`tripod train-rm` without a model: the Bradley-Terry loss and its gradients against the closed form (float64),
the preference data's all-pairs expansion of a ranking and its one-line refusals, and the per-step pair schedule."""
import math

import pytest
import torch

from tripod.engine.reward_training.config import PreferenceDataConfig
from tripod.engine.reward_training.data import PairSchedule, preference_pairs
from tripod.engine.reward_training.trainer import bradley_terry_loss, pair_metrics


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
    assert pairs == [(seq("Q ", "a"), seq("Q ", "b")), (seq("R ", "x"), seq("R ", "y")),
                     (seq("R ", "x"), seq("R ", "z")), (seq("R ", "y"), seq("R ", "z"))]


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
