"""A multi-turn `tripod train` run end to end (embedded engine, one rank, a toy interaction answering every model turn:
tests/multiprocess/workers/agent_train.py): the ids the actor trains on are the ids the engine generated, position for
position, with the engine's log-probs, each model turn the engine's whole output (cut only at the response budget)
ending on a stop id where a user turn follows; the user tokens carry response_mask 0; the trainer's recomputed log-probs of
the model tokens equal the engine's within the single-turn bound (fp32 CPU: 1e-5, as
tests/multiprocess/workers/async_reference.py); the multi-turn metrics are logged and the rollout dump has `turns`;
with multi_turn.add_rollout_rewards each dumped score is the rule reward plus the interaction's turn and final scores,
once (planted by hand: the trainer not handing the agent to the scorer fails it).
With TRIPOD_TEST_AGENT_PLANT=reencode (the trajectory re-tokenized from its text) the identity check fails."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import torch

from tests.helpers.agent import model_segments
from tests.helpers.common import DIST_DIR, REPO_ROOT
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import env, metrics
from tests.multiprocess.workers.agent_train import FINAL_SCORE, TURN_SCORE

LOGPROB_BOUND = 1e-5  # fp32 embedded rollout vs the trainer's recompute (the single-turn tests' bound)
STOP_IDS = range(40, 66)  # a random model rarely samples EOS: a fifth of the vocabulary ends a turn, so turns are short
BUDGET = 40  # data.max_response_length: the response budget over all turns


def check_trained_ids_are_generated_ids(log_dir: str, bound: float = LOGPROB_BOUND,
                                        budget: int = BUDGET) -> tuple[int, list[float]]:
    """Every model segment of every updated row is an engine output for exactly the tokens before it, whole, with its
    log-probs: only the row's last segment may be shorter, and only where it ends at the response budget (`budget`
    tokens, the loop's cut); every other segment ends on a stop id (the engine stopped there and the loop kept the
    stop token; the ids in <log_dir>/stop_ids.json, which `run` writes). A prefix check alone passes a turn with its
    last token dropped. Returns (the number of rows with a masked (user) token inside their response, each update's
    largest engine / trainer log-prob gap on the model tokens)."""
    with open(os.path.join(log_dir, "stop_ids.json")) as f:
        stop_ids = set(json.load(f))
    outputs = {}
    with open(os.path.join(log_dir, "gen.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            outputs.setdefault(tuple(row["prompt"]), []).append((row["response"], row["log_probs"]))
    holes, gaps = 0, []
    for path in sorted(glob.glob(os.path.join(log_dir, "update_*.pt"))):
        b = torch.load(path)
        for i in range(b["input_ids"].shape[0]):
            p, mask = int(b["prompt_lens"][i]), b["response_mask"][i]
            seq = b["input_ids"][i].tolist()
            segments = model_segments(mask.long().tolist())
            holes += len(segments) > 1
            for k, (s, e) in enumerate(segments):
                key = tuple(seq[: p + s])
                assert key in outputs, f"{path} row {i}: the tokens before response position {s} were never an engine input"
                trained, logp = b["responses"][i, s:e].tolist(), b["rollout_log_probs"][i, s:e].tolist()
                # the n samples of a prompt share their first input: one of its outputs must be this segment, whole;
                # a cut one only at the budget, as the row's last segment
                cut = e == budget and k == len(segments) - 1
                same = [(ids, lp) for ids, lp in outputs[key] if ids == trained or (cut and ids[: e - s] == trained)]
                assert same, f"{path} row {i} positions {s}..{e}: the trained ids are not the engine's whole output " \
                             f"{[ids for ids, _ in outputs[key]]} (trained {trained}, budget {budget})"
                assert any(lp[: e - s] == logp for _, lp in same), \
                    f"{path} row {i} positions {s}..{e}: the rollout log-probs are not the engine's"
                if k < len(segments) - 1:
                    assert trained[-1] in stop_ids, \
                        f"{path} row {i} positions {s}..{e}: a model turn followed by a user turn ends on " \
                        f"{trained[-1]}, not on a stop id"
            assert (b["rollout_log_probs"][i][mask == 0] == 0).all()
        if "old_log_probs" in b:
            m = b["response_mask"] > 0
            gap = float((b["old_log_probs"] - b["rollout_log_probs"])[m].abs().max())
            assert gap <= bound, f"{path}: engine vs trainer log-prob gap {gap:.3g} > {bound}"
            gaps.append(gap)
    return holes, gaps


def stop_ids_of(model_dir: str) -> set[int]:
    """The ids that end a turn in these runs: STOP_IDS plus the model's EOS ids (config.json's and
    generation_config.json's `eos_token_id`, read here from the files)."""
    ids = set(STOP_IDS)
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(model_dir, name)):
            with open(os.path.join(model_dir, name)) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids


def run(tmp_path, name: str, plant: str | None = None, extra_args: tuple[str, ...] = (),
        model_overrides: dict | None = None) -> tuple[subprocess.CompletedProcess, str, str]:
    setup = make_ppo_setup(tmp_path, **(model_overrides or {}))
    run_dir, log_dir = str(tmp_path / name), str(tmp_path / f"{name}_log")
    os.makedirs(log_dir)
    with open(os.path.join(log_dir, "stop_ids.json"), "w") as f:
        json.dump(sorted(stop_ids_of(setup["model"])), f)
    args = tiny_overrides(setup, run_dir, steps=2) + [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", f"data.max_response_length={BUDGET}",
        "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.max_user_turns=2",
        "actor_rollout_ref.rollout.multi_turn.add_rollout_rewards=true",
        f"actor_rollout_ref.rollout.stop_token_ids=[{','.join(str(t) for t in STOP_IDS)}]",
        f"trainer.rollout_data_dir={run_dir}/dump", "trainer.val_before_train=false", "trainer.test_freq=-1",
        *extra_args]
    extra = {"TRIPOD_TEST_AGENT_LOG": log_dir, **({"TRIPOD_TEST_AGENT_PLANT": plant} if plant else {})}
    proc = subprocess.run([sys.executable, str(DIST_DIR / "agent_train.py"), "train", "recipes/defaults.yaml", *args],
                          cwd=REPO_ROOT, env=env(**extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    return proc, run_dir, log_dir


def check_multi_turn_run(tmp_path, extra_args: tuple[str, ...] = (), model_overrides: dict | None = None,
                         bound: float = LOGPROB_BOUND) -> None:
    """The run's checks (module docstring); tests/multiprocess/test_vllm.py runs them with rollout.name=vllm."""
    proc, run_dir, log_dir = run(tmp_path, "mt", extra_args=extra_args, model_overrides=model_overrides)
    assert proc.returncode == 0, proc.stdout[-4000:]
    holes, gaps = check_trained_ids_are_generated_ids(log_dir, bound)
    assert holes > 0, "no row had a user turn inside its response: the test exercised nothing"
    assert len(gaps) == 2, "the trainer recomputed no old log-probs to compare with the engine's"
    print(f"multi-turn rows: {holes}; engine vs trainer log-prob gap per update: {gaps}")
    steps = metrics(run_dir)
    for m in steps:
        assert m["multi_turn/turns_mean"] > 1 and m["multi_turn/turns_max"] >= 3, m
        assert 0 < m["multi_turn/model_token_frac"] < 1 and m["tool/calls_mean"] == 0.0
        assert m["multi_turn/generate_s"] > 0 and "multi_turn/tool_s" in m
    with open(os.path.join(run_dir, "dump", "1.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        assert sum(t["n_tokens"] for t in row["turns"]) == len(row["response_ids"])
        assert row["turns"][0]["role"] == "assistant" and row["turns"][0]["trained"]
        assert all(t["trained"] == (t["role"] == "assistant") for t in row["turns"])
        assert {"input", "output", "gts", "score", "step"} <= set(row)
        # the trained score is the rule reward (0 or 1) plus the interaction's scores, once: a turn score per user
        # turn (one more when the last reply did not fit the budget) and the final score
        rest = row["score"] - FINAL_SCORE - TURN_SCORE * sum(t["role"] == "user" for t in row["turns"])
        assert any(abs(rest - v) <= 1e-9 for v in (0.0, TURN_SCORE, 1.0, 1.0 + TURN_SCORE)), \
            f"score {row['score']} is not the rule reward plus the rollout rewards once ({rest=})"
    assert any(t["role"] == "user" for row in rows for t in row["turns"])


def test_multi_turn_training_trains_the_engines_tokens(tmp_path):
    check_multi_turn_run(tmp_path)


def test_a_planted_re_encoding_is_caught(tmp_path):
    proc, _, log_dir = run(tmp_path, "planted", plant="reencode")
    assert proc.returncode == 0, proc.stdout[-4000:]
    try:
        check_trained_ids_are_generated_ids(log_dir)
    except AssertionError as e:
        assert "not the engine's" in str(e) or "never an engine input" in str(e), e
    else:
        raise AssertionError("the re-encoded trajectories passed the token identity check")


def test_val_only_validates_multi_turn_rows_with_their_tools_and_stops(tmp_path):
    """trainer.val_only: one greedy multi-turn validation (each row's interaction_kwargs reach the interaction, so
    its rows have user turns), its agent metrics under val/, no training step and no checkpoint."""
    proc, run_dir, _ = run(tmp_path, "val", extra_args=("trainer.val_only=true",))
    assert proc.returncode == 0, proc.stdout[-4000:]
    steps = metrics(run_dir)
    assert [m["step"] for m in steps] == [0], steps
    m = steps[0]
    assert m["val/multi_turn/turns_mean"] > 1 and m["val/tool/call_rate"] == 0.0, m
    assert not any(k.startswith(("actor/", "multi_turn/")) for k in m), m
    assert not os.path.exists(os.path.join(run_dir, "checkpoints")) or not os.listdir(os.path.join(run_dir, "checkpoints"))


def test_multi_turn_on_a_two_rank_rollout_replica(tmp_path):
    """Rollout TP 2 (actor TP 2 on 2 ranks): the replica's first rank runs the rows, the tools and the interaction and
    hands each engine step to the other rank (engine/agent/scheduler.py's `follow`); the same checks hold."""
    check_multi_turn_run(tmp_path, ("trainer.n_gpus_per_node=2",
                                    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                    "actor_rollout_ref.rollout.tensor_model_parallel_size=2"))
