"""The local spec's SDPA core attention (issue 18 item 4): the same numbers as megatron's DotProductAttention, and
no [b, heads, s, s] activations, with the memory plan counting what it keeps.

* `SDPADotProductAttention` against megatron-core 0.16.1's DotProductAttention (the module the local spec had), fp32,
  grouped-query heads, a causal + left-padding mask: forward and the gradients of q, k, v on every query row that
  sees at least one key (a fully masked padding row is finite in both, and never read), and the same for a
  context-parallel rank's part (its 6 query rows of 12, every key). Bound 1e-5: fp32 (eps 1.2e-7)
  softmax and two matmuls over <= 16-element reductions differ by reduction order only, a few ulps at these scales.
* The bytes autograd saves for one SDPA core attention on CPU (torch's fused CPU kernel, like CUDA's memory-efficient
  one) equal memory_plan.fused_attention_saved_bytes exactly, in fp32 and bf16, with a mask and without (causal
  rows), K / V at their group count (SDPA's grouped-query attention).
* `tripod plan` of the Qwen3-30B-A3B recipe (trainer.device=cuda) counts the fused attention: less than half the
  activations of the materialising one at its 1.5k-token sequences. On CPU (tripod's defaults) the plan counts the
  fused attention too for a non-MLA model (Qwen2.5-0.5B), and megatron's materialising one for an MLA model
  (DeepSeek-V3), which keeps megatron's core attention: what build_gpt_model runs on either device
  (tests/unit/test_sdpa_model.py).
"""
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers.common import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    from tripod.parallel.megatron_patches.cpu_compat import apply_cpu_compat
    apply_cpu_compat()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tripod.parallel.sdpa_attention import sdpa_dot_product_attention

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=16, use_cpu_initialization=True, attention_dropout=0.0,
                               masked_softmax_fusion=False)
    ref = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    sdpa = sdpa_dot_product_attention()(config, 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(11)
    s, b = 12, 3
    q0, k0, v0 = (torch.randn(s, b, h, 16, generator=g) for h in (4, 2, 2))
    lengths = torch.tensor([12, 9, 5])  # left padding
    real = torch.arange(s)[None, :] >= (s - lengths)[:, None]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None] | ~real[:, None, None, :]
    seen = ~mask.all(-1).squeeze(1).T  # [s, b] query rows with at least one key
    outs = []
    for module in (ref, sdpa):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = module(q, k, v, mask)
        assert torch.isfinite(out).all()
        (out[seen] * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        outs.append((out.detach()[seen], q.grad, k.grad, v.grad))
    for name, a, c in zip(("out", "dq", "dk", "dv"), *outs):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5, msg=name)
    # what a context-parallel rank computes (parallel/context_parallel.py): its query rows, every key
    from tripod.parallel.context_parallel import local_slots
    slots = local_slots(s, 2, 1)
    outs = []
    for module in (ref, sdpa):
        q, k, v = (t.clone().requires_grad_() for t in (q0[slots], k0, v0))
        out = module(q, k, v, mask[:, :, slots])
        (out[seen[slots]] * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        outs.append((out.detach()[seen[slots]], q.grad, k.grad, v.grad))
    for name, a, c in zip(("cp out", "cp dq", "cp dk", "cp dv"), *outs):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5, msg=name)
    print("SDPA_MATCHES_MEGATRON")
""")


def test_sdpa_core_attention_matches_megatrons():
    from tests.helpers.common import free_port

    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port())], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0 and "SDPA_MATCHES_MEGATRON" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_saved_bytes_are_the_planned_ones(dtype, masked):
    from tripod.parallel.memory_plan import fused_attention_saved_bytes
    from tripod.parallel.sdpa_attention import sdpa_core_attention

    s, b, a, groups, d = 64, 2, 4, 2, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, b, h, d, generator=g).to(dtype).requires_grad_() for h in (a, groups, groups))
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None].expand(b, 1, s, s).clone() if masked else None
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sdpa_core_attention(q, k, v, mask, d ** -0.5)
    e = torch.empty((), dtype=dtype).element_size()
    assert sum(storages.values()) == fused_attention_saved_bytes(b, s, a, d, e, kv_heads=groups, mask=masked)
    assert all(t != b * a * s * s * 4 for t in storages.values())  # no fp32 [b, a, s, s] probabilities among them


def test_plan_counts_the_attention_that_runs():
    import json

    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import activation_bytes

    with open(f"{REPO_ROOT}/recipes/model_configs/Qwen--Qwen3-30B-A3B.json") as f:
        arch = arch_from_hf(json.load(f))
    eager = activation_bytes(arch, 4, 2, 4, 1536, torch.bfloat16, fused_attention=False)
    fused = activation_bytes(arch, 4, 2, 4, 1536, torch.bfloat16, fused_attention=True)
    # the [b, heads, s, s] probabilities are ~45% of the materialising attention's plan (the routed experts' rows,
    # top-8 of 128, take most of the rest)
    assert fused < 0.6 * eager
    assert activation_bytes(arch, 4, 2, 4, 1536, torch.bfloat16) == fused  # the default: what runs
    import contextlib
    import io

    from tripod.engine.cli import main
    from tripod.engine.config import load_config
    from tripod.parallel.activation_plan import activations_from_config

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", "recipes/qwen3/30b-a3b-gsm8k.yaml"]) == 0
    actor = float(buf.getvalue().split("longest sequences): actor ")[1].split(" MiB")[0])
    cfg = load_config(f"{REPO_ROOT}/recipes/qwen3/30b-a3b-gsm8k.yaml", [])
    world, n = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes, cfg.actor_rollout_ref.rollout.n
    seq = cfg.data.max_prompt_length + cfg.actor_rollout_ref.rollout.response_length
    fused, eager = (activations_from_config(cfg.actor_rollout_ref.actor, arch, world, n, seq, torch.bfloat16,
                                            fused_attention=f) for f in (True, False))
    assert fused < eager
    assert actor == pytest.approx(fused / 2 ** 20, abs=0.1)  # the recipe runs on CUDA: the fused attention


@pytest.mark.parametrize("model, mla", [("Qwen--Qwen2.5-0.5B-Instruct.json", False),
                                        ("deepseek-ai--DeepSeek-V3.json", True)])
def test_cpu_plan_counts_the_attention_that_runs(model, mla):
    import json

    from tripod.engine.config import load_config
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import activation_bytes, plan_from_config

    path = f"{REPO_ROOT}/recipes/model_configs/{model}"
    cfg = load_config(None, [f"actor_rollout_ref.model.path={path}"])
    assert cfg.trainer.device == "cpu" and not cfg.actor_rollout_ref.actor.use_dynamic_bsz  # tripod's defaults
    with open(path) as f:
        arch = arch_from_hf(json.load(f))
    assert (arch.mla is not None) == mla
    rows = cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    seq = cfg.data.max_prompt_length + cfg.actor_rollout_ref.rollout.response_length
    m = cfg.actor_rollout_ref.actor.megatron
    plan = plan_from_config(cfg, m.tensor_model_parallel_size * m.pipeline_model_parallel_size, arch)
    a = plan.models[0]
    fused, eager = (activation_bytes(arch, a.tp, a.pp, rows, seq, a.param_dtype, recompute=a.recompute,
                                     fused_attention=f) for f in (True, False))
    assert fused < eager
    assert plan.activations["actor"] == (eager if mla else fused)
