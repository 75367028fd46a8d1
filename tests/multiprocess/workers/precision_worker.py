"""torchrun worker (2 ranks, gloo, DP=2): the same actor and critic built in fp32 and in bf16 from one HF checkpoint,
driven through the same fixed batch: log-probs / values, then two PPO mini-batch updates each.

Prints one `PREC <json>` line per rank with, for fp32 / bf16 / fp32+distributed-optimizer / fp32 without it: the
log-probs and values before and after the updates, the losses and grad norms, the optimizer class names
(so the test can check that bf16 really kept fp32 main weights and that DP=2 chose the distributed optimizer), and
the actor's bytes megatron allocated after its update (parameters, grad buffers, main weights, Adam moments).
"""
import json
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker
from tests.helpers.ppo_setup import random_ppo_batch


def build(kind, hf_dir, arch, layout, dtype, dist_opt, critic=False):
    from tripod.engine.config import OptimConfig
    from tripod.engine.workers.ppo_workers import CriticWorker, PolicyWorker
    from tripod.parallel.precision import PrecisionSettings

    cls = CriticWorker if critic else PolicyWorker
    return cls(kind, arch, layout, hf_dir, value_head=critic, optim=OptimConfig(lr=1e-4, weight_decay=0.0), grad_clip=1e9,
               precision=PrecisionSettings(param_dtype=dtype, use_distributed_optimizer=dist_opt))


def allocated_bytes(worker) -> dict[str, int]:
    """Bytes megatron really holds for a trained model on this rank, by the memory plan's rows: the module's
    parameters, the DDP grad buffers, the optimizer's main weights (its fp32 params that are not views of the model's
    own), and the Adam moments (`step` counters, a few bytes per tensor, are left out as the plan leaves them out)."""
    model_storages = {p.untyped_storage().data_ptr() for p in worker.module.parameters()}
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for chunk in worker.model for b in chunk.buffers)
    main, optim = 0, 0
    for inner in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in model_storages:
                    main += p.numel() * p.element_size()
        for state in inner.optimizer.state.values():
            optim += sum(state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq"))
    return dict(params=sum(p.numel() * p.element_size() for p in worker.module.parameters()), grads=grads,
                main_params=main, optim=optim, tensors=sum(1 for _ in worker.module.parameters()),
                buckets=sum(len(b.buckets) for chunk in worker.model for b in chunk.buffers))


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
    from tripod.runtime.memory import SavedTensorBytes

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
                seq=batch["input_ids"].shape[1], allocated=allocated_bytes(actor),
                param_dtype=str(next(actor.module.parameters()).dtype))


def logit_scales(hf_dir, prompts, responses, resp_len) -> dict:
    """The fp32 HF model's logits of every response-predicting position: per token the rms over the vocab ([n,
    resp_len], 0 past a response's end), and the max |logit| of the batch. A log-prob is a logit minus an fp32
    logsumexp, so the bf16 run's log-prob errors scale with these logits, not with the log-probs (~ -log V)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    rms = torch.zeros(len(prompts), resp_len)
    biggest = 0.0
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses)):
            z = model(torch.tensor([p + r])).logits[0, len(p) - 1:len(p) + len(r) - 1]
            rms[i, :len(r)] = z.pow(2).mean(-1).sqrt()
            biggest = max(biggest, float(z.abs().max()))
    return dict(logit_rms=rms.tolist(), logit_max=biggest)


def main():
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout

    hf_dir = sys.argv[1]
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(tp=1, pp=1, name="model", arch=arch)
    n, resp_len = 8, 6
    batch, prompts, responses, g = random_ppo_batch(arch.vocab_size, n, resp_len)
    batch["returns"] = torch.randn(n, resp_len, generator=g) * batch["response_mask"]
    out = logit_scales(hf_dir, prompts, responses, resp_len)
    for name, dtype, dist_opt in (("fp32", torch.float32, False), ("fp32_distopt", torch.float32, True),
                                  ("bf16", torch.bfloat16, True)):
        torch.manual_seed(0)
        out[name] = run(hf_dir, arch, layout, batch, dtype, dist_opt)
    print(f"PREC rank={dist.get_rank()} " + json.dumps(out), flush=True)


if __name__ == "__main__":
    dist_worker(main)
