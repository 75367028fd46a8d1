"""`tripod plan` as a plan: one row per rank role (the per-rank table regrouped, nothing lost), the model given as a
directory / config.json / bundled hub name (or refused in one line naming what is bundled), and the per-phase memory
with the verdict against the device memory, checked against the byte rows by hand."""
import json

import pytest

from tripod.parallel.arch import arch_from_hf
from tripod.parallel.hybrid_engine.plan import build_reshard_plan

TINY = dict(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _role_rows(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ranks  pp_stage")) + 1
    return [line.split() for line in lines[start:]]


@pytest.mark.parametrize("tp,pp,dp,tg", [(2, 2, 2, 1), (2, 4, 1, 2), (2, 1, 4, 2)])
def test_role_rows_regroup_the_per_rank_table(tp, pp, dp, tg):
    plan = build_reshard_plan(arch_from_hf(TINY), tp, pp, dp, tg, bucket_bytes=4096)
    per_rank = plan.describe(per_rank=True).splitlines()
    table = per_rank[per_rank.index(next(x for x in per_rank if x.startswith("rank "))) + 1:]
    by_rank = {int(r.split()[0]): r.split() for r in table}
    assert sorted(by_rank) == list(range(tp * pp * dp))
    rows = _role_rows(plan.describe(per_rank=False))
    assert sum(int(r[0]) for r in rows) == tp * pp * dp  # every rank in exactly one role
    assert len(rows) < tp * pp * dp
    for count, stage, _tp, _rtp, buckets, recv, example in rows:
        members = [r for r in by_rank if plan.train_coords(r)[2] == int(stage) and by_rank[r][2] == buckets
                   and by_rank[r][3] == recv]
        assert len(members) == int(count) and int(example) == min(members)


def _write_config(tmp_path, **kw):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, **kw}))
    return path


def test_model_argument_dir_file_or_bundled_name(tmp_path, capsys):
    from tripod.engine.cli import main

    cfg = _write_config(tmp_path)
    layout = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
              "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "data.train_batch_size=4",
              "trainer.device=cuda"]  # cuda: no measured process RSS in the output
    outs = []
    for model in (str(tmp_path), str(cfg)):
        assert main(["plan", model, *layout]) == 0
        outs.append(capsys.readouterr().out.split("\n", 1)[1])  # past the 'architecture:' line
    assert outs[0] == outs[1] and "TP2xPP1xDP2" in outs[0]
    assert main(["plan", "Qwen/Qwen3-8B", "trainer.n_gpus_per_node=8", "trainer.device=cuda",
                 "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]) == 0
    assert "Qwen--Qwen3-8B.json" in capsys.readouterr().out
    assert main(["plan", "Qwen/NoSuchModel-1B"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Qwen/NoSuchModel-1B" in err and "deepseek-ai/DeepSeek-V3" in err


def _phases(out: str) -> dict[str, tuple[float, float]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("phase ")) + 1
    rows = {}
    for line in lines[start:]:
        if line.startswith("verdict") or not line.strip():
            break
        name, device, host = line.split()[:3]
        rows[name] = (float(device), float(host))
    return rows


def test_phase_bytes_follow_the_offload_keys_and_the_verdict(tmp_path, capsys):
    """GAE run with reference, TP1 DP2 on 2 'GPUs' (trainer.device=cuda: the plan only), offload on for the actor's
    params+grads+optim and the critic's optimizer: each phase's device bytes are its models' rows by hand."""
    import torch

    from tripod.engine.cli import main
    from tripod.parallel.memory_plan import ModelMemory

    cfg = _write_config(tmp_path)
    base = ["plan", str(cfg), "trainer.n_gpus_per_node=2", "trainer.device=cuda", "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=true", "data.train_batch_size=4",
            "actor_rollout_ref.actor.megatron.param_dtype=bf16"]
    off = ["actor_rollout_ref.actor.megatron.param_offload=true", "actor_rollout_ref.actor.megatron.grad_offload=true",
           "actor_rollout_ref.actor.megatron.optimizer_offload=true", "critic.megatron.optimizer_offload=true",
           "actor_rollout_ref.ref.megatron.param_offload=true"]
    assert main(base + off + ["--gpu-memory-gb", "1"]) == 0
    out = capsys.readouterr().out
    mib = float(1 << 20)
    arch = arch_from_hf(TINY)
    actor = ModelMemory("actor", 1, 1, 2, torch.bfloat16, True, True).compute(arch).rows
    # the critic and the reference follow the actor's param_dtype (their megatron sections interpolate it)
    critic = ModelMemory("critic", 1, 1, 2, torch.bfloat16, True, True, value_head=True).compute(arch).rows
    ref = ModelMemory("reference", 1, 1, 2, torch.bfloat16, False).compute(arch).rows
    a_p, a_g, a_o = actor["params"], actor["grads"], actor["main_params"] + actor["optim"]
    c_p, c_g, c_o = critic["params"], critic["grads"], critic["main_params"] + critic["optim"]
    r_p = ref["params"]
    ph = _phases(out)
    # (device without the phase's own working set, host); the working sets are checked below. The actor's offloaded
    # gradient buffers are freed, not copied: on neither side
    assert ph["old_log_prob"] == (round((a_p + c_p + c_g) / mib, 1), round((a_o + c_o + r_p) / mib, 1))
    assert ph["ref"] == (round((r_p + c_p + c_g) / mib, 1), round((a_p + a_o + c_o) / mib, 1))
    assert ph["values"] == (round((c_p + c_g) / mib, 1), round((a_p + a_o + c_o + r_p) / mib, 1))
    assert ph["update_critic"][1] == round((a_p + a_o + r_p) / mib, 1)
    assert ph["update_actor"][1] == round((c_o + r_p) / mib, 1)
    assert ph["checkpoint"] == (round((a_p + a_o + c_p + c_g + c_o) / mib, 1), round(r_p / mib, 1))
    assert ph["rollout"][1] == ph["old_log_prob"][1]
    assert "verdict vs 1 GiB per device: fits" in out
    assert main(base + ["--gpu-memory-gb", "0.001"]) == 0  # no offload: every phase holds every model
    out = capsys.readouterr().out
    ph = _phases(out)
    assert {host for _, host in ph.values()} == {0.0}
    assert ph["old_log_prob"][0] == round((a_p + a_g + a_o + c_p + c_g + c_o + r_p) / mib, 1)
    assert "does NOT fit" in out and "rollout" in out.split("over the device memory: ")[1]
