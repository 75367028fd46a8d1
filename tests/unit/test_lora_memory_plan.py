"""`tripod plan` with LoRA (parallel/lora/memory.py, parallel/memory_plan.py): the adapter parameters the plan counts
equal those `apply_lora` creates on a tiny dense and a tiny MoE model (exactly), and the gradients, fp32 main weights
and optimizer states are the adapters' only (planted: train_with_hooks.py's lora_plan_base_trained counts the frozen
base, and the check fails)."""
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.common import REPO_ROOT

RANK = 4
TARGETS = {"qwen2": ["all-linear"], "qwen3_moe": ["linear_qkv", "linear_fc1", "down_proj"]}

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    from tripod.parallel.megatron_patches.cpu_compat import apply_cpu_compat
    apply_cpu_compat()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.lora import LoraSettings, apply_lora
    from tripod.parallel.model import build_gpt_model

    for path, rank, targets in zip(sys.argv[2::3], sys.argv[3::3], sys.argv[4::3]):
        arch = arch_from_hf(path)
        model = build_gpt_model(arch, ParallelLayout(tp=1, pp=1, name="actor", arch=arch), use_te=False)
        adapters = apply_lora([model], arch, LoraSettings(rank=int(rank), target_modules=targets.split(",")))
        made = sum(p.numel() for a in adapters for p in a.parameters())
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        merged = sum(a.base_weight[0].numel() for a in adapters)
        largest = max(a.base_weight[0].numel() for a in adapters)
        print("LORA_COUNT", arch.family, made, trained, merged, sum(p.numel() for p in model.parameters()), largest)
""")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{family: (its arch, adapters made, trainable numel, adapted base numel, all numel, its directory, the largest
    adapted weight's numel)}."""
    from tests.helpers.common import free_port, make_tiny_hf_model
    from tests.helpers.moe_models import make_tiny_moe_model

    tmp = tmp_path_factory.mktemp("lora_plan")
    paths = {"qwen2": make_tiny_hf_model(tmp, "qwen2"), "qwen3_moe": make_tiny_moe_model(tmp, "qwen3_moe")}
    argv = [x for f, p in paths.items() for x in (p, str(RANK), ",".join(TARGETS[f]))]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port()), *argv], cwd=REPO_ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("LORA_COUNT")]
    out = {}
    for family, path in paths.items():
        from tripod.parallel.arch import arch_from_hf

        arch = arch_from_hf(path)
        (made, trained, merged, total, largest), = [tuple(map(int, r[1:])) for r in rows if r[0] == arch.family]
        out[family] = (arch, made, trained, merged, total, path, largest)
    return out


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_plan_counts_the_adapters_apply_lora_makes_and_trains_only_them(built, family):
    _check_counts(built, family)


def test_the_count_check_fails_on_the_frozen_base_counted_as_trained(built):
    from tests.multiprocess.workers.train_with_hooks import plant, unplant

    plant("lora_plan_base_trained")
    try:
        for family in sorted(TARGETS):
            with pytest.raises(AssertionError, match="'grads'"):
                _check_counts(built, family)
    finally:
        unplant()


def _check_counts(built, family: str) -> None:
    import torch

    from tripod.parallel.memory_plan import ModelMemory

    arch, made, trained, merged, total, _, largest = built[family]
    assert made == trained > 0  # apply_lora froze every base parameter
    m = ModelMemory("actor", 1, 1, 1, torch.float32, True, lora=(RANK, tuple(TARGETS[family]), ())).compute(arch)
    assert m.adapter_numel == made, (m.adapter_numel, made)
    assert m.merged_numel == merged and m.merged_largest == largest, (m.merged_numel, merged, m.merged_largest)
    assert m.numel + m.adapter_numel == total, (m.numel, m.adapter_numel, total)
    # fp32 parameters, no distributed optimizer: grads 4 bytes and Adam 8 bytes per trained element, no main copy
    assert m.rows == {"params": total * 4, "grads": made * 4, "main_params": 0, "optim": made * 8}, m.rows
    from tripod.parallel.lora.memory import lora_stage_numel

    stage = lora_stage_numel(arch, RANK, TARGETS[family], tp=1, pp=1)[0]
    sharded = stage.adapters // 2 + stage.expert_adapters // 2  # distributed optimizer over DP 2 (expert-DP 2)
    bf16 = ModelMemory("actor", 1, 1, 2, torch.bfloat16, True, distributed_optimizer=True,
                       lora=(RANK, tuple(TARGETS[family]), ())).compute(arch)
    assert bf16.rows == {"params": total * 2, "grads": made * 4, "main_params": sharded * 4, "optim": sharded * 8}, \
        bf16.rows


def test_plan_from_config_with_lora_drops_the_reference_and_adds_the_lazy_merge(built):
    """Actor LoRA with a KL loss: no reference row, the ref phase on the actor, the rollout's lazy merge (one adapted
    weight's delta + one bucket's chunk, not a copy of every adapted weight) and an unaliased generation shard; critic
    LoRA: its adapters plus its value head trained."""
    import torch

    from tripod.engine.config import load_config
    from tripod.parallel.lora.memory import value_head_numel
    from tripod.parallel.lora.merge import merge_peak_bytes
    from tripod.parallel.memory_phases import phase_memory
    from tripod.parallel.memory_plan import plan_from_config

    arch, made, _, merged, _, path, largest = built["qwen2"]
    base = [f"actor_rollout_ref.model.path={path}", "trainer.n_gpus_per_node=1", "data.train_batch_size=4",
            "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.adv_estimator=gae"]
    full = plan_from_config(load_config(None, base), 1, arch)
    lora = [f"{k}.model.lora.rank={RANK}" for k in ("actor_rollout_ref", "critic")] + \
        [f"{k}.model.lora.target_modules=[all-linear]" for k in ("actor_rollout_ref", "critic")]
    plan = plan_from_config(load_config(None, base + lora), 1, arch)
    assert [m.name for m in full.models] == ["actor", "critic", "reference"] and full.generation_shard_aliased
    assert [m.name for m in plan.models] == ["actor", "critic"] and plan.reference_on_actor
    # the tiny model's adapted weights all fit in one 64 MiB chunk: the delta (x2 while it is computed) or the delta
    # and its chunk's fp32 sum (fp32 weights: the sum is the merged chunk)
    assert plan.lora_merged == 2 * largest * 4 < merged * 4, (plan.lora_merged, largest, merged)
    assert merge_peak_bytes(largest, torch.bfloat16, 4 * largest) == largest * 2 + largest * (4 + 2)  # delta + sum + bf16
    assert not plan.generation_shard_aliased and plan.generation_shard > 0
    assert "ref" in [p.phase for p in phase_memory(plan, {})]
    actor, critic = plan.models
    assert actor.rows["grads"] == made * 4
    assert critic.rows["grads"] == (critic.adapter_numel + value_head_numel(arch)) * 4, critic.rows
