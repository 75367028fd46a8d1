"""torchrun worker (4 ranks): the hybrid engine around a real megatron actor (TP2 x PP2) and the embedded engine
(or TP2 x DP2 -> rollout TP4: the rollout TP group in the locality order, not the ranks' order).

argv: HF_DIR ROLLOUT_TPS [TP PP EP ETP] (default 2 2 1 -; an MoE actor with expert parallelism: e.g. 2 1 2 1);
ROLLOUT_TPS is one rollout TP or several ("2,1"), each checked in turn in this one world around a fresh actor.
Checks: the generation shard equals the HF checkpoint's rollout-TP slice exactly and the transport received what the
plan counts (MoE: experts arrive point to point); greedy rollout from the resharded actor == transformers'
generate; the rollout's
log-probs == the actor's recomputed log-probs (1e-5); training shards bit-identical after the round trip; a
training step after the round trip gives the same loss and grad norm as the same step without it.
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker


def make_actor(hf_dir, arch, layout):
    from tripod.engine.config import OptimConfig
    from tripod.engine.workers.ppo_workers import PolicyWorker
    return PolicyWorker("actor", arch, layout, hf_dir, optim=OptimConfig(lr=1e-3, weight_decay=0.0), grad_clip=1e9)


def one_update(actor, batch):
    from tripod.engine.config import ActorConfig
    cfg = ActorConfig(ppo_mini_batch_size=batch.size, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                      clip_ratio_high=0.2)
    return actor.update(batch, cfg, temperature=1.0, n_samples=1)


def check_generation_shard(hf_dir, arch, hybrid, actor):
    """Every tensor of the resharded generation shard == the rollout-TP slice of the HF checkpoint (bit-exact: only
    copies happen), and what the transport counted == what the plan says for this rank."""
    import glob

    from safetensors.torch import load_file

    from tripod.parallel.convert import family_of, hf_to_megatron
    from tripod.parallel.families.spec import Split, pad_rows, padded_vocab_size, shard

    state = {}
    for f in sorted(glob.glob(f"{hf_dir}/*.safetensors")):
        state.update(load_file(f))
    canon = hf_to_megatron(arch, state)
    family, plan, me = family_of(arch), hybrid.plan, dist.get_rank()
    before = hybrid.gather.stats.bytes_received
    gen = hybrid.to_rollout(actor.model)
    j = plan.rollout_tp_rank(me)
    assert set(gen) == set(canon), sorted(set(gen) ^ set(canon))[:6]
    for name, full in canon.items():
        rule = family.row(arch, name).tp
        if rule is Split.VOCAB:  # the generation shard keeps the training TP's vocab padding (plan.py)
            full = pad_rows(full, arch.vocab_size, padded_vocab_size(arch.vocab_size, plan.tp))
        want = shard(rule, full, plan.rollout_tp, j)
        assert torch.equal(gen[name], want.to(gen[name].dtype)), f"rank {me}: generation shard {name} differs"
    if not hybrid.aliases_training_shard(actor.model):
        got = hybrid.gather.stats.bytes_received - before
        assert got == plan.bytes_received(me) == plan.bytes_received(me, fast=True), \
            (me, got, plan.bytes_received(me), plan.bytes_received(me, fast=True))


def main():
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout

    hf_dir, rollout_tps = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    extra = sys.argv[3:7] if len(sys.argv) > 3 else ["2", "2", "1"]
    tp, pp, ep = (int(x) for x in extra[:3])
    etp = int(extra[3]) if len(extra) > 3 and extra[3] != "-" else None
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, name="actor", arch=arch)
    for tg in rollout_tps:
        round_trip(hf_dir, arch, layout, tg, label=f"{tp},{pp},{ep},{etp}")


def round_trip(hf_dir, arch, layout, tg, label):
    from transformers import AutoModelForCausalLM

    from tripod.engine.rollout import SamplingParams, make_rollout_engine
    from tripod.engine.workers.batch import build_ppo_batch
    from tripod.parallel.hybrid_engine.engine import HybridEngine

    actor = make_actor(hf_dir, arch, layout)
    hybrid = HybridEngine(arch, layout, tg, bucket_bytes=16 << 10)
    engine = make_rollout_engine("embedded", arch, hybrid.rollout_tp_group, pad_token_id=0,
                                 tp_order=hybrid.rollout_tp_order)  # slice order when rollout TP > actor TP
    before = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
    check_generation_shard(hf_dir, arch, hybrid, actor)

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 7, 4)]
    params = SamplingParams(max_new_tokens=6, greedy=True, ignore_eos=True)
    engine.load_weights(hybrid.to_rollout(actor.model))  # the trainer's round trip (WeightSync.generate_rows)
    out = engine.generate(prompts, params)
    engine.release_memory()
    for n, p in actor.module.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"training shard {n} changed by the round trip"
    assert engine.memory_bytes() == 0, "rollout copy not released"

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for i, p in enumerate(prompts):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert out.responses()[i] == want.tolist(), (i, out.responses()[i], want.tolist())

    batch = build_ppo_batch(prompts, out.responses(), 6, 0, list(range(len(prompts))))
    logp, _ = actor.compute_log_probs(batch, micro=2, temperature=1.0)
    torch.testing.assert_close(logp, out.log_probs[:, :6], atol=1e-5, rtol=0)

    batch["old_log_probs"] = logp
    batch["advantages"] = torch.randn(logp.shape, generator=g)
    with_trip = one_update(actor, batch)
    fresh = make_actor(hf_dir, arch, layout)
    without = one_update(fresh, batch)
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"):
        assert abs(with_trip[k] - without[k]) <= 1e-6, (k, with_trip[k], without[k])
    if dist.get_rank() == 0:
        print(f"OK rollout_tp={tg} layout={label} pg_loss={with_trip['actor/pg_loss']:.6f} "
              f"grad_norm={with_trip['actor/grad_norm']:.6f}",
              flush=True)


if __name__ == "__main__":
    dist_worker(main)
