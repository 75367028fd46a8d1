"""torchrun worker (2 ranks): an MoE actor at EP2 over two DP ranks with shared-prompt packing on (the default).

argv: hf_dir (a tiny Qwen3-MoE). megatron's allgather token dispatcher gathers every EP rank's tokens, so every
micro-batch must have one [rows, seq] over the EP group; each DP rank packs its own rows, so the ranks' packed shapes
differ (rank 0 packs its rows [A, A, B, E] into 3 model rows, rank 1 its rows [C, C, C, D] into 2 of another
length; with 2-row micro-batches [A, A] packs into 1 row and [C, D] stays 2 plain rows; under the token budget rank 0
runs 1-row micro-batches and rank 1 2-row ones).
MegatronWorker.run agrees on the shape over the group (engine/workers/moe_shapes.py) and pads rows and slots that no
loss reads. Checks, fp32, against the same actor with packing off (each rank's plain rows, which already agree):
log-probs with 4-row and 2-row micro-batches and under a token budget whose micro-batch counts differ by rank
(agreed to the larger count), and one update's pg_loss and grad norm. Then rank-dependent micro-batch counts must
stop both ranks with one clear error. Prints `EPPACK <case> <max diff>` lines and `EPPACK-OK`.
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.bounds import worst
from tests.helpers.common import dist_worker

TOL = 2e-5  # fp32, log-probs of order 1-10: rounding of other reduction orders / shapes (as packing_check.py)
TEMP = 1.0


def make_batch(arch):
    """8 rows [A, A, B, E | C, C, C, D] (rank 0's half, rank 1's half): both halves pack, to different shapes."""
    from tripod.engine.workers.batch import build_ppo_batch

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 7, 12, 4)]
    index = [0, 0, 1, 4, 2, 2, 2, 3]
    resp_len = 8
    lens = [3, 8, 2, 5, 8, 1, 6, 4]
    responses = [torch.randint(3, arch.vocab_size, (k,), generator=g).tolist() for k in lens]
    batch = build_ppo_batch([prompts[i] for i in index], responses, resp_len, 0, index)
    mask = batch["response_mask"]
    batch["advantages"] = torch.randn(batch.size, resp_len, generator=g) * mask
    return batch


def run(actor, batch, share):
    """Log-probs (4-row and 2-row micro-batches, a token budget) and one update's pg_loss / grad norm (lr 0)."""
    from tripod.engine.config import ActorConfig

    actor.share_prompt_prefix = share
    out = {"logp_micro4": actor.compute_log_probs(batch, 4, TEMP)[0],
           "logp_micro2": actor.compute_log_probs(batch, 2, TEMP)[0],
           # 24 tokens: rank 0's units A (5 + 2*8), B (9 + 2), E (4 + 5) fit 2 micro-batches, rank 1's need 3 (C's 3
           # rows, 7 + 3*8, run alone: 15, 8, 13; D 16): both run 3 (engine/workers/moe_shapes.py)
           "logp_budget": actor.compute_log_probs(batch, 4, TEMP, token_budget=24)[0]}
    upd = batch.select(slice(0, batch.size))
    upd["old_log_probs"] = out["logp_micro4"] + 0.05 * torch.randn(upd["advantages"].shape,
                                                                   generator=torch.Generator().manual_seed(3))
    metrics = actor.update(upd, ActorConfig(ppo_mini_batch_size=upd.size, ppo_micro_batch_size_per_gpu=2, ppo_epochs=1,
                                            clip_ratio_low=0.2, clip_ratio_high=0.2, use_dynamic_bsz=False), TEMP, 1)
    out["pg_loss"] = torch.tensor(metrics["actor/pg_loss"])
    out["grad_norm"] = torch.tensor(metrics["actor/grad_norm"])
    return out


def main():
    import tripod.engine.workers.megatron_worker as mw
    from tripod.engine.config import OptimConfig
    from tripod.engine.workers import packing
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout

    hf_dir = sys.argv[1]
    arch = arch_from_hf(hf_dir)
    batch = make_batch(arch)
    layout = ParallelLayout(name="EP2", arch=arch, tp=1, pp=1, ep=2, dp=2, ranks=[0, 1])
    actor = PolicyWorker("actor", arch, layout, hf_dir, grad_clip=1e9,
                         optim=OptimConfig(optimizer="sgd", lr=0.0, weight_decay=0.0, lr_warmup_steps=0))
    assert actor.can_pack, "the tiny MoE actor does not pack: nothing here would be checked"
    real, made = packing.pack_shared_prompts, []
    mw.pack_shared_prompts = lambda mb, pad_id=0: made.append(real(mb, pad_id)) or made[-1]
    try:
        packed = run(actor, batch, True)
    finally:
        mw.pack_shared_prompts = real
    shapes = [None if p is None else tuple(p.input_ids.shape) for p in made]
    mine = torch.tensor([hash(tuple(shapes)) % (1 << 40)], dtype=torch.long)
    both = [torch.zeros_like(mine) for _ in range(2)]
    dist.all_gather(both, mine)
    assert any(s is not None for s in shapes) and both[0] != both[1], f"the ranks' packed shapes agree: {shapes}"
    plain = run(actor, batch, False)
    mask = batch["response_mask"]
    errors = []
    for key, ref in plain.items():
        diff = packed[key] - ref
        errors.append(float((diff * mask if diff.dim() == 2 else diff).abs().max()))
        if dist.get_rank() == 0:
            print(f"EPPACK {key} {errors[-1]:.3e}", flush=True)
    assert worst(errors) < TOL, f"EP2 packed vs unpacked differ by {worst(errors):.3e} > {TOL}"

    # one rank with one more micro-batch: both ranks stop with the same clear error before the forward
    try:
        actor.compute_log_probs(batch, 4 if dist.get_rank() == 0 else 2, TEMP)
    except ValueError as e:
        assert "micro-batches" in str(e) and "expert" in str(e), e
        if dist.get_rank() == 0:
            print(f"EPPACK refused: {e}", flush=True)
    else:
        raise AssertionError("unequal micro-batch counts over the EP group were not refused")
    dist.barrier()
    if dist.get_rank() == 0:
        print("EPPACK-OK", flush=True)


if __name__ == "__main__":
    dist_worker(main)
