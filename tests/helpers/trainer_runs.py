"""Running `tripod train` from tests, and the cross-layout equivalence check with its arithmetic bounds.

`train(args)` runs the real CLI in a subprocess (optionally through tests/multiprocess/workers/train_with_hooks.py, which can register
a test reward or plant a bug), `train_together({name: args})` makes independent runs side by side, each in a test world of its own,
`train_in_worlds({name: (world, args, bug)})` makes many runs with one torchrun world per world size (one process
start per rank for all the runs of that size), `final_actor_weights_of` exports several runs' final actor weights in
one process, `tripod_in_one_world` runs CLI commands in one torchrun world; `assert_same_training(base, other)` compares two finished runs.

Why the bounds are what they are (fp32 everywhere, u = 2**-24 is the unit roundoff):
  * A layout changes only the order of fp32 reductions (TP splits a dot product into partial sums that are then
    all-reduced, PP/DP/micro-batching split the token sums of the gradients; the CPU's BLAS kernel and thread count
    change the order again). A sum of n terms computed in any order is within gamma_n = n*u/(1 - n*u) of the exact
    sum, relative to the sum of the terms' magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 2nd
    ed., Thm 3.1 / eq. 3.5). This holds for every summation order, so for every CPU, kernel and thread count.
  * In the tiny runs no reduction is longer than N_RED = 256 terms (hidden 64, MLP 96, vocab padded to 128*TP <= 256,
    attention over <= 70 positions, gradient sums over <= 2 rows x 70 tokens). A weight gradient is the end of a chain
    of at most DEPTH = 80 dependent reductions (4 layers x 9 forward reductions: 2 RMSNorms, QKV, scores, softmax,
    PV, out-projection, MLP in and out; + final norm, LM head, log-softmax, loss mean = 40; the backward pass mirrors
    them). To first order the relative errors add along the chain: REL = DEPTH * N_RED * u = 1.2e-3. Activations are
    RMS-normalised and the weights random, so each stage is well conditioned (no stage amplifies relative error by
    much more than 1); REL is the bound for a quantity whose terms do not cancel, and REL * (sum of |terms|) for one
    whose terms do (see METRIC_SCALE).
  * Weights are compared with plain SGD (optim.optimizer=sgd, megatron's momentum 0.9): the total update U = w_T - w_0
    is a fixed linear combination of the step gradients, so a relative gradient error e gives ||dU|| <= e * ||U|| to
    first order (the gradients' dependence on earlier steps' weights is of order lr * ||Hessian|| * e, below e for a
    stable step size). Adam is not linear: m/sqrt(v) turns a 1e-9 difference in a near-zero gradient into a step of
    size lr, which is why it is not used for this comparison. Storing w_t in fp32 rounds every step by <= u*|w_t|,
    in each run: + 2 * K * u * max|w| per element after K optimizer steps.
  * Rollouts are greedy: the token sequences must be identical, so rewards and response lengths compare exactly. (An
    argmax could flip only if two logits were within ~REL of each other; with 128 random logits per token and ~70
    tokens per run that is a chance of order 1e-3 per run, not a systematic failure.)
A bug in a split rule, a missing gradient, or a wrong DP/micro-batch scaling changes these quantities by O(1)
relative; the planted-bug tests in tests/multiprocess/test_layout_equivalence.py show that the check fails on such bugs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from tests.helpers.bounds import excess
from tests.helpers.common import DIST_DIR, REPO_ROOT

TRIPOD = [sys.executable, "-m", "tripod"]
HOOKED_TRIPOD = [sys.executable, str(DIST_DIR / "train_with_hooks.py")]

U32 = 2.0 ** -24
N_RED = 256
DEPTH = 80
REL = DEPTH * N_RED * U32  # 1.22e-3
# Sum of |terms| per unit of the metric, where the metric's terms can cancel: pg_loss is a token mean of
# advantage * ratio with whitened (unit-std) or [0, 1]-score advantages and ratios near 1; ppo_kl a token mean of
# differences of log-probs, each at most log(vocab=128) ~ 4.9 in size; vf_loss a mean of squares (no cancellation,
# but of differences value - return whose parts are O(1)). Grad norms are norms: no cancellation.
METRIC_SCALE = {"actor/pg_loss": 1.0, "actor/ppo_kl": 5.0, "actor/kl_loss": 5.0, "actor/entropy": 0.0,
                "critic/vf_loss": 1.0, "actor/grad_norm": 0.0, "critic/grad_norm": 0.0}
EXACT = ("critic/score/mean", "response_length/mean")  # functions of the greedy token sequences only

# Same arithmetic in every compared run: greedy rollouts, one response per prompt, 2 mini-batches of 2 prompts per
# step with micro-batches of 1, plain SGD for the actor and the critic (see above). lr 2e-3 keeps every PPO ratio far
# from the clip range (ppo_kl ~ 1e-2, pg_clipfrac = vf_clipfrac = 0, asserted), so no token sits at a branch of the
# clipped losses where an O(u) difference could switch the gradient; weights still move >= 100x their fp32 rounding.
GREEDY = ["actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.n=1",
          "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
          "actor_rollout_ref.rollout.response_length=6"]
LINEAR_OPTIM = ["actor_rollout_ref.actor.optim.optimizer=sgd", "critic.optim.optimizer=sgd",
                "actor_rollout_ref.actor.optim.lr=2e-3", "critic.optim.lr=2e-3"]


def env(threads: int = 1, **extra: str) -> dict[str, str]:
    """Every run, at any world size, with the same thread count (engine/cli/__init__.py honours OMP_NUM_THREADS)."""
    out = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false")
    out["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    out.update(extra)
    return out


def train(args: list[str], timeout: float = 900, hooks: bool = False, run_env: dict | None = None,
          **popen) -> subprocess.CompletedProcess:
    """`tripod train recipes/defaults.yaml *args` (through train_with_hooks.py when `hooks`); stdout+stderr merged."""
    cmd = (HOOKED_TRIPOD if hooks else TRIPOD) + ["train", "recipes/defaults.yaml", *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=run_env or env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, **popen)


def world_size_of(args: list[str]) -> int:
    """The world a `tripod train` with these overrides spawns: trainer.nnodes x trainer.n_gpus_per_node (defaults 1),
    plus rollout.nnodes x rollout.n_gpus_per_node (defaults 0) for a rollout on its own ranks."""
    sizes = {"trainer.nnodes": 1, "trainer.n_gpus_per_node": 1, "rollout.nnodes": 0, "rollout.n_gpus_per_node": 0}
    for arg in args:
        key, _, value = arg.partition("=")
        if key in sizes:
            sizes[key] = int(value)
    return sizes["trainer.nnodes"] * sizes["trainer.n_gpus_per_node"] + \
        sizes["rollout.nnodes"] * sizes["rollout.n_gpus_per_node"]


def train_together(runs: dict[str, list[str]], log_dir: str, timeout: float = 900,
                   run_envs: dict[str, dict] | None = None) -> None:
    """Make every {name: overrides of `tripod train recipes/defaults.yaml`} at once, each in its own test world of
    the size its overrides ask for (`train_in_world`'s forked ranks: no CLI process, no interpreter start per rank),
    and wait for all; output goes to `log_dir/<name>.log`, whose tail a failure shows. For independent runs: with a
    fixed thread count per rank (`env`) a run's arithmetic does not depend on what runs beside it, only its wall time
    does. `run_envs[name]` is added to that run's ranks' environment (TRIPOD_TEST_PLANT=<bug> plants a bug of
    tests/multiprocess/workers/train_with_hooks.py there: the worker imports that module in every rank)."""
    from tests.helpers.common import launch_world, torchrun_failure

    procs = {}
    for name, args in runs.items():
        extra = {k: v for k, v in ((run_envs or {}).get(name) or {}).items() if os.environ.get(k) != v}
        procs[name] = launch_world("tripod_commands.py", world_size_of(args),
                                   json.dumps([["train", "recipes/defaults.yaml", *args]]),
                                   log=os.path.join(log_dir, f"{name}.log"), env=extra)
    failed = []
    for name, proc in procs.items():
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode != 0:
            with open(os.path.join(log_dir, f"{name}.log")) as f:
                failed.append(f"run {name}: " + torchrun_failure("tripod_commands.py", world_size_of(runs[name]),
                                                                proc.returncode, f.read()))
    assert not failed, "\n\n".join(failed)


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def export(ckpt: str, out: str) -> dict[str, torch.Tensor]:
    proc = subprocess.run([*TRIPOD, "export", ckpt, out], cwd=REPO_ROOT, env=env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return load_file(os.path.join(out, "model.safetensors"))


def final_actor_weights_of(run_steps: dict[str, int]) -> dict[str, dict[str, torch.Tensor]]:
    """The actor weights of several runs ({run_dir: steps}) at their last step, exported (to `<run_dir>_hf`) in one
    1-rank world (tests/multiprocess/workers/tripod_commands.py): one process start instead of one CLI + one spawn
    per run."""
    commands = [["export", os.path.join(d, "checkpoints", f"global_step_{s}", "actor"), d + "_hf"]
                for d, s in run_steps.items()]
    tripod_in_one_world(commands, 1)
    return {d: load_file(os.path.join(d + "_hf", "model.safetensors")) for d in run_steps}


def train_in_worlds(runs: dict[str, tuple[int, list[str], str | None]], log_dir: str, timeout: float = 1800,
                    command: tuple[str, str] = ("train", "recipes/defaults.yaml")) -> None:
    """Make every run {name: (world size, overrides of `tripod <command>`, planted bug or None)}: the runs of one world size
    one after another in one torchrun world of that size (tests/multiprocess/workers/tripod_commands.py: in-process,
    each on its own megatron groups), the worlds side by side; each world's output goes to `log_dir/world<N>.log`.

    One interpreter start and torch/megatron import per rank for all the runs of a world, where a `tripod train`
    each starts a world of its own (~12 CPU-seconds a process on the slow box, against ~2 for a tiny run's steps).
    A run's arithmetic does not depend on what ran before it in its world: every run seeds its own generators and
    builds its own models and groups (a 3-step run repeated three times in one world logs identical metrics), and
    one thread per rank fixes the reduction order. A planted bug (tests/multiprocess/workers/train_with_hooks.py) is
    in place for its own run only; the planted runs of a world go after its clean runs all the same."""
    from tests.helpers.common import launch_world, torchrun_failure

    worlds: dict[int, list[str]] = {}
    for name in sorted(runs, key=lambda n: runs[n][2] is not None):  # stable: clean runs first, in the given order
        worlds.setdefault(runs[name][0], []).append(name)
    procs = {}
    for world, names in worlds.items():
        commands = [{"argv": [*command, *runs[n][1]], "plant": runs[n][2]} for n in names]
        procs[world] = launch_world("tripod_commands.py", world, json.dumps(commands),
                                    log=os.path.join(log_dir, f"world{world}.log"))
    failed = []
    for world, proc in procs.items():
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with open(os.path.join(log_dir, f"world{world}.log")) as f:
            out = f.read()
        if proc.returncode != 0 or out.count("TRIPOD_COMMAND_OK ") != world * len(worlds[world]):
            failed.append(f"runs {worlds[world]}: " + torchrun_failure("tripod_commands.py", world, proc.returncode, out))
    assert not failed, "\n\n".join(failed)


def train_in_world(args: list[str], world: int, log: str | os.PathLike, timeout: float = 900,
                   env: dict[str, str] | None = None,
                   command: tuple[str, str] = ("train", "recipes/defaults.yaml")) -> subprocess.CompletedProcess:
    """`tripod train recipes/defaults.yaml *args` (or another `command`) in-process on the ranks of one `world`-rank test world (what
    `train(args)` does without the CLI process and its spawn: tests/multiprocess/workers/tripod_commands.py), with
    `env` added to the ranks' environment; output (rank 0's lines included) to the file `log` and `.stdout`."""
    from tests.helpers.common import launch_world

    proc = launch_world("tripod_commands.py", world, json.dumps([[*command, *args]]), log=log, env=env)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with open(log) as f:
        return subprocess.CompletedProcess([*command, *args], proc.returncode, f.read(), None)


def tripod_in_one_world(commands: list[list[str]], nproc: int, timeout: float = 600) -> str:
    """Run `tripod <command>` for each command in-process in one `nproc`-rank torchrun world (each command must need
    that world size); returns the merged output (rank 0 prints the commands' summary lines)."""
    from tests.helpers.common import run_torchrun

    out = run_torchrun("tripod_commands.py", nproc, json.dumps([[str(a) for a in c] for c in commands]),
                       timeout=timeout).stdout
    assert out.count("TRIPOD_COMMAND_OK ") == nproc * len(commands), out[-3000:]
    return out


class OutOfBounds(AssertionError):
    """Quantities outside their bounds; `worst` is the largest |diff| / bound (inf for a must-be-identical one, and
    for a NaN)."""

    def __init__(self, label: str, violations: list[tuple[float, str]]):
        violations = sorted(violations, reverse=True)
        self.worst = violations[0][0]
        shown = "\n  ".join(v for _, v in violations[:8])
        super().__init__(f"{label}: {len(violations)} quantities out of bounds, worst |diff|/bound "
                         f"{self.worst:.3g}:\n  {shown}")


def metric_violations(want: list[dict], got: list[dict], scales: dict[str, float] = METRIC_SCALE,
                      exact: tuple[str, ...] = EXACT) -> list[tuple[float, str]]:
    """(|diff| / bound, what) of every metric of `got` outside REL * (|baseline| + scale) of `want`'s (`scales`: the
    sum of |terms| per unit of each metric), or not identical for the `exact` ones; a NaN on either side is outside."""
    assert [m["step"] for m in got] == [m["step"] for m in want], f"steps {[m['step'] for m in got]}"
    out = []
    for a, b in zip(want, got):
        for k in exact:
            if k in a and b[k] != a[k]:  # != holds for a NaN
                out.append((float("inf"), f"step {a['step']} {k} = {b[k]}, baseline {a[k]} (must be identical)"))
        for k, scale in scales.items():
            if k in a:
                bound, diff = REL * (abs(a[k]) + scale), abs(b[k] - a[k])
                if (ratio := excess(diff, bound)) is not None:
                    out.append((ratio, f"step {a['step']} {k} = {b[k]:.7g}, baseline {a[k]:.7g}, "
                                       f"|diff| {diff:.3g} > bound {bound:.3g}"))
    return out


def weight_violations(w0: dict[str, torch.Tensor], base: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
                      opt_steps: int) -> list[tuple[float, str]]:
    """Per tensor: ||U_got - U_base|| <= REL * ||U_base|| + sqrt(numel) * 2 * K * u * max|w| (U = w_T - w_0); a NaN
    anywhere in a tensor is outside, and a baseline matrix that did not move (or is NaN) fails the check as vacuous."""
    assert got.keys() == base.keys(), f"tensors {sorted(got.keys() ^ base.keys())}"
    out, still = [], []
    for name in base:
        u_base, u_got = (base[name] - w0[name]).double(), (got[name] - w0[name]).double()
        storage = u_base.numel() ** 0.5 * 2 * opt_steps * U32 * float(base[name].abs().max())
        bound = REL * float(u_base.norm()) + storage
        diff = float((u_got - u_base).norm())
        if (ratio := excess(diff, bound)) is not None:
            out.append((ratio, f"{name} update differs by {diff:.3g} (||update|| {float(u_base.norm()):.3g}, "
                               f"bound {bound:.3g})"))
        # 1-D tensors (norm weights, biases) get tiny gradients in 6 steps; the matrices carry the check
        if u_base.dim() >= 2 and not float(u_base.norm()) > 10 * storage:
            still.append(name)
    assert not still, f"baseline tensors {still} did not move well above fp32 storage rounding (or are not finite): " \
                      "the check is vacuous"
    return out


def assert_same_training(w0: dict[str, torch.Tensor], base: tuple[list[dict], dict[str, torch.Tensor]],
                         got: tuple[list[dict], dict[str, torch.Tensor]], opt_steps: int, label: str) -> None:
    """Raise OutOfBounds listing every metric and weight update of `got` outside its bound around `base`."""
    violations = metric_violations(base[0], got[0]) + weight_violations(w0, base[1], got[1], opt_steps)
    if violations:
        raise OutOfBounds(label, violations)
