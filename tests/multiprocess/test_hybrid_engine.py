"""3D-HybridEngine on gloo: zero-redundancy resharding of the actor's training shards into rollout TP shards."""
import re

import pytest

from tests.helpers.common import make_tiny_hf_model, run_torchrun


def _parse(out):
    """One row per (case, rank); `recv` is what the transport counted from the tensors its collectives delivered.
    The ranks share one output: a report may follow another's text on its line (a tag never spans a bracket)."""
    pattern = (r"\[([^\[\]\n]+)\] rank (\d+) recv=(\d+) plan=(\d+) peak_extra=(\d+) limit=(\d+) gen_shard=\d+ "
               r"mean_recv=([\d.e+]+) hybridflow=([\d.e+]+)")
    return [dict(tag=m[0], rank=int(m[1]), recv=int(m[2]), plan=int(m[3]), peak=int(m[4]), limit=int(m[5]),
                 mean=float(m[6]), hybridflow=float(m[7])) for m in re.findall(pattern, out)]


# The worker holds its peak RSS growth against the plan's bytes: without huge pages, which round every large tensor up
# to 2 MB pages (tripod turns them on for its own ranks: engine/launch.py, default_huge_page_allocations).
EXACT_RSS = {"THP_MEM_ALLOC_ENABLE": "0"}


@pytest.mark.dist
def test_reshard_tp2pp2_to_rollout_tp1_and_tp2(tmp_path):
    hf = make_tiny_hf_model(tmp_path, "qwen2")
    rows = _parse(run_torchrun("hybrid_reshard.py", 4, hf, 2, 2, 1, "1,2", env=EXACT_RSS).stdout)
    assert len(rows) == 4 * 4
    assert all(r["recv"] == r["plan"] for r in rows)
    assert all(r["mean"] == r["hybridflow"] > 0 for r in rows)  # exact in the worker (Fractions); here as printed


@pytest.mark.dist
def test_reshard_tp2pp2dp2_to_rollout_tp2(tmp_path):
    hf = make_tiny_hf_model(tmp_path, "llama", tie_word_embeddings=True)
    rows = _parse(run_torchrun("hybrid_reshard.py", 8, hf, 2, 2, 2, "2", timeout=400, env=EXACT_RSS).stdout)
    assert len(rows) == 8 * 2
    assert all(r["recv"] == r["plan"] and r["mean"] == r["hybridflow"] > 0 for r in rows)


@pytest.fixture(scope="module")
def dense_round_trips(tmp_path_factory) -> str:
    """Both rollout TPs around a TP2 x PP2 actor, one after the other in one 4-rank world."""
    hf = make_tiny_hf_model(tmp_path_factory.mktemp("round_trip"), "qwen2", vocab_size=128)
    return run_torchrun("hybrid_actor_roundtrip.py", 4, hf, "2,1", timeout=600).stdout


@pytest.mark.dist
@pytest.mark.parametrize("rollout_tp", [2, 1])
def test_round_trip_around_a_megatron_actor(dense_round_trips, rollout_tp):
    assert f"OK rollout_tp={rollout_tp} layout=2,2,1,None" in dense_round_trips, dense_round_trips[-3000:]


@pytest.mark.dist
def test_round_trip_around_a_deepseek_moe_actor_with_expert_parallelism(tmp_path):
    """Actor TP2 x DP2 with EP2 x ETP1 (expert-DP 2) -> rollout TP2: experts move point to point; the generation
    shard equals the HF checkpoint's TP slice bit for bit, the counted bytes equal the plan, greedy generation
    equals transformers, rollout log-probs equal the actor's (1e-5), and training is unaffected by the round trip."""
    from tests.helpers.moe_models import make_tiny_moe_model

    hf = make_tiny_moe_model(tmp_path, "deepseek_v3", seed=1)
    out = run_torchrun("hybrid_actor_roundtrip.py", 4, hf, 2, 2, 1, 2, 1, timeout=600).stdout
    assert "OK rollout_tp=2 layout=2,1,2,1" in out


def test_tripod_plan_prints_groups_and_bytes(tmp_path, capsys):
    from tripod.engine.cli import main
    hf = make_tiny_hf_model(tmp_path, "qwen2")
    args = ["plan", "recipes/defaults.yaml", f"actor_rollout_ref.model.path={hf}", "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "--bucket-mb", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "micro-DP groups   [[0, 2], [1, 3]]" in out and "rollout TP groups [[0, 1], [2, 3]]" in out
    assert main(args[:-3] + ["actor_rollout_ref.rollout.tensor_model_parallel_size=4"]) == 2
    assert "must divide" in capsys.readouterr().err


# ---- rollout TP that training TP does not divide: point-to-point regrouping (parallel/hybrid_engine/regroup.py) ---
def _groups(out):
    return {(m[0], int(m[1])): (int(m[2]), m[3]) for m in
            re.findall(r"\[([^\[\]\n]+)\] rank (\d+) rollout_tp_rank=(\d+) group=(\[[\d, ]+\])", out)}


@pytest.mark.dist
@pytest.mark.parametrize("tp,pp,dp,tg,nproc,overrides,big", [
    (1, 1, 2, 2, 2, {}, None),                                        # NeMo-RL's TP1 training -> rollout TP2
    (2, 1, 2, 4, 4, dict(num_key_value_heads=4), None),               # every slice local: group [0, 2, 1, 3]
    (1, 2, 1, 2, 2, {}, None),                                        # the other stage's layers, point to point
    (2, 1, 3, 3, 6, dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, vocab_size=700),
     "12,6,4500,384"),                                                # neither divides: slice 1 straddles
], ids=["t1dp2-tg2", "t2dp2-tg4", "t1pp2-tg2", "t2dp3-tg3"])
def test_reshard_to_a_rollout_tp_larger_than_training_tp(tmp_path, tp, pp, dp, tg, nproc, overrides, big):
    """The generation shard equals the HF weights' slice bit for bit (in the worker); the bytes the transport counted
    equal the plan's segments, its closed form and the expected shard's own count, on every rank; no rank receives
    more than its generation shard, and a round holds at most one bucket."""
    hf = make_tiny_hf_model(tmp_path, "llama", **overrides)
    out = run_torchrun("hybrid_reshard.py", nproc, hf, tp, pp, dp, str(tg), *([big] if big else []),
                       timeout=400, env=EXACT_RSS).stdout
    rows = _parse(out)
    assert len(rows) == 2 * nproc
    assert all(r["recv"] == r["plan"] and r["mean"] == r["hybridflow"] for r in rows)
    hf_rows = [r for r in rows if r["tag"].startswith("hf")]
    if pp == 1 and tg % tp == 0:  # each rollout slice inside the training slice its rank holds: nothing moves
        assert all(r["recv"] == 0 for r in rows)
    else:
        assert any(r["recv"] > 0 for r in hf_rows)
    groups = _groups(out)
    if (tp, dp, tg) == (2, 2, 4):
        assert groups[("hf tp2pp1dp2->tg4", 0)] == (0, "[0, 2, 1, 3]")
        assert {r: groups[("hf tp2pp1dp2->tg4", r)][0] for r in range(4)} == {0: 0, 2: 1, 1: 2, 3: 3}


@pytest.mark.dist
def test_round_trip_to_rollout_tp4_from_a_tp2_dp2_actor_in_the_local_order(tmp_path):
    """The rollout TP group is [0, 2, 1, 3] in slice order (not the ranks' order): the embedded engine re-orders its
    logits gather, and greedy generation still equals transformers' (the worker's checks)."""
    hf = make_tiny_hf_model(tmp_path, "qwen2", num_key_value_heads=4, vocab_size=128)
    out = run_torchrun("hybrid_actor_roundtrip.py", 4, hf, "4", 2, 1, 1, timeout=600).stdout
    assert "OK rollout_tp=4 layout=2,1,1,None" in out
