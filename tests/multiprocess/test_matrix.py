"""The composition matrix (issue 44): 2 `tripod train` steps of tiny models for every pair of values of the five
features users combine, each cell run or refused in one line that names the key and the physical reason:

    rollout   colocated                  | on its own ranks (1 trainer rank + 1 rollout rank), staleness 1
    turns     single-turn                | multi-turn: the built-in calculator tool and the GSM8K interaction
    model     dense (tiny Qwen2)         | MoE (tiny Qwen3-MoE) with R3 routing replay
    params    full                       | LoRA (rank 4, all linear layers: the experts too)
    reward    a rule function            | a reward model only (a data source without a rule function)

PAIRWISE is a covering array of strength 2 (6 rows for 5 binary factors), ALL_IN_ONE every second value at once;
REFUSED the cells tripod is expected to refuse. GRPO with the KL loss, fp32, every cell in its own world, all side
by side (train_together). What each running cell must show, read from its run directory (metrics.jsonl, the
trainer.rollout_data_dir dumps) and its ranks' output:
  * every cell: 2 steps logged, every logged metric finite; on every batch sampled by the trainer's own weights
    (staleness 0: every colocated step, the first own-ranks step) rollout_corr/abs_diff_max <= 1e-5: the rollout's
    log-probs of the trained tokens are the trainer's recompute (tests/multiprocess/test_agent_rollout.py's bound),
    so a token, log-prob, mask or routing record out of place shows; with LoRA the step plan takes the reference from
    the actor with its adapters off;
  * multi-turn: tool calls and interaction turns happened (tool/calls_mean > 0 in some step, multi_turn/turns_mean > 1
    every step) and the tool / user tokens are not trained: in the dump every turn has trained == (role ==
    "assistant"), the turns add up to the response, a tool turn and a user turn with tokens occur, and the trained
    share of the dumped response tokens is below 1;
  * MoE with R3: moe/routing_mismatch_frac == 0 every step (under R3 it compares the replayed ids with the record, so
    a record joined out of place over the turns shows in the log-prob gap above rather than here);
  * own ranks at staleness 1: the rollout correction is on by default (the step plan says "rollout correction on",
    rollout_corr/rollout_is_* every step), async/staleness_mean is logged, a step trains on a batch one step old
    (async/staleness_max 1) and the correction sees its gap (rollout_corr/k3_kl > 0 there);
  * reward model: reward/model_mean every step.
A tiny random model never writes a hermes `<tool_call>` by itself: the tokenizer here has TOOL_CALL_TOKENS extra
tokens, each a whole calculator call, so about one model turn in two calls the tool and the others get the
interaction's reply. docs/features.md holds the table.

The planted bug (tests/multiprocess/workers/train_with_hooks.py `scored_batch_loses_token_codes`): the rollout's own
ranks send their scored batches without the token codes, so the trainer trains the tool and user tokens; the
multi-turn own-ranks cell's check must fail on it."""
from __future__ import annotations

import itertools
import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import dapo_reward
from tests.helpers.common import make_tiny_hf_model
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import metrics, train, train_together, world_size_of
from tests.multiprocess.test_agent_rollout import LOGPROB_BOUND
from tripod.engine import agent

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

FACTORS = ("rollout", "turns", "model", "params", "reward")
VALUES = {"rollout": ("colocated", "own"), "turns": ("single", "multi"), "model": ("dense", "moe"),
          "params": ("full", "lora"), "reward": ("rule", "rm")}
# A pairwise covering array (strength 2) of the 5 binary factors: in every two columns each of 00, 01, 10, 11 occurs
# in some row (test_the_matrix_is_pairwise checks it). Row 0 is all zeros and column j marks a different 3-subset of
# rows 1-5: two 3-subsets of 5 rows always meet (11), neither holds the other (10, 01), and row 0 gives 00.
PAIRWISE = ((0, 0, 0, 0, 0),
            (1, 1, 1, 0, 0),
            (1, 1, 0, 1, 0),
            (1, 0, 1, 0, 1),
            (0, 1, 0, 1, 1),
            (0, 0, 1, 1, 1))
ALL_IN_ONE = (1, 1, 1, 1, 1)
ROWS = PAIRWISE + (ALL_IN_ONE,)
# cell -> (the key its refusal must name, a word of its reason): the cells tripod refuses, each checked to exit the
# CLI's config-error path (exit 2, one line, no model built). None: every cell runs.
REFUSED: dict[str, tuple[str, str]] = {}
PLANTED = ("own-multi-dense-lora-rule", "scored_batch_loses_token_codes")  # (cell, bug)

STEPS = 2
TOOL_CALL_TOKENS = 24  # of the 128 ids: a sampled token calls the calculator about as often as one of STOP_IDS ends
STOP_IDS = list(range(40, 66))  # a turn (a random model rarely samples EOS), as tests/multiprocess/test_agent_rollout.py
CONFIGS = os.path.join(os.path.dirname(agent.__file__), "configs")  # the built-in tool and interaction files
# The rule: tests/helpers/dapo_reward.py's (registered in every rank by tests/multiprocess/workers/tripod_commands.py):
# a random model never answers `#### N` right, so the arithmetic rule would give every row 0, every GRPO advantage 0
# and no update; this one alternates 0 / 1 in the groups of odd answers. arithmetic_rm has no rule function: the
# reward model scores those rows.
RULE_SOURCE, RM_SOURCE = dapo_reward.DATA_SOURCE, "arithmetic_rm"


def cell_name(row: tuple[int, ...]) -> str:
    return "-".join(VALUES[f][v] for f, v in zip(FACTORS, row))


def factors_of(name: str) -> dict[str, str]:
    return dict(zip(FACTORS, name.split("-")))


def test_the_matrix_is_pairwise():
    for i, j in itertools.combinations(range(len(FACTORS)), 2):
        seen = {(row[i], row[j]) for row in PAIRWISE}
        assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}, (FACTORS[i], FACTORS[j], seen)
    assert len(set(PAIRWISE)) == len(PAIRWISE) == 6 and ALL_IN_ONE not in PAIRWISE
    assert PLANTED[0] in map(cell_name, ROWS) and not set(REFUSED) - set(map(cell_name, ROWS))


def tool_calling_tokenizer():
    """tripod's character tokenizer plus TOOL_CALL_TOKENS tokens, each a whole hermes call of the calculator."""
    from tripod.engine.agent.hermes import format_tool_call
    from tripod.engine.data.char_tokenizer import char_tokenizer

    tok = char_tokenizer()
    tok.add_tokens([format_tool_call("calculator", {"expression": f"{k} + 1"}) for k in range(TOOL_CALL_TOKENS)])
    return tok


def make_matrix_setup(tmp) -> dict[str, str]:
    """The tiny dense and MoE actors and the reward model (one tokenizer for all), and the training prompts of the
    rule cells and of the reward-model cells, each row with the GSM8K interaction's kwargs."""
    from tripod.engine.data import make_arithmetic_rows, write_prompt_parquet

    dense = make_ppo_setup(tmp / "dense")
    moe = make_ppo_setup(tmp / "moe", family="qwen3_moe")
    rm = make_tiny_hf_model(tmp, "qwen2", seed=3, subdir="rm", sequence_classification=True, vocab_size=128,
                            max_position_embeddings=256)
    tok = tool_calling_tokenizer()
    for d in (dense["model"], moe["model"], rm):
        tok.save_pretrained(d)
    out = {"dense": dense["model"], "moe": moe["model"], "rm": rm}
    for source in (RULE_SOURCE, RM_SOURCE):
        rows = make_arithmetic_rows(16, seed=0, max_digits=1, instruction="Answer as #### N.")
        for row in rows:
            row["data_source"] = source
            row["extra_info"]["interaction_kwargs"] = {"name": "gsm8k",
                                                       "ground_truth": row["reward_model"]["ground_truth"]}
        out[source] = str(tmp / f"train_{source}.parquet")
        write_prompt_parquet(rows, out[source])
    out["val"] = out[RULE_SOURCE]  # never validated (every row needs its interaction_kwargs all the same)
    return out


def cell_overrides(name: str, setup: dict[str, str], run_dir: str) -> list[str]:
    f = factors_of(name)
    model = setup["moe" if f["model"] == "moe" else "dense"]
    args = tiny_overrides({"train": setup[RM_SOURCE if f["reward"] == "rm" else RULE_SOURCE], "val": setup["val"],
                           "model": model}, run_dir, steps=STEPS) + [
        # GRPO with the KL loss (a reference: the model, or the LoRA actor with its adapters off), two mini-batches
        # a step (the old log-probs recomputed), no validation
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
        "trainer.threads_per_rank=1", f"trainer.rollout_data_dir={run_dir}/dump",
        "reward_model.num_workers=1"]  # rule rewards scored inline: no pool processes
    if f["rollout"] == "own":
        args += ["rollout.nnodes=1", "rollout.n_gpus_per_node=1", "async_training.staleness_threshold=1",
                 "async_training.require_batches=2"]  # 2 mini-batches of 2 prompts: one trainer step
    if f["turns"] == "multi":
        args += ["actor_rollout_ref.rollout.multi_turn.enable=true",
                 f"actor_rollout_ref.rollout.multi_turn.tool_config_path={CONFIGS}/calculator_tool.yaml",
                 f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={CONFIGS}/gsm8k_interaction.yaml",
                 "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
                 "actor_rollout_ref.rollout.multi_turn.max_user_turns=2",
                 f"actor_rollout_ref.rollout.stop_token_ids=[{','.join(map(str, STOP_IDS))}]",
                 "data.max_response_length=144"]  # room for a tool turn and the interaction's ~100-token reply
    if f["model"] == "moe":
        args += ["actor_rollout_ref.actor.router_replay.mode=R3",
                 "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]
    if f["params"] == "lora":
        args += ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.target_modules=[all-linear]"]
    if f["reward"] == "rm":
        args += ["reward_model.enable=true", f"reward_model.model.path={setup['rm']}",
                 "reward_model.micro_batch_size_per_gpu=4"]
    return args


def refusal_of(args: list[str]) -> str | None:
    """The one line `tripod train recipes/defaults.yaml *args` refuses with before any model is built (the checks
    engine/preflight.py's prepare_train runs, here in-process), or None."""
    from tripod.engine.launch import USER_ERRORS, detect_launch, error_line
    from tripod.engine.preflight import prepare_train

    try:
        prepare_train("recipes/defaults.yaml", list(args), detect_launch())
    except USER_ERRORS as e:
        return error_line(e)
    return None


def _dump(run_dir: str, step: int) -> list[dict]:
    with open(os.path.join(run_dir, "dump", f"{step}.jsonl")) as f:
        return [json.loads(line) for line in f]


def cell_problems(name: str, run_dir: str, log: str) -> tuple[list[str], str]:
    """(what the cell's run fails of the module docstring's checks, a line of the values it logged)."""
    f, problems = factors_of(name), []
    rows = metrics(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []
    steps = [m for m in rows if "actor/pg_loss" in m]
    if [m["step"] for m in steps] != list(range(1, STEPS + 1)):
        problems.append(f"training steps logged: {[m.get('step') for m in steps]}, not 1..{STEPS}")
    bad = [f"step {m.get('step')} {k}={v}" for m in rows for k, v in m.items()
           if isinstance(v, (int, float)) and not math.isfinite(v)]
    if bad:
        problems.append(f"metrics not finite: {bad[:6]}")

    def every(key: str) -> list[float] | None:
        values = [m.get(key) for m in steps]
        if not steps or None in values:
            problems.append(f"{key} not logged every step: {values}")
            return None
        return values

    # fp32: on a batch sampled by the trainer's own weights the rollout's log-probs are the trainer's recompute
    gap = [m.get("rollout_corr/abs_diff_max") for m in steps]
    stale_max = [m.get("async/staleness_max", 0.0) for m in steps]
    seen = [f"abs_diff_max={gap}"]
    if any(not s and not (g is not None and g <= LOGPROB_BOUND) for g, s in zip(gap, stale_max)):
        problems.append(f"rollout vs trainer log-probs on fresh batches: rollout_corr/abs_diff_max {gap} (staleness "
                        f"{stale_max}), not <= {LOGPROB_BOUND}")
    if f["turns"] == "multi":
        turns, calls = every("multi_turn/turns_mean"), every("tool/calls_mean")
        seen.append(f"turns_mean={turns} tool_calls_mean={calls}")
        if turns is not None and not all(t > 1 for t in turns):
            problems.append(f"multi_turn/turns_mean {turns}: some step had no tool or user turn")
        if calls is not None and not sum(calls) > 0:
            problems.append(f"tool/calls_mean {calls}: no tool was called")
        roles, trained, total = {}, 0, 0
        for k in range(1, STEPS + 1):
            for row in _dump(run_dir, k) if os.path.exists(os.path.join(run_dir, "dump", f"{k}.jsonl")) else []:
                if sum(t["n_tokens"] for t in row["turns"]) != len(row["response_ids"]):
                    problems.append(f"step {k} row {row['row']}: its turns do not add up to its response")
                if any(t["trained"] != (t["role"] == "assistant") for t in row["turns"]):
                    problems.append(f"step {k} row {row['row']}: a tool / user turn trained or a model turn not")
                for t in row["turns"]:
                    roles[t["role"]] = roles.get(t["role"], 0) + (t["n_tokens"] > 0)
                    trained += t["n_tokens"] * t["trained"]
                    total += t["n_tokens"]
        seen.append(f"dump turns by role={roles} trained_frac={trained / max(total, 1):.3f}")
        if not (roles.get("tool") and roles.get("user")) or not trained < total:
            problems.append(f"tool/user tokens untrained: the dumped rows have turns {roles} and {trained} of "
                            f"{total} response tokens trained; a multi-turn run needs tool and user turns, untrained")
    if f["model"] == "moe":
        frac = every("moe/routing_mismatch_frac")
        seen.append(f"routing_mismatch_frac={frac}")
        if frac is not None and any(v != 0 for v in frac):
            problems.append(f"R3: moe/routing_mismatch_frac {frac}, not 0")
    if f["rollout"] == "own":
        is_mean, stale = every("rollout_corr/rollout_is_mean"), every("async/staleness_mean")
        k3 = [m.get("rollout_corr/k3_kl") for m in steps]
        seen.append(f"rollout_is_mean={is_mean} staleness_mean={stale} staleness_max={stale_max} k3_kl={k3}")
        if 1.0 not in stale_max:
            problems.append(f"async/staleness_max {stale_max}: no step trained on a batch one step old")
        # a batch one step old was sampled by other weights than the trainer's: the correction sees a gap (fp32: the
        # embedded rollout's log-probs equal the trainer's bit for bit on the same weights)
        if any(s and not (k or 0) > 0 for s, k in zip(stale_max, k3)):
            problems.append(f"rollout_corr/k3_kl {k3} with staleness {stale_max}: a stale batch without a gap "
                            "(did the first step update nothing?)")
        if "rollout correction on" not in log:
            problems.append("the step plan does not say 'rollout correction on' (staleness 1)")
    if f["reward"] == "rm":
        seen.append(f"model_mean={every('reward/model_mean')}")
    if f["params"] == "lora" and "reference the actor with its LoRA adapters off" not in log:
        problems.append("the step plan does not take the reference from the LoRA actor with its adapters off")
    return problems, "; ".join(seen)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every cell of ROWS (refused or run side by side, each in its own world) and the planted cell: {cell:
    (problems, values seen)}, {cell: refusal line}, the planted cell's (problems, values seen), and the seconds."""
    import time

    start = time.monotonic()
    tmp = tmp_path_factory.mktemp("matrix")
    setup = make_matrix_setup(tmp)
    names = [cell_name(r) for r in ROWS]
    args = {n: cell_overrides(n, setup, str(tmp / n)) for n in names}
    refusals = {n: refusal_of(a) for n, a in args.items()}
    runs = {n: a for n, a in args.items() if n not in REFUSED and refusals[n] is None}
    planted = PLANTED[0] + "-planted"
    runs[planted] = cell_overrides(PLANTED[0], setup, str(tmp / planted))
    # the refused cells through the CLI (its one-line error and exit 2), beside the runs
    with ThreadPoolExecutor(max(len(REFUSED), 1)) as pool:
        cli = {n: pool.submit(train, args[n], 300) for n in REFUSED}
        crashed = ""
        try:
            train_together(runs, str(tmp), run_envs={planted: {"TRIPOD_TEST_PLANT": PLANTED[1]}})
        except AssertionError as e:  # each run's failure, with its log's tail; the cells that ran are still checked
            crashed = str(e)
        cli = {n: f.result() for n, f in cli.items()}
    out = {}
    for n in list(runs):
        with open(tmp / f"{n}.log") as f:
            log = f.read()
        failed = re.search(rf"^run {re.escape(n)}: .*?(?=^run \S+: |\Z)", crashed, re.M | re.S)
        problems, seen = cell_problems(PLANTED[0] if n == planted else n, str(tmp / n), log)
        out[n] = ([f"the run failed: {failed.group(0)[-4000:]}"] if failed else []) + problems, seen
    for n in names:
        if n not in runs:
            out[n] = [], ""
    return {"cells": {n: out[n] for n in names}, "refusals": refusals, "cli": cli, "planted": out[planted],
            "worlds": {n: world_size_of(a) for n, a in runs.items()}, "seconds": time.monotonic() - start}


def test_every_cell_runs_or_is_refused_in_one_line(matrix):
    failures = []
    for name, refusal in matrix["refusals"].items():
        if name in REFUSED:
            key, why = REFUSED[name]
            proc = matrix["cli"][name]
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("tripod train: error")]
            if refusal is None or key not in refusal or why not in refusal:
                failures.append(f"{name}: expected refused naming {key} ({why}), the config checks say {refusal!r}")
            elif proc.returncode != 2 or len(lines) != 1 or refusal not in lines[0] or "step plan" in proc.stdout:
                failures.append(f"{name}: the CLI's refusal is not one config-error line (exit {proc.returncode}): "
                                f"{proc.stdout[-2000:]}")
        elif refusal is not None:
            failures.append(f"{name}: expected to run, refused: {refusal}")
    assert not failures, "\n".join(failures)


def test_every_cell_that_runs_passes_its_checks(matrix):
    print(f"matrix: {len(matrix['cells'])} cells + the planted one in {matrix['seconds']:.0f} s "
          f"(worlds {matrix['worlds']})")
    failures = []
    for name, (problems, seen) in matrix["cells"].items():
        refusal = matrix["refusals"][name]
        verdict = f"refused: {refusal}" if refusal else "FAILED" if problems else "runs"
        print(f"MATRIX {name}: {verdict}; {seen}")
        failures += [f"{name}: {p}" for p in problems]
    assert not failures, "\n".join(failures)


def test_lost_token_codes_fail_the_multi_turn_check(matrix):
    """The planted bug: the scored batches of the rollout's own ranks lose their token codes on the wire."""
    problems, seen = matrix["planted"]
    print(f"MATRIX planted {PLANTED[1]} on {PLANTED[0]}: {seen}; problems: {problems}")
    assert any(p.startswith("tool/user tokens untrained") for p in problems), problems
    assert not any(p.startswith("the run failed") for p in problems), problems  # caught by the check, not a crash
