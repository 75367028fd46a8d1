"""torchrun worker (1 rank): LoRA dropout (`model.lora.dropout`) only where gradients flow.

argv: HF_DIR. An actor and a critic with adapters at dropout DROPOUT (peft's random non-zero adapters loaded into
them), and the same two at dropout 0 with the same adapters:
- the passes without gradients (the actor's old-log-prob / reference pass `compute_log_probs`, the critic's
  `compute_values`) equal the dropout-0 workers' bit for bit, and the actor's equal peft's on the HF model in eval
  mode (its lora_dropout the same) within fp32 rounding: `LORA_DROPOUT eval actor_vs_plain <x> critic_vs_plain <y>
  actor_vs_peft <z>`;
- the update's first forward (train mode, gradients) against those log-probs (`rollout_corr/abs_diff_max` of
  `update(..., rollout_gap=True)`): non-zero with dropout, zero without: `LORA_DROPOUT train gap <g> plain_gap <p>`.
A worker whose no-gradient passes ran in train mode fails the first check (the plant, tests/multiprocess/
test_lora_dropout.py).
"""
import sys

import torch

from tests.helpers.common import dist_worker

DROPOUT = 0.3
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(hf_dir: str):
    """The HF model with peft adapters (random non-zero A and B, lora_dropout DROPOUT), in eval mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=DROPOUT, target_modules=HF_TARGETS))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def peft_log_probs(model, prompts, responses, width: int) -> torch.Tensor:
    out = torch.zeros(len(prompts), width)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses)):
            logits = model(torch.tensor([p + r])).logits[0].double()
            logp = torch.log_softmax(logits[len(p) - 1: len(p) - 1 + len(r)], -1)
            out[i, : len(r)] = logp.gather(-1, torch.tensor(r)[:, None])[:, 0].float()
    return out


def main() -> None:
    from peft.utils import get_peft_model_state_dict

    from tripod.engine.config import ActorConfig, OptimConfig
    from tripod.engine.workers.batch import build_ppo_batch
    from tripod.engine.workers.ppo_workers import CriticWorker, PolicyWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.families import get_family
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.lora import LoraSettings
    from tripod.parallel.lora.state import load_peft_state

    hf_dir = sys.argv[1]
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(name="one", arch=arch, tp=1, pp=1, dp=1, ranks=[0])
    reference = peft_model(hf_dir)
    adapters = get_peft_model_state_dict(reference)
    prefix = get_family(arch.family).hf_layer_prefix
    workers = {}
    for dropout in (DROPOUT, 0.0):
        lora = LoraSettings(rank=4, alpha=8.0, dropout=dropout, target_modules=["all-linear"])
        actor = PolicyWorker("actor", arch, layout, hf_dir, optim=OptimConfig(optimizer="sgd", lr=0.0), lora=lora)
        critic = CriticWorker("critic", arch, layout, hf_dir, value_head=True, optim=OptimConfig(optimizer="sgd"),
                              lora=lora)
        for worker in (actor, critic):
            load_peft_state(worker.lora, adapters, prefix, "peft")
            assert all(a.dropout is not None for a in worker.lora) == (dropout > 0)
        workers[dropout] = actor, critic

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, arch.vocab_size, (5 + i,), generator=g).tolist() for i in range(4)]
    responses = [torch.randint(3, arch.vocab_size, (4 + i % 2,), generator=g).tolist() for i in range(4)]
    batch = build_ppo_batch(prompts, responses, 6, 0, list(range(4)))
    mask = batch["response_mask"] > 0
    (actor, critic), (plain_actor, plain_critic) = workers[DROPOUT], workers[0.0]
    logp, _ = actor.compute_log_probs(batch, 2, 1.0)
    plain_logp, _ = plain_actor.compute_log_probs(batch, 2, 1.0)
    values, plain_values = critic.compute_values(batch, 2), plain_critic.compute_values(batch, 2)
    peft_logp = peft_log_probs(reference, prompts, responses, logp.shape[1])
    actor_diff = (logp - plain_logp)[mask].abs().max().item()
    critic_diff = (values - plain_values)[mask].abs().max().item()
    peft_diff = (logp - peft_logp)[mask].abs().max().item()
    print(f"LORA_DROPOUT eval actor_vs_plain {actor_diff:.3e} critic_vs_plain {critic_diff:.3e} "
          f"actor_vs_peft {peft_diff:.3e}", flush=True)
    assert actor_diff == 0.0 and critic_diff == 0.0, \
        f"a pass without gradients ran the adapters' dropout: actor {actor_diff:.3e}, critic {critic_diff:.3e}"
    assert peft_diff < 1e-5, f"the eval log-probs differ from peft's (eval mode, same dropout) by {peft_diff:.3e}"

    cfg = ActorConfig(ppo_mini_batch_size=batch.size, ppo_micro_batch_size_per_gpu=2, ppo_epochs=1,
                      clip_ratio_low=0.2, clip_ratio_high=0.2, use_dynamic_bsz=False)
    gaps = []
    for worker, old in ((actor, logp), (plain_actor, plain_logp)):
        upd = batch.select(slice(0, batch.size))
        upd["old_log_probs"] = upd["rollout_log_probs"] = old
        upd["advantages"] = torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * upd["response_mask"]
        gaps.append(worker.update(upd, cfg, 1.0, 1, rollout_gap=True)["rollout_corr/abs_diff_max"])
    print(f"LORA_DROPOUT train gap {gaps[0]:.3e} plain_gap {gaps[1]:.3e}", flush=True)
    assert gaps[0] > 1e-3, f"the update's forward (train mode) ran no dropout: gap {gaps[0]:.3e}"
    assert gaps[1] <= 1e-6, f"without dropout the update's forward differs from the eval pass by {gaps[1]:.3e}"


if __name__ == "__main__":
    dist_worker(main)
