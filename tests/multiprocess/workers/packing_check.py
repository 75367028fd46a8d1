"""torchrun worker (2 ranks): shared-prompt packing gives the unpacked results, on DP2 [0, 1], PP2 [0, 1] and
TP2 + sequence parallel [0, 1].

argv: hf_dir. One batch of fresh random prompts (see make_batch), responses of random lengths (one of a single token);
every micro-batch of the packed runs must really pack. For each layout, a packed and an unpacked actor
and critic built from the same checkpoint must give the same log-probs / entropy / values (response tokens), the
same pg_loss / vf_loss / grad norms of one update (SGD: no Adam amplification of rounding), and the same log-probs
after it. Then a planted bug (response blocks see each other's tokens) must be caught by the same comparison.
The same for padding-free packing (use_remove_padding, with and without shared prompts) on a batch whose units
really share model rows (make_padding_free_batch), with its own planted leak (units see the row's earlier units).
Last, an MoE actor (Qwen2-MoE) packs, but not when its router keeps token statistics (aux loss, expert-bias
update; MegatronWorker.can_pack). Prints `PACK <layout> <quantity> <max diff>` lines, `PACK planted <diff>` and
`PACK moe <router> packed_micro_batches=<n>`.
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.bounds import worst
from tests.helpers.common import dist_worker

TOL = 2e-5  # fp32, values of order 1-10: float rounding of other reduction orders / shapes


def make_batch(arch, g):
    """8 rows [A, B, A, A | C, C, D, D] (prompts of random lengths): each half (a DP rank's, or a micro-batch of 4)
    packs into two model rows, so pipeline stages see equal shapes; a group is split by another prompt's row."""
    from tripod.engine.workers.batch import build_ppo_batch

    distinct = [torch.randint(3, arch.vocab_size, (int(torch.randint(4, 10, (1,), generator=g)),),
                              generator=g).tolist() for _ in range(4)]
    index = [0, 1, 0, 0, 2, 2, 3, 3]
    resp_len = 7
    lens = torch.randint(1, resp_len + 1, (len(index),), generator=g).tolist()
    lens[0] = 1
    responses = [torch.randint(3, arch.vocab_size, (k,), generator=g).tolist() for k in lens]
    batch = build_ppo_batch([distinct[i] for i in index], responses, resp_len, 0, index)
    mask = batch["response_mask"]
    batch["advantages"] = torch.randn(batch.size, resp_len, generator=g) * mask
    batch["returns"] = torch.randn(batch.size, resp_len, generator=g) * mask
    batch["values"] = torch.randn(batch.size, resp_len, generator=g) * mask
    return batch


def make_padding_free_batch(arch, g):
    """8 rows [A, B, A, C | D, D, E, F] with fixed lengths and random tokens: in each half (a DP rank's rows, or a
    micro-batch of 4) the two small units share a model row behind the longest one, with and without shared
    prompts (prompt + responses: A 9 + 7 + 6, B 4 + 1, C 5 + 3 | D 8 + 7 + 5, E 3 + 4, F 6 + 2)."""
    from tripod.engine.workers.batch import build_ppo_batch

    prompt_lens, index = [9, 4, 5, 8, 3, 6], [0, 1, 0, 2, 3, 3, 4, 5]
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    lens, resp_len = [7, 1, 6, 3, 7, 5, 4, 2], 7
    responses = [torch.randint(3, arch.vocab_size, (k,), generator=g).tolist() for k in lens]
    batch = build_ppo_batch([prompts[i] for i in index], responses, resp_len, 0, index)
    mask = batch["response_mask"]
    for key in ("advantages", "returns", "values"):
        batch[key] = torch.randn(batch.size, resp_len, generator=g) * mask
    return batch


def run_models(hf_dir, arch, layout, batch, share, sp, remove_padding=False):
    from tripod.engine.config import ActorConfig, CriticConfig, OptimConfig
    from tripod.engine.workers.ppo_workers import CriticWorker, PolicyWorker

    optim = OptimConfig(optimizer="sgd", lr=1e-2, weight_decay=0.0, lr_warmup_steps=0)
    common = dict(optim=optim, grad_clip=1e9, share_prompt_prefix=share, sequence_parallel=sp,
                  remove_padding=remove_padding)
    actor = PolicyWorker("actor", arch, layout, hf_dir, **common)
    critic = CriticWorker("critic", arch, layout, hf_dir, value_head=True, **common)
    micro = 4
    logp, ent = actor.compute_log_probs(batch, micro, 0.8, with_entropy=True)
    values = critic.compute_values(batch, micro)
    batch = batch.select(slice(0, batch.size))
    batch["old_log_probs"] = logp + 0.05 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(3))
    acfg = ActorConfig(ppo_mini_batch_size=batch.size, ppo_micro_batch_size_per_gpu=micro, clip_ratio_low=0.2,
                       clip_ratio_high=0.2, entropy_coeff=0.01)
    ccfg = CriticConfig(ppo_mini_batch_size=batch.size, ppo_micro_batch_size_per_gpu=micro, ppo_epochs=1,
                        use_dynamic_bsz=False)
    a = actor.update(batch, acfg, 0.8, 1)
    c = critic.update(batch, ccfg, 1)
    logp1, _ = actor.compute_log_probs(batch, micro, 0.8)
    return dict(logp=logp, entropy=ent, values=values, logp_after=logp1,
                pg_loss=torch.tensor(a["actor/pg_loss"]), actor_grad_norm=torch.tensor(a["actor/grad_norm"]),
                vf_loss=torch.tensor(c["critic/vf_loss"]), critic_grad_norm=torch.tensor(c["critic/grad_norm"]))


def compare(name, packed, plain, mask):
    errors = []
    for key, ref in plain.items():
        diff = packed[key] - ref
        if diff.dim() == 2:
            diff = diff * mask
        errors.append(diff.abs().max().item())
        print(f"PACK {name} {key} {errors[-1]:.3e}", flush=True)
    return worst(errors)


def main():
    import tripod.engine.workers.megatron_worker as mw
    from tripod.engine.workers import packing
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout

    hf_dir = sys.argv[1]
    arch = arch_from_hf(hf_dir)
    batch = make_batch(arch, torch.Generator().manual_seed(7))
    mask = batch["response_mask"]
    assert sorted(len(g) for g in packing.prompt_groups(batch)) == [1, 2, 2, 3]
    cases = [("DP2", dict(tp=1, pp=1, dp=2, ranks=[0, 1]), False), ("PP2", dict(tp=1, pp=2, dp=1, ranks=[0, 1]), False),
             ("TP2SP", dict(tp=2, pp=1, dp=1, ranks=[0, 1]), True)]
    for name, kw, sp in cases:
        layout = ParallelLayout(name=name, arch=arch, **kw)
        if not layout.is_member:
            continue
        real = packing.pack_shared_prompts
        made = []
        mw.pack_shared_prompts = lambda mb, pad_id=0: made.append(real(mb, pad_id)) or made[-1]
        try:
            packed = run_models(hf_dir, arch, layout, batch, True, sp)
        finally:
            mw.pack_shared_prompts = real
        assert made and all(p is not None and p.input_ids.shape[0] == 2 for p in made), name
        plain = run_models(hf_dir, arch, layout, batch, False, sp)
        worst = compare(name, packed, plain, mask)
        assert worst < TOL, f"{name}: packed vs unpacked differ by {worst:.3e} > {TOL}"
        if name == "DP2":  # planted bug: response blocks see every earlier slot, not only the prompt
            def leaky(mb, pad_id=0):
                out = real(mb, pad_id)
                if out is not None:
                    causal = torch.ones(out.seq, out.seq, dtype=torch.bool).tril()
                    out.mask = out.mask & ~causal[None, None]
                return out

            mw.pack_shared_prompts = leaky
            try:
                bad = run_models(hf_dir, arch, layout, batch, True, sp)
            finally:
                mw.pack_shared_prompts = real
            err = ((bad["logp"] - plain["logp"]) * mask).abs().max().item()
            print(f"PACK planted {err:.3e}", flush=True)
            assert err > 100 * TOL, f"the planted mask leak was not caught ({err:.3e})"
        check_padding_free(hf_dir, arch, layout, name, sp, mw)
    check_moe_router_runs_do_not_pack(hf_dir, mw)
    dist.barrier()


def check_padding_free(hf_dir, arch, layout, name, sp, mw) -> None:
    """use_remove_padding against the unpacked rows (shared prompts or not); at DP2 a planted cross-unit leak."""
    batch = make_padding_free_batch(arch, torch.Generator().manual_seed(11))
    mask = batch["response_mask"]
    plain = run_models(hf_dir, arch, layout, batch, False, sp)
    real = mw.pack_without_padding
    for share, rows in ((True, 2), (False, 3)):  # per half: 3 units in 2 model rows, or 4 rows in 3
        made = []
        mw.pack_without_padding = lambda mb, sh, pad_id=0: made.append(real(mb, sh, pad_id)) or made[-1]
        try:
            packed = run_models(hf_dir, arch, layout, batch, share, sp, remove_padding=True)
        finally:
            mw.pack_without_padding = real
        assert made and all(p is not None and p.input_ids.shape[0] == rows for p in made), (name, share)
        label = f"{name}_RMPAD{'_SHARED' if share else ''}"
        worst = compare(label, packed, plain, mask)
        assert worst < TOL, f"{label}: padding-free vs unpacked differ by {worst:.3e} > {TOL}"
    if name != "DP2":
        return

    def leaky(mb, sh, pad_id=0):  # planted: every slot sees the row's earlier slots, other units included
        out = real(mb, sh, pad_id)
        if out is not None:
            out.mask = out.mask & ~torch.ones(out.seq, out.seq, dtype=torch.bool).tril()[None, None]
        return out

    mw.pack_without_padding = leaky
    try:
        bad = run_models(hf_dir, arch, layout, batch, False, sp, remove_padding=True)
    finally:
        mw.pack_without_padding = real
    err = ((bad["logp"] - plain["logp"]) * mask).abs().max().item()
    print(f"PACK planted_rmpad {err:.3e}", flush=True)
    assert err > 100 * TOL, f"the planted padding-free leak was not caught ({err:.3e})"


def check_moe_router_runs_do_not_pack(hf_dir, mw) -> None:
    """An MoE actor packs shared prompts unless its router keeps token statistics (the load-balancing loss or the
    expert-bias update): packing counts a shared prompt once instead of once per row, which would change them.
    Qwen2-MoE (plain RoPE) packs by itself, so each refusal below is the router rule's doing."""
    import os

    from tests.helpers.moe_models import make_tiny_moe_model
    from tripod.engine.config import OptimConfig
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout

    moe_root = os.path.join(os.path.dirname(hf_dir), "moe_packing")
    if dist.get_rank() == 0:
        make_tiny_moe_model(moe_root, "qwen2_moe", seed=4, vocab_size=96, max_position_embeddings=128)
    dist.barrier()
    moe_dir = os.path.join(moe_root, "qwen2_moe_seed4")
    arch = arch_from_hf(moe_dir)
    batch = make_batch(arch, torch.Generator().manual_seed(8))
    layout = ParallelLayout(name="MOE_DP2", arch=arch, tp=1, pp=1, dp=2, ranks=[0, 1])
    routers = {"no_router_stats": {}, "aux_loss": dict(moe_router_load_balancing_type="aux_loss",
                                                       moe_aux_loss_coeff=0.01),
               "bias_update": dict(moe_router_bias_update_rate=1e-3)}
    real = mw.pack_shared_prompts
    for name, overrides in routers.items():
        made = []
        mw.pack_shared_prompts = lambda mb, pad_id=0: made.append(real(mb, pad_id)) or made[-1]
        try:
            actor = PolicyWorker("actor", arch, layout, moe_dir, optim=OptimConfig(optimizer="sgd", lr=1e-2),
                                 grad_clip=1e9, share_prompt_prefix=True, config_overrides=overrides)
            actor.compute_log_probs(batch, 4, 1.0)
        finally:
            mw.pack_shared_prompts = real
        packed = sum(p is not None for p in made)
        print(f"PACK moe {name} packed_micro_batches={packed}", flush=True)
        assert (packed > 0) == (name == "no_router_stats"), (name, packed)


if __name__ == "__main__":
    dist_worker(main)
