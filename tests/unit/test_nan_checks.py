"""A NaN never passes a test's numeric check: tests/helpers/bounds.py's `excess` and `worst`, and trainer_runs'
comparison of two runs' metrics and weight updates (the layout, MoE, precision-resume and train-rm equivalences),
with a NaN planted in the compared run or in the baseline, in a metric or in one element of a weight."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.bounds import excess, worst
from tests.helpers.trainer_runs import EXACT, METRIC_SCALE, OutOfBounds, assert_same_training, metric_violations

NAN = float("nan")
STEPS = 2


def test_excess_and_worst_see_a_nan_wherever_it_sits():
    assert excess(0.5, 1.0) is None and excess(1.0, 1.0) is None and excess(3.0, 1.5) == 2.0
    assert excess(NAN, 1.0) == math.inf and excess(1.0, NAN) == math.inf and excess(1.0, 0.0) == math.inf
    assert max([1e-6, NAN]) < 1e-5  # what they replace: builtin max drops a NaN that does not come first
    assert math.isnan(worst([1e-6, NAN])) and math.isnan(worst([NAN, 1e-6])) and worst([1e-6, 3e-6]) == 3e-6
    assert math.isnan(worst(torch.tensor([0.0, NAN]).tolist()))
    with pytest.raises(ValueError, match="nothing was compared"):
        worst([])


def _runs():
    """w0, and a baseline run (metrics of STEPS steps, final weights) that moved every matrix far above fp32
    rounding; the compared run starts as an exact copy of it."""
    g = torch.Generator().manual_seed(0)
    w0 = {"layer.weight": torch.randn(8, 8, generator=g), "norm.weight": 1 + 0.1 * torch.randn(8, generator=g)}
    weights = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    keys = [*METRIC_SCALE, *EXACT]
    metrics = [{"step": s, **{k: 0.5 + 0.1 * i + s for i, k in enumerate(keys)}} for s in range(1, STEPS + 1)]
    return w0, (metrics, weights)


def _copy(run):
    return [dict(m) for m in run[0]], {k: v.clone() for k, v in run[1].items()}


def test_identical_runs_are_within_bounds():
    w0, base = _runs()
    assert_same_training(w0, base, _copy(base), STEPS, "copy")


@pytest.mark.parametrize("where", ["got", "base"])
@pytest.mark.parametrize("key", ["actor/pg_loss", "critic/grad_norm", "critic/score/mean"])
def test_a_nan_metric_is_out_of_bounds(where, key):
    w0, base = _runs()
    got = _copy(base)
    (got if where == "got" else base)[0][-1][key] = NAN
    with pytest.raises(OutOfBounds) as failure:
        assert_same_training(w0, base, got, STEPS, f"NaN {key} in {where}")
    assert failure.value.worst == math.inf and key in str(failure.value)


def test_a_nan_metric_is_out_of_bounds_with_other_scales():
    """The train-rm form: its own metrics and scales, its own must-be-identical keys."""
    base = [{"step": 1, "train/loss": 0.7, "val/accuracy": 0.5}]
    assert metric_violations(base, [dict(base[0])], {"train/loss": 0.0}, ("val/accuracy",)) == []
    for key in ("train/loss", "val/accuracy"):
        got = [dict(base[0], **{key: NAN})]
        assert [r for r, _ in metric_violations(base, got, {"train/loss": 0.0}, ("val/accuracy",))] == [math.inf]


@pytest.mark.parametrize("name", ["layer.weight", "norm.weight"])
def test_a_nan_weight_is_out_of_bounds(name):
    w0, base = _runs()
    got = _copy(base)
    got[1][name][3] = NAN
    with pytest.raises(OutOfBounds) as failure:
        assert_same_training(w0, base, got, STEPS, f"NaN in {name}")
    assert failure.value.worst == math.inf and name in str(failure.value)


@pytest.mark.parametrize("name", ["layer.weight", "norm.weight"])
def test_a_nan_in_the_baseline_weights_fails(name):
    """A NaN baseline matrix fails the vacuity check (its update is no check at all), a NaN vector its bound."""
    w0, base = _runs()
    got = _copy(base)
    base[1][name][3] = NAN
    with pytest.raises(AssertionError, match="not finite" if name == "layer.weight" else "out of bounds"):
        assert_same_training(w0, base, got, STEPS, f"NaN baseline {name}")
