"""Per-tensor dtypes in the resharding plan (issue 18 item 8): in a bf16 rollout the MoE router's expert bias (a row
the family holds in fp32, `Weight.fp32`) travels in fp32 buckets of its own and lands in the generation shard in fp32,
bit-equal to training's buffer, as megatron and SGLang keep it; every other tensor is bf16."""
import subprocess
import sys
import textwrap

import torch

from tests.helpers.common import REPO_ROOT
from tests.helpers.moe_models import COMMON, FAMILIES


def _deepseek_arch():
    from tripod.parallel.arch import arch_from_hf
    return arch_from_hf({**COMMON, **FAMILIES["deepseek_v3"], "model_type": "deepseek_v3"})


def test_plan_moves_fp32_rows_in_fp32_buckets():
    from tripod.parallel.hybrid_engine.plan import build_reshard_plan

    arch = _deepseek_arch()
    assert arch.moe.expert_bias
    plan = build_reshard_plan(arch, 2, 1, 2, 1, bucket_bytes=4 << 10, dtype=torch.bfloat16)
    bias = [s for s in plan.specs if s.name.endswith("router.expert_bias")]
    assert bias and all(plan.spec_dtype(s) == torch.float32 for s in bias)
    assert {plan.spec_dtype(s) for s in plan.specs if not s.fp32} == {torch.bfloat16}
    for buckets in plan.buckets.values():
        for b in buckets:
            fp32 = {seg.name.endswith("router.expert_bias") for seg in b.segments}
            assert fp32 == {b.dtype == torch.float32}, (b.dtype, [seg.name for seg in b.segments])
    assert any(b.dtype == torch.float32 for bs in plan.buckets.values() for b in bs)
    # bytes count each tensor at its own width: the biases at 4 bytes, the rest at 2
    want = sum(torch.Size(s.global_shape).numel() * (4 if s.fp32 else 2) for s in plan.specs)
    assert plan.model_bytes() == want


SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    from tripod.parallel.megatron_patches.cpu_compat import apply_cpu_compat
    apply_cpu_compat()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import family_of, hf_to_megatron
    from tripod.parallel.hybrid_engine.plan import build_reshard_plan
    from tripod.parallel.hybrid_engine.transport import MicroDPGather
    from safetensors.torch import load_file

    arch = arch_from_hf(sys.argv[1])
    disk = load_file(os.path.join(sys.argv[1], "model.safetensors"))
    family = family_of(arch)
    train = {n: family.shard(arch, n, t, 1, 0).to(torch.float32 if family.row(arch, n).fp32 else torch.bfloat16)
             for n, t in hf_to_megatron(arch, disk).items()}
    plan = build_reshard_plan(arch, 1, 1, 1, 1, bucket_bytes=4 << 10, dtype=torch.bfloat16)
    gen = MicroDPGather(plan).gather(train)
    names = [n for n in gen if n.endswith("router.expert_bias")]
    assert names
    for n in names:
        assert gen[n].dtype == torch.float32 and torch.equal(gen[n], train[n]), (n, gen[n].dtype)
    assert all(t.dtype == torch.bfloat16 for n, t in gen.items() if n not in names)
    print("FP32_ROWS_OK", len(names))
""")


def test_generation_shard_keeps_the_expert_bias_in_fp32(tmp_path):
    from tests.helpers.common import free_port
    from tests.helpers.moe_models import make_tiny_moe_model

    hf_dir = make_tiny_moe_model(tmp_path, "deepseek_v3", seed=5)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(hf_dir), str(free_port())], cwd=REPO_ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0 and "FP32_ROWS_OK" in proc.stdout, proc.stdout[-3000:]
