"""torchrun worker: the hybrid engine's micro-DP gather on gloo, checked against the HF weights.

argv: HF_DIR TP PP DP ROLLOUT_TPS(comma list) [BIG_HEADS,BIG_KV,BIG_VOCAB,BIG_HIDDEN] — every rank builds its training shard from the HF checkpoint
through the converter, reshards into each rollout TP, and checks: generation shard == the matching slice of the full
HF weights (bit for bit), bytes received (counted by the transport from the tensors each collective delivered) ==
the plan on every rank and, averaged over ranks, == HybridFlow's formula computed from the model's tensors alone;
peak extra memory <= generation shard + one bucket, training shard untouched. Then the same on a larger random model
where memory is measurable.

A rollout TP that training TP does not divide (point-to-point regrouping, parallel/hybrid_engine/regroup.py) is
checked per rank instead of against HybridFlow's mean: counted bytes == the plan's segments == its closed form ==
`p2p_expected_bytes` (from the expected generation shard alone), <= the generation shard, and the largest send +
receive buffers the transport allocated == the plan's <= one bucket.
"""
import sys
from fractions import Fraction

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.helpers.common import dist_worker


def train_shard_from_full(plan, full, rank):
    from tripod.parallel.convert import family_of
    tp_rank, family = plan.train_coords(rank)[0], family_of(plan.arch)
    return {s.name: family.shard(plan.arch, s.name, full[s.name], plan.tp, tp_rank).clone()
            for s in plan.owned_specs(rank)}


def expected_generation(plan, full, rank):
    from tripod.parallel.convert import family_of
    from tripod.parallel.convert.common import pad_vocab
    j, out, family = plan.rollout_tp_rank(rank), {}, family_of(plan.arch)
    for s in plan.specs:
        if s.name in ("embedding.word_embeddings.weight", "output_layer.weight"):  # keeps the training padding
            out[s.name] = pad_vocab(plan.arch, full[s.name], plan.tp).chunk(plan.rollout_tp, 0)[j]
        else:
            out[s.name] = family.shard(plan.arch, s.name, full[s.name], plan.rollout_tp, j)
    return out


def hybridflow_mean_bytes(full, tp, pp, rollout_tp):
    """HybridFlow's bytes received per rank, (t*p - tg)/(tg*t*p) * M, from the model's tensors (not the plan).

    M counts the TP-sharded tensors (vocab rows padded to a multiple of 128*t, megatron's rule). The replicated
    RMSNorm weights are the one exception to the paper's formula: every training TP rank holds them whole, one
    member per stage broadcasts them, and a broadcast reaches all m-1 other members of the micro-DP group (m = k*p,
    k = t/tg), including the k-1 of the sender's stage that already hold them: (m-1)/m of their bytes on average,
    (k-1)/(k*p) more than the minimum (p-1)/p. Only the norms (0.1-1% of the bytes) pay this; it is measured here.
    """
    t, p, tg = tp, pp, rollout_tp
    m = (t // tg) * p
    sharded = replicated = 0
    for name, x in full.items():
        n = x.numel()
        if name.endswith("norm.weight"):
            replicated += n * x.element_size()
            continue
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            multiple = 128 * t
            n = -(-x.shape[0] // multiple) * multiple * x.shape[1]
        sharded += n * x.element_size()
    return Fraction(t * p - tg, tg * t * p) * sharded + Fraction(m - 1, m) * replicated


def p2p_expected_bytes(plan, want, rank):
    """What `rank` must receive, from the expected generation shard: every byte of the other stages' tensors; of its
    own stage's TP-split tensors, the share of rollout slice j outside training slice a (|J_j - I_a| * tg)."""
    from tripod.parallel.families import Split
    a, _, stage = plan.train_coords(rank)
    j, t, tg = plan.rollout_tp_rank(rank), plan.tp, plan.rollout_tp
    lo, hi = max(Fraction(a, t), Fraction(j, tg)), min(Fraction(a + 1, t), Fraction(j + 1, tg))
    outside = 1 - max(hi - lo, Fraction(0)) * tg
    total = Fraction(0)
    for s in plan.specs:
        n = want[s.name].numel() * want[s.name].element_size()
        total += n if s.stage != stage else (0 if s.rule is Split.REPLICATED else n * outside)
    assert total.denominator == 1
    return int(total)


def check(plan, full, tag, measure_memory):
    from tripod.parallel.hybrid_engine import MicroDPGather
    from tripod.runtime.memory import measure_peak_memory
    rank = dist.get_rank()
    shard = train_shard_from_full(plan, full, rank)
    before = {n: t.clone() for n, t in shard.items()}
    gather = MicroDPGather(plan)
    dist.barrier()
    with measure_peak_memory() as mem:
        gen = gather.gather(shard)
    want = expected_generation(plan, full, rank)
    assert set(gen) == set(want), (set(gen) ^ set(want))
    for n in want:
        assert torch.equal(gen[n], want[n]), f"{tag} rank {rank}: generation shard {n} differs"
    for n in before:
        assert torch.equal(shard[n], before[n]), f"{tag} rank {rank}: training shard {n} changed"
    assert gather.stats.bytes_received == plan.bytes_received(rank), (gather.stats, plan.bytes_received(rank))
    limit = plan.peak_extra_bytes()
    slop = 1 << 20  # allocator / interpreter noise, measured < 0.5 MiB on this machine
    if measure_memory:
        assert mem.extra_bytes <= limit + slop, f"{tag} rank {rank}: peak extra {mem.extra_bytes} > {limit}"
    counted = [None] * dist.get_world_size()
    dist.all_gather_object(counted, gather.stats.bytes_received)
    if plan.p2p:
        expected = p2p_expected_bytes(plan, want, rank)
        assert gather.stats.bytes_received == expected == plan.bytes_received(rank, fast=True), \
            (tag, rank, gather.stats.bytes_received, expected, plan.bytes_received(rank, fast=True))
        assert expected <= plan.generation_shard_bytes()
        from tripod.parallel.hybrid_engine.regroup import buffer_bytes
        assert gather.stats.peak_buffer_bytes == buffer_bytes(plan, rank) <= plan.max_bucket_bytes() <= plan.bucket_bytes
        wanted = [None] * dist.get_world_size()
        dist.all_gather_object(wanted, expected)
        mean, formula = Fraction(sum(counted), len(counted)), Fraction(sum(wanted), len(wanted))
    else:
        mean, formula = Fraction(sum(counted), len(counted)), hybridflow_mean_bytes(full, plan.tp, plan.pp, plan.rollout_tp)
    assert mean == formula, f"{tag}: mean bytes received {float(mean)} != HybridFlow {float(formula)}"
    print(f"[{tag}] rank {rank} rollout_tp_rank={plan.rollout_tp_rank(rank)} group={plan.rollout_tp_group_of(rank)}",
          flush=True)
    print(f"[{tag}] rank {rank} recv={gather.stats.bytes_received} plan={plan.bytes_received(rank)} "
          f"peak_extra={mem.extra_bytes} limit={limit} gen_shard={plan.generation_shard_bytes()} "
          f"mean_recv={float(mean)} hybridflow={float(formula)}", flush=True)


def random_full(arch, seed=0):
    from tripod.parallel.convert import canonical_names, family_of
    g, family = torch.Generator().manual_seed(seed), family_of(arch)
    return {n: torch.randn(family.shape(arch, n), generator=g) for n in canonical_names(arch)}


def main():
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import hf_to_megatron
    from tripod.parallel.hybrid_engine import build_reshard_plan
    hf_dir, tp, pp, dp = sys.argv[1], *map(int, sys.argv[2:5])
    rollout_tps = [int(x) for x in sys.argv[5].split(",")]
    arch = arch_from_hf(hf_dir)
    full = hf_to_megatron(arch, load_file(f"{hf_dir}/model.safetensors"))
    for tg in rollout_tps:
        plan = build_reshard_plan(arch, tp, pp, dp, tg, bucket_bytes=8 << 10, world_size=dist.get_world_size())
        check(plan, full, f"hf tp{tp}pp{pp}dp{dp}->tg{tg}", measure_memory=False)
    # a model large enough that the RSS high-water mark measures the transport, not the interpreter
    heads, kv, vocab, hidden = map(int, sys.argv[6].split(",")) if len(sys.argv) > 6 else (8, 4, 4000, 512)
    big = arch_from_hf(dict(arch.hf_config, hidden_size=hidden, intermediate_size=1536, vocab_size=vocab,
                            num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads))
    full = random_full(big)
    for tg in rollout_tps:
        plan = build_reshard_plan(big, tp, pp, dp, tg, bucket_bytes=1 << 20, world_size=dist.get_world_size())
        check(plan, full, f"big tp{tp}pp{pp}dp{dp}->tg{tg}", measure_memory=True)


if __name__ == "__main__":
    dist_worker(main)
