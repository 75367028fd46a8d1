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


def _verl_metrics(rows, is_level, is_threshold, rejected):
    """float64 rollout_corr/* from verl's published formulas (rollout_corr_helper.py: compute_offpolicy_metrics,
    compute_is_metrics before truncation, compute_rollout_rejection_mask's fractions), on the per-row lists of
    (old, rollout) log-prob pairs `rows`: sequence means over every row (an empty row's mean log-prob is 0), token
    means over every response token; `rejected` [rows] bool."""
    tokens = [o - r for row in rows for o, r in row]
    n, big_n = len(tokens), len(rows)
    seq_old = [sum(o for o, _ in row) / len(row) if row else 0.0 for row in rows]
    seq_roll = [sum(r for _, r in row) / len(row) if row else 0.0 for row in rows]
    seq_sum = [sum(o - r for o, r in row) for row in rows]
    out = {"training_ppl": sum(math.exp(-x) for x in seq_old) / big_n,
           "rollout_ppl": sum(math.exp(-x) for x in seq_roll) / big_n,
           "log_ppl_diff": sum(r - o for o, r in zip(seq_old, seq_roll)) / big_n,
           "kl": sum(-d for d in tokens) / n, "k3_kl": sum(math.exp(d) - 1 - d for d in tokens) / n,
           "chi2_token": sum(math.exp(2 * d) for d in tokens) / n - 1,
           "chi2_seq": sum(math.exp(2 * s) for s in seq_sum) / big_n - 1,
           "abs_diff_max": max(abs(d) for d in tokens), "abs_diff_mean": sum(abs(d) for d in tokens) / n}
    if is_level is not None:
        t = is_threshold
        token_w = [math.exp(d) if is_level == "token" else math.exp(s)
                   for row, s in zip(rows, seq_sum) for d in (o - r for o, r in row)]
        ratio_w = token_w if is_level == "token" else [math.exp(s) for s in seq_sum]  # every sequence's weight
        clamped = [min(max(w, 1 / t), t) for w in token_w]
        mu = sum(clamped) / n
        out.update({"rollout_is_mean": sum(token_w) / n, "rollout_is_max": max(ratio_w),
                    "rollout_is_min": min(ratio_w),
                    "rollout_is_std": math.sqrt(max(sum(c * c for c in clamped) / n - mu * mu, 0.0)),
                    "rollout_is_ratio_fraction_high": sum(w > t for w in ratio_w) / len(ratio_w),
                    "rollout_is_ratio_fraction_low": sum(w < 1 / t for w in ratio_w) / len(ratio_w)})
    if rejected is not None:
        out.update({"rollout_rs_masked_fraction": sum(len(row) for row, r in zip(rows, rejected) if r) / n,
                    "rollout_rs_seq_masked_fraction": sum(rejected) / big_n})
    return {f"rollout_corr/{k}": v for k, v in out.items()}


def _pairs(old, rollout, mask):
    return [list(zip(ro, rr)) for ro, rr in zip(_rows(old, mask), _rows(rollout, mask))]


@pytest.mark.parametrize("level,threshold,spread", [("token", 1.2, 0.2), ("sequence", 1.1, 0.1)])
def test_correction_metrics_and_mask_are_verls(level, threshold, spread):
    """Every rollout_corr/* metric equals verl's formula (the IS ones of the weights before truncation, the rejection
    shares over the response tokens and over every sequence); rejected rows leave the mask and carry no weight."""
    old, rollout, mask = _batch(7, rows=10, spread=spread)
    out = rollout_correction(old, rollout, mask, rollout_is=level, rollout_is_threshold=threshold,
                             rollout_rs="seq_mean_k3", rollout_rs_threshold=0.015 * (spread / 0.2) ** 2)
    rows = _pairs(old, rollout, mask)
    bound = 0.015 * (spread / 0.2) ** 2  # k3 grows as the square of the log-ratio
    rejected = [bool(row) and sum(math.exp(o - r) - 1 - (o - r) for o, r in row) / len(row) > bound for row in rows]
    assert 0 < sum(rejected) < sum(bool(row) for row in rows), "the draw must both keep and reject sequences"
    want = _verl_metrics(rows, level, threshold, rejected)
    assert sorted(out.metrics) == sorted(want)
    for k, v in want.items():
        assert out.metrics[k] == pytest.approx(v, rel=REL, abs=1e-6), k
    w = want  # the draw exercises the truncation: weights above the threshold, whose mean is not the truncated one's
    assert w["rollout_corr/rollout_is_ratio_fraction_high"] > 0 and w["rollout_corr/rollout_is_max"] > threshold
    assert w["rollout_corr/rollout_is_ratio_fraction_low"] > 0 and w["rollout_corr/rollout_rs_masked_fraction"] > 0
    truncated_mean = float(out.is_weights.sum() / (out.is_weights > 0).sum())
    assert not abs(truncated_mean - w["rollout_corr/rollout_is_mean"]) <= 1e-4
    for i, r in enumerate(rejected):  # rejected rows leave the mask and carry no weight; the others are unchanged
        assert torch.equal(out.response_mask[i], torch.zeros_like(mask[i]) if r else mask[i])
        assert (out.is_weights[i] == 0).all() if r else (out.is_weights[i][mask[i] == 0] == 0).all()


def test_identical_log_probs_correct_nothing():
    old, _, mask = _batch(4)
    out = rollout_correction(old, old.clone(), mask, rollout_is="sequence", rollout_is_threshold=2.0,
                             rollout_rs="seq_mean_k1", rollout_rs_threshold=1.001)
    assert torch.equal(out.response_mask, mask) and torch.equal(out.is_weights, mask)
    ones = {"rollout_is_mean", "rollout_is_max", "rollout_is_min", "training_ppl", "rollout_ppl"}
    for k, v in out.metrics.items():
        if k.removeprefix("rollout_corr/") not in ones:
            assert v == 0.0, (k, v)
    assert all(out.metrics[f"rollout_corr/{k}"] == 1.0 for k in ones - {"training_ppl", "rollout_ppl"})
    assert out.metrics["rollout_corr/training_ppl"] == out.metrics["rollout_corr/rollout_ppl"] > 1.0


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
    from tripod.engine.data import PromptBatch
    from tripod.engine.rollout.rows import Rollout, concat
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


def test_correct_batch_writes_the_mask_and_weights_and_goes_on_when_everything_is_rejected():
    from types import SimpleNamespace

    from tripod.engine.workers.batch import PPOBatch

    old, rollout, mask = _batch(9, rows=6, spread=0.3)
    cfg = SimpleNamespace(rollout_is="sequence", rollout_is_threshold=1.5, rollout_rs="seq_mean_k3",
                          rollout_rs_threshold=0.05)
    batch = PPOBatch({"input_ids": torch.zeros(6, 3, dtype=torch.long), "old_log_probs": old,
                      "rollout_log_probs": rollout, "response_mask": mask.clone()})
    metrics, kept = correct_batch(batch, cfg)
    want = rollout_correction(old, rollout, mask, "sequence", 1.5, "seq_mean_k3", 0.05)
    assert torch.equal(batch["response_mask"], want.response_mask) and not torch.equal(want.response_mask, mask)
    assert torch.equal(batch["rollout_is_weights"], want.is_weights) and metrics == want.metrics
    assert kept == int(want.response_mask.sum()) > 0
    cfg.rollout_rs_threshold = 1e-9  # every non-empty sequence has a larger mean k3: nothing is kept, no error
    batch = PPOBatch({"input_ids": torch.zeros(6, 3, dtype=torch.long), "old_log_probs": old,
                      "rollout_log_probs": rollout, "response_mask": mask.clone()})
    metrics, kept = correct_batch(batch, cfg)
    assert kept == 0 and not batch["response_mask"].any()
    nonempty = int((mask.sum(-1) > 0).sum())  # verl's denominators: every token, every sequence (the empty one too)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(nonempty / 6, rel=REL)
