"""torchrun worker (2 ranks): the rollout sync of a LoRA actor (TP2, random non-zero adapters on every linear) merges
lazily (parallel/lora/merge.py), a bucket at a time, with buckets much smaller than one adapted weight.

argv: HF_DIR BUCKET_BYTES. For rollout TP1 (micro-DP broadcasts: own copies + buckets) in fp32 and in bf16, and
rollout TP2 (own copies only, where without LoRA the engine would read the parameters) through WeightSync into the
embedded engine's weight buffers:
- the generation shard equals, bit for bit, the same transport run on an eagerly merged shard
  ((W.float() + local_delta_weight().float()).to(W.dtype) of every adapted weight, the merge as it was);
- prints `LORA_SYNC <case> rank <r> merged_peak <b> delta_peak <b> largest <b> adapted <b>`: the most bytes of merged
  chunks and of deltas alive at once during the sync (MergeStats), this rank's largest adapted weight and all of them;
- `PLANTED_EAGER rank <r> merged_peak <b>`: the same with train_with_hooks.py's lora_eager_merge planted (all merged
  up front);
- the actor's parameters are bit-identical after every sync, and the engine's weights never share their storage.
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker


def eager_shard(model, hybrid) -> dict[str, torch.Tensor]:
    """The training shard with every adapted weight merged up front, as the sync did before it merged lazily."""
    from tripod.parallel.convert import global_params
    from tripod.parallel.lora import lora_adapters

    me, plan = dist.get_rank(), hybrid.plan
    wanted = {s.name for s in plan.owned_specs(me) + plan.owned_expert_specs(me)}
    params = global_params(model)
    names = {id(p): n for n, p in params.items()}
    shard = {n: p.data for n, p in params.items() if n in wanted}
    with torch.no_grad():
        for a in lora_adapters([model]):
            w = a.base_weight[0].data
            shard[names[id(a.base_weight[0])]] = (w.float() + a.local_delta_weight().float()).to(w.dtype)
    return shard


def check_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    assert set(got) == set(want), (label, sorted(set(got) ^ set(want))[:4])
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), f"rank {dist.get_rank()} {label}: {n} differs"


def report(label: str, stats, adapters) -> None:
    sizes = [a.base_weight[0].numel() * a.base_weight[0].element_size() for a in adapters]
    print(f"LORA_SYNC {label} rank {dist.get_rank()} merged_peak {stats.merged_peak} delta_peak {stats.delta_peak} "
          f"largest {max(sizes)} adapted {sum(sizes)}", flush=True)


def main() -> None:
    from tests.multiprocess.workers.train_with_hooks import plant, unplant
    from tripod.engine.rollout import make_rollout_engine
    from tripod.engine.rollout.weight_sync import WeightSync
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import load_hf_weights
    from tripod.parallel.hybrid_engine.engine import HybridEngine
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.lora import LoraSettings, apply_lora
    from tripod.parallel.model import build_gpt_model

    hf_dir, bucket = sys.argv[1], int(sys.argv[2])
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(tp=2, pp=1, name="actor", arch=arch)
    model = build_gpt_model(arch, layout, use_te=False)
    assert not load_hf_weights(model, hf_dir, arch, layout)
    adapters = apply_lora([model], arch, LoraSettings(rank=4, alpha=8.0, target_modules=["all-linear"]))
    g = torch.Generator().manual_seed(7)  # the same draws on both ranks: replicated A / B agree
    with torch.no_grad():
        for p in (p for a in adapters for p in a.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

    for label, dtype in (("tp2to1_fp32", torch.float32), ("tp2to1_bf16", torch.bfloat16)):
        hybrid = HybridEngine(arch, layout, 1, bucket_bytes=bucket, dtype=dtype)
        want = hybrid.gather.gather(eager_shard(model, hybrid))
        check_equal(hybrid.to_rollout(model), want, label)
        report(label, hybrid.merge_stats, adapters)
        if dtype == torch.float32:
            plant("lora_eager_merge")
            try:
                check_equal(hybrid.to_rollout(model), want, "planted eager merge")
            finally:
                unplant()
            print(f"PLANTED_EAGER rank {dist.get_rank()} merged_peak {hybrid.merge_stats.merged_peak}", flush=True)

    # rollout TP == training TP, PP 1, same dtype: without LoRA the engine would read the parameters themselves
    hybrid = HybridEngine(arch, layout, 2, bucket_bytes=bucket)
    assert not hybrid.aliases_training_shard(model)
    want = hybrid.gather.gather(eager_shard(model, hybrid))
    engine = make_rollout_engine("embedded", arch, hybrid.rollout_tp_group, pad_token_id=0)
    sync = WeightSync(hybrid, engine, model)
    for _ in range(2):  # the second load is gathered straight into the engine's weight buffers
        with sync.loaded() as eng:
            weights = eng.decoder.weights
            check_equal(weights, want, "tp2to2 embedded")
            assert not any(t.untyped_storage().data_ptr() in storages for t in weights.values())
        report("tp2to2_embedded", hybrid.merge_stats, adapters)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n].detach(), t) for n, t in before.items()), "a sync wrote into the actor"
    print(f"LORA_SYNC params_unchanged rank {dist.get_rank()}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
