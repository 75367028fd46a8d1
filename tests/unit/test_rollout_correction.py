"""engine/algorithms/rollout_correction.py and the weighted policy loss against float64 references written from
verl's formulas (token / sequence truncated IS, seq_mean_k1 / seq_mean_k3 rejection, the rollout_corr/* metrics),
on fresh random log-probs with ragged response masks.

Bounds: every quantity is a masked sum of <= 12 fp32 terms (or one exp of such a sum), so its relative error is
<= 12 * 2**-24 + the exp's own few ulps: rel=1e-5 leaves > 10x headroom and still fails on any formula change."""
from __future__ import annotations

import math

import pytest
import torch

from tripod.engine.algorithms import policy_loss
from tripod.engine.algorithms.rollout_correction import correct_batch, is_weights, rejection_keep, rollout_correction

REL = 1e-5


def _batch(seed: int, rows: int = 7, cols: int = 12, spread: float = 0.3):
    """old, rollout log-probs [rows, cols] (rollout = old + noise of size `spread`), and a ragged mask (row 0 full,
    row 1 empty, the rest random lengths)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g) * 4.0
    rollout = old + spread * torch.randn(rows, cols, generator=g)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    lengths[0], lengths[1] = cols, 0
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).float()
    return old, rollout, mask


def _rows(x, mask):
    """Per row, the float64 values of x at the masked positions."""
    return [[float(x[i, t]) for t in range(x.shape[1]) if mask[i, t]] for i in range(x.shape[0])]


def _diffs(old, rollout, mask):
    return [[o - r for o, r in zip(ro, rr)] for ro, rr in zip(_rows(old, mask), _rows(rollout, mask))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_is_weights_are_the_truncated_per_token_ratio(seed):
    old, rollout, mask = _batch(seed, spread=0.6)
    threshold = 1.3
    got, raw = is_weights(old - rollout, mask, "token", threshold)
    for i, row in enumerate(_diffs(old, rollout, mask)):
        for t, d in enumerate(row):
            assert float(raw[i, t]) == pytest.approx(math.exp(d), rel=REL)
            assert float(got[i, t]) == pytest.approx(min(math.exp(d), threshold), rel=REL)
    assert (got[mask == 0] == 0).all() and (raw[mask == 0] == 0).all()
    assert (got == threshold).any() and (got < threshold).any(), "the draw must exercise the truncation"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sequence_is_weight_is_the_truncated_product_of_the_ratios(seed):
    old, rollout, mask = _batch(seed, spread=0.15)
    threshold = 1.5
    got, raw = is_weights(old - rollout, mask, "sequence", threshold)
    for i, row in enumerate(_diffs(old, rollout, mask)):
        product = math.prod(math.exp(d) for d in row)  # one weight for every token of the sequence
        for t in range(len(row)):
            assert float(raw[i, t]) == pytest.approx(product, rel=REL)
            assert float(got[i, t]) == pytest.approx(min(product, threshold), rel=REL)
    assert (got[mask == 0] == 0).all()
    seq = got.amax(-1)[mask.sum(-1) > 0]
    assert (seq == threshold).any() and (seq < threshold).any(), "the draw must exercise the truncation"


def test_is_weights_are_detached_and_capped_at_the_safety_bound():
    old = torch.zeros(2, 3, requires_grad=True)
    rollout = torch.tensor([[-30.0, 0.0, 0.0], [30.0, 0.0, 0.0]])
    mask = torch.ones(2, 3)
    for level in ("token", "sequence"):
        w, raw = is_weights(old - rollout, mask, level, 1e12)
        assert not w.requires_grad and not raw.requires_grad
        assert float(raw[0, 0]) == pytest.approx(math.exp(20.0), rel=REL)  # log-ratio 30 clamped to 20
        assert float(raw[1, 0]) == pytest.approx(math.exp(-20.0), rel=REL)


@pytest.mark.parametrize("mode,threshold", [("seq_mean_k1", 1.08), ("seq_mean_k3", 0.02)])
def test_rejection_keeps_the_sequences_whose_mean_divergence_is_inside_the_bound(mode, threshold):
    old, rollout, mask = _batch(5, rows=12, spread=0.25)
    keep, stat = rejection_keep(old - rollout, mask, mode, threshold)
    want_keep = []
    for i, row in enumerate(_diffs(old, rollout, mask)):
        if mode == "seq_mean_k1":  # verl: mean of -log r against log(1/t) <= . <= log(t)
            s = sum(-d for d in row) / max(len(row), 1)
            want_keep.append(math.log(1 / threshold) <= s <= math.log(threshold))
        else:
            s = sum(math.exp(d) - 1 - d for d in row) / max(len(row), 1)
            want_keep.append(s <= threshold)
        assert float(stat[i]) == pytest.approx(s, rel=REL, abs=1e-7)
    assert keep.tolist() == want_keep
    assert 0 < sum(want_keep) < len(want_keep) - 1, "the draw must both keep and reject non-empty sequences"


def test_correction_metrics_and_mask_match_the_formulas():
    old, rollout, mask = _batch(7, rows=10, spread=0.2)
    out = rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=1.2,
                             rollout_rs="seq_mean_k3", rollout_rs_threshold=0.015)
    rows = _diffs(old, rollout, mask)
    tokens = [d for row in rows for d in row]
    n = len(tokens)
    m = out.metrics
    assert m["rollout_corr/kl"] == pytest.approx(sum(-d for d in tokens) / n, rel=REL)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in tokens) / n, rel=REL)
    assert m["rollout_corr/abs_diff_max"] == pytest.approx(max(abs(d) for d in tokens), rel=REL)
    assert m["rollout_corr/abs_diff_mean"] == pytest.approx(sum(abs(d) for d in tokens) / n, rel=REL)
    assert m["rollout_corr/is_truncated_frac"] == pytest.approx(sum(math.exp(d) > 1.2 for d in tokens) / n, rel=REL)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(min(math.exp(d), 1.2) for d in tokens) / n,
                                                              rel=REL)
    rejected = [bool(row) and sum(math.exp(d) - 1 - d for d in row) / len(row) > 0.015 for row in rows]
    nonempty = [bool(row) for row in rows]
    assert 0 < sum(rejected) < sum(nonempty)
    assert m["rollout_corr/rs_rejected_frac"] == pytest.approx(sum(rejected) / sum(nonempty), rel=REL)
    assert m["rollout_corr/rs_rejected_token_frac"] == pytest.approx(
        sum(len(row) for row, r in zip(rows, rejected) if r) / n, rel=REL)
    for i, r in enumerate(rejected):  # rejected rows leave the mask and carry no weight; the others are unchanged
        assert torch.equal(out.response_mask[i], torch.zeros_like(mask[i]) if r else mask[i])
        assert (out.is_weights[i] == 0).all() if r else (out.is_weights[i][mask[i] == 0] == 0).all()


def test_sequence_truncated_frac_counts_sequences():
    old, rollout, mask = _batch(3, rows=9, spread=0.15)
    m = rollout_correction(old, rollout, mask, rollout_is="sequence", rollout_is_threshold=1.1).metrics
    rows = [row for row in _diffs(old, rollout, mask) if row]
    want = sum(math.exp(sum(row)) > 1.1 for row in rows) / len(rows)
    assert 0 < want < 1 and m["rollout_corr/is_truncated_frac"] == pytest.approx(want, rel=REL)


def test_identical_log_probs_correct_nothing():
    old, _, mask = _batch(4)
    out = rollout_correction(old, old.clone(), mask, rollout_is="sequence", rollout_is_threshold=2.0,
                             rollout_rs="seq_mean_k1", rollout_rs_threshold=1.001)
    assert torch.equal(out.response_mask, mask) and torch.equal(out.is_weights, mask)
    assert all(v == 0.0 for k, v in out.metrics.items() if k != "rollout_corr/rollout_is_mean")
    assert out.metrics["rollout_corr/rollout_is_mean"] == 1.0


def test_weighted_policy_loss_and_its_gradient_are_the_weighted_per_token_ones():
    """loss = token-mean of w * (clipped PPO loss), dL/dlogp = w * d(per-token loss)/dlogp / n: the weight scales the
    gradient and receives none (it is detached even when handed a tensor that requires grad)."""
    old, rollout, mask = _batch(11, spread=0.3)
    g = torch.Generator().manual_seed(12)
    adv = torch.randn(old.shape, generator=g)
    logp = (old + 0.1 * torch.randn(old.shape, generator=g)).requires_grad_()
    w_src = (old - rollout).requires_grad_()
    weights = torch.exp(w_src).clamp(max=2.0)
    loss, _ = policy_loss(old, logp, adv, mask, 0.2, 0.2, 3.0, "token-mean", weights=weights)
    loss.backward()
    assert w_src.grad is None, "the IS weight took part in the backward pass"
    n = float(mask.sum())
    want, grad = 0.0, torch.zeros_like(old, dtype=torch.float64)
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            if not mask[i, t]:
                continue
            a, lp, o, w = float(adv[i, t]), float(logp[i, t].detach()), float(old[i, t]), float(weights[i, t].detach())
            r = math.exp(lp - o)
            unclipped, clipped = -a * r, -a * min(max(r, 0.8), 1.2)
            pg, d = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0 if r < 0.8 or r > 1.2 else -a * r)
            if a < 0 and pg > -a * 3.0:  # dual clip
                pg, d = -a * 3.0, 0.0
            want += w * pg / n
            grad[i, t] = w * d / n
    assert float(loss.detach()) == pytest.approx(want, rel=REL)
    torch.testing.assert_close(logp.grad.double(), grad, rtol=REL, atol=1e-9)


def test_rollout_log_probs_ride_along_with_their_responses():
    """Dynamic sampling's group selection and concatenation keep each response's rollout log-probs and finish
    reason with it, and the PPO batch lays the log-probs out under the response tokens (0 past each length)."""
    from tripod.engine.algorithms.dynamic_sampling import Rollout, concat
    from tripod.engine.data import PromptBatch
    from tripod.engine.workers.batch import build_ppo_batch

    g = torch.Generator().manual_seed(3)
    n, lengths = 2, [3, 1, 0, 4, 2, 5]
    responses = [[10 + i] * k for i, k in enumerate(lengths)]
    logps = [-torch.rand(k, generator=g) for k in lengths]
    finish = ["stop", "length", "stop", "length", "stop", "length"]

    def part(rows):
        groups = sorted({r // n for r in rows})
        prompts = PromptBatch(input_ids=[[1, 2 + q] for q in groups], ground_truths=[str(q) for q in groups],
                              data_sources=["x"] * len(groups), indices=groups, extra_infos=[])
        pick = lambda xs: [xs[r] for r in rows]  # noqa: E731
        return Rollout(prompts, pick(responses), [0.0] * len(rows), [0.0] * len(rows), [0.0] * len(rows), {},
                       pick(logps), pick(finish))
    joined = concat([part([0, 1, 2, 3]), part([4, 5])]).groups([2, 0], n)  # prompts 2 then 0
    order = [4, 5, 0, 1]
    assert joined.responses == [responses[r] for r in order]
    assert joined.finish_reasons == [finish[r] for r in order]
    batch = build_ppo_batch([[1, 2]] * 4, joined.responses, 6, 0, [2, 2, 0, 0], joined.rollout_log_probs,
                            joined.finish_reasons)
    for i, r in enumerate(order):
        assert torch.equal(batch["rollout_log_probs"][i, : lengths[r]], logps[r])
        assert (batch["rollout_log_probs"][i, lengths[r]:] == 0).all()
    assert batch.select([1, 3]).meta["finish_reasons"] == [finish[5], finish[1]]
    with pytest.raises(ValueError, match="response 1 has 2 tokens but 1 rollout log-probs"):
        build_ppo_batch([[1]] * 2, [[5], [6, 7]], 4, 0, [0, 1], [torch.zeros(1), torch.zeros(1)])


def test_correct_batch_writes_the_mask_and_weights_and_stops_when_everything_is_rejected():
    from types import SimpleNamespace

    from tripod.engine.workers.batch import PPOBatch

    old, rollout, mask = _batch(9, rows=6, spread=0.3)
    cfg = SimpleNamespace(rollout_is="sequence", rollout_is_threshold=1.5, rollout_rs="seq_mean_k3",
                          rollout_rs_threshold=0.05)
    batch = PPOBatch({"input_ids": torch.zeros(6, 3, dtype=torch.long), "old_log_probs": old,
                      "rollout_log_probs": rollout, "response_mask": mask.clone()})
    metrics = correct_batch(batch, cfg)
    want = rollout_correction(old, rollout, mask, "sequence", 1.5, "seq_mean_k3", 0.05)
    assert torch.equal(batch["response_mask"], want.response_mask) and not torch.equal(want.response_mask, mask)
    assert torch.equal(batch["rollout_is_weights"], want.is_weights) and metrics == want.metrics
    cfg.rollout_rs_threshold = 1e-9  # every non-empty sequence has a larger mean k3
    with pytest.raises(RuntimeError, match="algorithm.rollout_correction.rollout_rs=seq_mean_k3 rejected every "
                                           "sequence of this step"):
        correct_batch(PPOBatch({"input_ids": torch.zeros(6, 3, dtype=torch.long), "old_log_probs": old,
                                "rollout_log_probs": rollout, "response_mask": mask.clone()}), cfg)
