"""torchrun worker (2 ranks, gloo, DP=2): the same actor and critic built in fp32 and in bf16 from one HF checkpoint,
driven through the same fixed batch: log-probs / values, then two PPO mini-batch updates each.

Prints one `PREC <json>` line per rank with, for fp32 / bf16 / fp32+distributed-optimizer / fp32 without it: the
log-probs and values before and after the updates, the losses and grad norms, and the optimizer class names
(so the test can check that bf16 really kept fp32 main weights and that DP=2 chose the distributed optimizer).
"""
import json
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker


def build(kind, hf_dir, arch, layout, dtype, dist_opt, critic=False):
    from tripod.engine.config import OptimConfig
    from tripod.engine.precision import PrecisionSettings
    from tripod.engine.workers.ppo_workers import CriticWorker, PolicyWorker

    cls = CriticWorker if critic else PolicyWorker
    return cls(kind, arch, layout, hf_dir, value_head=critic, optim=OptimConfig(lr=1e-4, weight_decay=0.0), grad_clip=1e9,
               precision=PrecisionSettings(param_dtype=dtype, use_distributed_optimizer=dist_opt))


def run(hf_dir, arch, layout, batch, dtype, dist_opt):
    from tripod.engine.config import ActorConfig, CriticConfig

    actor = build("actor", hf_dir, arch, layout, dtype, dist_opt)
    critic = build("critic", hf_dir, arch, layout, dtype, dist_opt, critic=True)
    logp0, _ = actor.compute_log_probs(batch, 2, 1.0)
    values0 = critic.compute_values(batch, 2)
    batch = batch.select(slice(0, batch.size))
    batch["old_log_probs"], batch["values"] = logp0, values0
    acfg = ActorConfig(ppo_mini_batch_size=batch.size // 2, ppo_micro_batch_size_per_gpu=2, clip_ratio_low=0.2,
                      clip_ratio_high=0.2)
    ccfg = CriticConfig(ppo_mini_batch_size=batch.size // 2, ppo_micro_batch_size_per_gpu=2, ppo_epochs=1,
                        use_dynamic_bsz=False)
    from tripod.parallel.hybrid_engine.memory import SavedTensorBytes

    exclude = {p.untyped_storage().data_ptr() for p in actor.module.parameters()} | {
        t.untyped_storage().data_ptr() for chunk in actor.model for b in chunk.buffers
        for t in (b.param_data, b.grad_data) if t is not None}
    with SavedTensorBytes(exclude) as saved:  # the activations of one micro-batch of 2 rows, at the peak
        a = actor.update(batch, acfg, 1.0, 1)
    c = critic.update(batch, ccfg, 1)
    logp1, _ = actor.compute_log_probs(batch, 2, 1.0)
    values1 = critic.compute_values(batch, 2)
    opt = type(actor.optimizer.chained_optimizers[0]).__name__ if hasattr(actor.optimizer, "chained_optimizers") \
        else type(actor.optimizer).__name__
    inner = actor.optimizer.chained_optimizers[0] if hasattr(actor.optimizer, "chained_optimizers") else actor.optimizer
    main_dtype = str(inner.optimizer.param_groups[0]["params"][0].dtype)  # what Adam updates: the main weights
    return dict(main_dtype=main_dtype, logp0=logp0.tolist(), logp1=logp1.tolist(), values0=values0.tolist(), values1=values1.tolist(),
                pg_loss=a["actor/pg_loss"], actor_grad_norm=a["actor/grad_norm"], vf_loss=c["critic/vf_loss"],
                critic_grad_norm=c["critic/grad_norm"], optimizer=opt, saved_bytes=saved.peak,
                seq=batch["input_ids"].shape[1],
                param_dtype=str(next(actor.module.parameters()).dtype))


def main():
    from tripod.engine.workers.batch import build_ppo_batch
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout

    hf_dir = sys.argv[1]
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(tp=1, pp=1, name="model", arch=arch)
    g = torch.Generator().manual_seed(11)  # fresh random prompts / responses / advantages, same on every rank
    n, resp_len = 8, 6
    prompts = [torch.randint(3, arch.vocab_size, (int(k),), generator=g).tolist()
               for k in torch.randint(4, 9, (n,), generator=g)]
    responses = [torch.randint(3, arch.vocab_size, (int(k),), generator=g).tolist()
                 for k in torch.randint(2, resp_len + 1, (n,), generator=g)]
    batch = build_ppo_batch(prompts, responses, resp_len, 0, list(range(n)))
    batch["advantages"] = torch.randn(n, resp_len, generator=g) * batch["response_mask"]
    batch["returns"] = torch.randn(n, resp_len, generator=g) * batch["response_mask"]
    out = {}
    for name, dtype, dist_opt in (("fp32", torch.float32, False), ("fp32_distopt", torch.float32, True),
                                  ("bf16", torch.bfloat16, True)):
        torch.manual_seed(0)
        out[name] = run(hf_dir, arch, layout, batch, dtype, dist_opt)
    print(f"PREC rank={dist.get_rank()} " + json.dumps(out), flush=True)


if __name__ == "__main__":
    dist_worker(main)
