"""torchrun worker (2 ranks, DP2, distributed optimizer): an actor and a critic with LoRA inside tripod's workers.

argv: HF_DIR. Checks, printing one `LORA_<WHAT>` line each (rank 0):
- only the adapters (and the critic's value head) require grad; megatron's DDP grad buffers hold exactly them, so
  the base has no gradient buffer and no optimizer state (`LORA_BUFFERS actor <n adapter> <n base> ...`);
- after an optimizer step every base tensor is bit-identical and every adapter moved (`LORA_STEP`);
- the actor's log-probs with its adapters switched off equal those of a reference built without LoRA, bit for bit,
  while with the adapters on they differ (`LORA_REFERENCE off_vs_base <x> on_vs_base <y>`).
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker


def _buffer_params(worker) -> set:
    return {p for chunk in worker.model for buf in chunk.buffers for p in buf.params}


def main() -> None:
    from tripod.engine.config import OptimConfig
    from tripod.engine.workers.batch import build_ppo_batch
    from tripod.engine.workers.ppo_workers import CriticWorker, PolicyWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.lora import LoraSettings, adapters_disabled
    from tripod.parallel.precision import PrecisionSettings

    hf_dir = sys.argv[1]
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(name="DP2", arch=arch, tp=1, pp=1, dp=2, ranks=[0, 1])
    lora = LoraSettings(rank=4, alpha=8.0, target_modules=["all-linear"])
    precision = PrecisionSettings(use_distributed_optimizer=True)
    actor = PolicyWorker("actor", arch, layout, hf_dir, optim=OptimConfig(optimizer="adam", lr=1e-2),
                         precision=precision, lora=lora)
    critic = CriticWorker("critic", arch, layout, hf_dir, value_head=True, optim=OptimConfig(optimizer="adam"),
                          precision=precision, lora=lora)
    for name, worker in (("actor", actor), ("critic", critic)):
        adapters = {p for a in worker.lora for p in a.parameters()}
        trained = {p for chunk in worker.chunks for p in chunk.parameters() if p.requires_grad}
        head = {p for chunk in worker.chunks for n, p in chunk.named_parameters() if n.startswith("output_layer.")}
        assert trained == adapters | (head if name == "critic" else set()), name
        assert _buffer_params(worker) == trained, f"{name}: the grad buffers hold other parameters than the trained"
        base = [p for chunk in worker.chunks for p in chunk.parameters() if p not in trained]
        assert not any(hasattr(p, "main_grad") for p in base), f"{name}: a frozen parameter got a gradient buffer"
        if dist.get_rank() == 0:
            print(f"LORA_BUFFERS {name} trained {sum(p.numel() for p in trained)} frozen "
                  f"{sum(p.numel() for p in base)}", flush=True)

    before = {n: p.detach().clone() for chunk in actor.chunks for n, p in chunk.named_parameters()}
    for chunk in actor.model:
        chunk.zero_grad_buffer()
        for p in chunk.parameters():
            if p.requires_grad:
                p.main_grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ok, _, _ = actor.optimizer.step()
    assert ok
    after = {n: p.detach() for chunk in actor.chunks for n, p in chunk.named_parameters()}
    changed_base = [n for n in before if ".lora." not in n and not torch.equal(before[n], after[n])]
    still = [n for n in before if ".lora." in n and torch.equal(before[n], after[n])]
    assert not changed_base and not still, (changed_base[:4], still[:4])
    if dist.get_rank() == 0:
        print(f"LORA_STEP base_unchanged {len(before) - sum('.lora.' in n for n in before)} "
              f"adapters_moved {sum('.lora.' in n for n in before)}", flush=True)

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, arch.vocab_size, (5 + i,), generator=g).tolist() for i in range(4)]
    responses = [torch.randint(3, arch.vocab_size, (4 + i % 2,), generator=g).tolist() for i in range(4)]
    batch = build_ppo_batch(prompts, responses, 6, 0, list(range(4)))
    on, _ = actor.compute_log_probs(batch, 2, 1.0)
    with adapters_disabled(actor.chunks):
        off, _ = actor.compute_log_probs(batch, 2, 1.0)
    reference = PolicyWorker("reference", arch, layout, hf_dir, trainable=False, precision=precision)
    base, _ = reference.compute_log_probs(batch, 2, 1.0)
    mask = batch["response_mask"] > 0
    off_diff = (off - base)[mask].abs().max().item()
    on_diff = (on - base)[mask].abs().max().item()
    if dist.get_rank() == 0:
        print(f"LORA_REFERENCE off_vs_base {off_diff:.3e} on_vs_base {on_diff:.3e}", flush=True)
    assert torch.equal(off, base) and on_diff > 1e-4, (off_diff, on_diff)


if __name__ == "__main__":
    dist_worker(main)
