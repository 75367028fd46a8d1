"""Sequence parallel (TP2+SP) and interleaved virtual pipeline stages (PP2 x VPP2) train like one rank.

Three tiny PPO steps (greedy rollouts, 2 mini-batches per step, actor + critic + reference all in the layout
under test) at (TP, PP, VPP, SP) = (1,1,-,off), (2,1,-,on) and (1,2,2,off). Compared: the logged losses, grad
norms, KL and rollout lengths of every step, and the actor's exported weights after step 3.

Bounds, from the arithmetic (float32, unit roundoff u = 6e-8):
- Metrics are O(1) sums of at most ~4k float32 terms whose order differs between layouts (TP splits the
  hidden and vocab reductions, PP/VPP move the same ops between processes, thread counts differ). A random-walk
  rounding error is about sqrt(n) * u ~ 4e-6 relative; we allow 1e-5 (rel and abs, abs for near-zero losses).
- Weights: the optimizer is Adam with eps = 1 (`optim.eps=1.0`) and lr = 0.1. With clipped gradients
  (grad_clip = 1, so |g_i| <= 1 = eps) the update lr * m/(sqrt(v) + eps) is 2/eps-Lipschitz in each gradient
  element, so a gradient difference |dg| moves a weight by at most 2 * lr / eps * |dg| per update: Adam's
  sign-like amplification of near-zero gradients is gone. The clipped gradients differ by at most
  rho = 1e-5 (the metric bound above, relative to ||g|| <= 1), so after U = 6 updates
  |dw| <= 2 * U * lr / eps * rho = 1.2e-5. A typical weight moves ~1e-3 over the run, so a real bug
  (a wrong split, a lost chunk gradient) shows up two orders of magnitude above the bound.
`test_planted_bugs_break_the_equivalence` proves both checks fail on a planted bug.
All the runs, planted ones included, are made once by the `runs` fixture (the runs of one world size in one torchrun
world, tests/helpers/trainer_runs.py's train_in_worlds); the tests assert on their outputs.
"""
import json
import os

import pytest
from safetensors.torch import load_file

from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import final_actor_weights_of, train_in_worlds

COMPARED = ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm", "actor/ppo_kl",
            "critic/score/mean", "response_length/mean")
METRIC_TOL = 1e-5
LR, EPS, STEPS, UPDATES_PER_STEP = 0.1, 1.0, 3, 2
WEIGHT_TOL = 2 * STEPS * UPDATES_PER_STEP * LR / EPS * METRIC_TOL
OPTIM = [f"actor_rollout_ref.actor.optim.lr={LR}", f"critic.optim.lr={LR}", f"actor_rollout_ref.actor.optim.eps={EPS}",
         f"critic.optim.eps={EPS}", "actor_rollout_ref.actor.grad_clip=1.0", "critic.grad_clip=1.0"]
SETTINGS = ["actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "critic.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.response_length=6",
            "trainer.val_before_train=false"] + OPTIM
SP = ["actor_rollout_ref.actor.megatron.sequence_parallel=true"]
VPP = ["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"]
LAYOUTS = {"base": (1, 1, 1, []), "tp2_sp": (2, 1, 2, SP), "pp2_vpp2": (1, 2, 2, VPP)}
# planted bugs of tests/multiprocess/workers/train_with_hooks.py: one step each, in the layout it breaks
PLANTED = [("tp2_sp", "sp_value_grad"), ("pp2_vpp2", "vpp_drop_chunk_grad")]


def _args(setup, run_dir, layout, steps=STEPS):
    tp, pp, world, extra = LAYOUTS[layout]
    return tiny_overrides(setup, run_dir, world=world, tp=tp, pp=pp, steps=steps) + SETTINGS + extra


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _metric_mismatches(want, got):
    """(step, key, want, got) of every compared metric outside the bound, matching rows by step."""
    bad, by_step = [], {m["step"]: m for m in got}
    for a in want:
        b = by_step.get(a["step"], {})
        for k in COMPARED:
            if k in a and b.get(k) != pytest.approx(a[k], abs=METRIC_TOL, rel=METRIC_TOL):
                bad.append((a["step"], k, a[k], b.get(k)))
    return bad


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three layouts' runs and the planted-bug runs (one torchrun world per world size, one thread per rank, so
    no run's arithmetic depends on another) and the layouts' final actor weights, exported in one 1-rank world."""
    tmp = tmp_path_factory.mktemp("sp_vpp")
    setup = make_ppo_setup(tmp)
    out = {"setup": setup, "tmp": tmp}
    run_dirs = {layout: str(tmp / layout) for layout in LAYOUTS}
    plan = {layout: (LAYOUTS[layout][2], _args(setup, run_dirs[layout], layout), None) for layout in LAYOUTS}
    plan |= {f"{layout}_{bug}": (LAYOUTS[layout][2], _args(setup, str(tmp / f"{layout}_{bug}"), layout, steps=1), bug)
             for layout, bug in PLANTED}
    train_in_worlds(plan, str(tmp))
    weights = final_actor_weights_of({d: STEPS for d in run_dirs.values()})
    for layout, run_dir in run_dirs.items():
        out[layout] = (run_dir, _metrics(run_dir), weights[run_dir])
    return out


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["tp2_sp", "pp2_vpp2"])
def test_layout_trains_like_one_rank(runs, layout):
    _, base, want = runs["base"]
    _, metrics, got = runs[layout]
    assert [m["step"] for m in metrics] == [m["step"] for m in base] == list(range(1, STEPS + 1))
    assert not _metric_mismatches(base, metrics), _metric_mismatches(base, metrics)
    assert base[-1]["actor/pg_loss"] != 0.0 and base[-1]["critic/vf_loss"] > 0.0
    start = load_file(os.path.join(runs["setup"]["model"], "model.safetensors"))
    assert got.keys() == want.keys()
    moved = max((want[n] - start[n]).abs().max().item() for n in want)
    assert moved > 20 * WEIGHT_TOL, f"training barely moved the weights ({moved}); the bound would prove nothing"
    diffs = {name: (got[name] - want[name]).abs().max().item() for name in want}
    print(f"{layout}: max |dw| {max(diffs.values()):.2e} (bound {WEIGHT_TOL:.1e}), max weight movement {moved:.2e}")
    for name, diff in diffs.items():
        assert diff <= WEIGHT_TOL, f"{layout} {name}: max |dw| = {diff:.3e} > {WEIGHT_TOL:.1e}"


@pytest.mark.dist
@pytest.mark.parametrize("layout,bug", PLANTED)
def test_planted_bugs_break_the_equivalence(runs, layout, bug):
    """One step with a planted bug must fail the same metric check that the correct layout passes."""
    run_dir = str(runs["tmp"] / f"{layout}_{bug}")
    assert [m["step"] for m in _metrics(run_dir)] == [1]
    bad = _metric_mismatches(runs["base"][1][:1], _metrics(run_dir))
    assert bad and all(got is not None for *_, got in bad), (bug, bad)
    print(f"planted {bug}: {bad}")
