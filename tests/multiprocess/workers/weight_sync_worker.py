"""torchrun worker (2 ranks): engine/rollout/weight_sync.py around real megatron actors and the embedded engine.

argv: HF_DIR. Prints `WS <check> ok` lines:
  lifecycle   TP1xDP2 actor: events are release, (resume, load, generate, release) per call; nothing is held after
  alias       the generation shard is the actor's parameters (same storage) and generates exactly what a gathered
              copy generates
  error       a failing generate still releases the engine
  buckets     TP2 actor, rollout TP2: what the SGLang push sends (full HF tensors, bucket by bucket, flattened per
              dtype and rebuilt) equals the HF checkpoint's tensors; no bucket's full tensors exceed the budget
              unless it is a single tensor
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker


def main():
    from safetensors.torch import load_file

    from tripod.engine.config import OptimConfig
    from tripod.engine.rollout import SamplingParams, make_rollout_engine
    from tripod.engine.rollout.weight_sync import (
        WeightSync,
        flatten_by_dtype,
        gather_bucket_full,
        hf_buckets,
        unflatten,
    )
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import family_of
    from tripod.parallel.hybrid_engine.engine import HybridEngine
    from tripod.parallel.layout import ParallelLayout

    hf_dir = sys.argv[1]
    arch = arch_from_hf(hf_dir)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (5, 7)]
    params = SamplingParams(max_new_tokens=5, greedy=True, ignore_eos=True)

    # ---- TP1 x DP2: the engine reads the actor's parameters ------------------------------------------------
    layout = ParallelLayout(tp=1, pp=1, name="actor", arch=arch)
    actor = PolicyWorker("actor", arch, layout, hf_dir, optim=OptimConfig(lr=1e-3, weight_decay=0.0))
    hybrid = HybridEngine(arch, layout, 1)
    engine = make_rollout_engine("embedded", arch, hybrid.rollout_tp_group, pad_token_id=0)
    sync = WeightSync(hybrid, engine, actor.model)
    assert hybrid.aliases_training_shard(actor.model)
    storages = {p.data.untyped_storage().data_ptr() for p in actor.module.parameters()}
    with sync.loaded() as eng:
        assert all(t.untyped_storage().data_ptr() in storages for t in eng.decoder.weights.values())
        aliased = eng.generate(prompts, params)
    out = sync.generate(prompts, params)
    assert sync.events == ["release", "resume", "load", "release", "resume", "load", "generate", "release"], sync.events
    assert engine.memory_bytes() == 0 and engine.decoder.weights == {}
    copied_engine = make_rollout_engine("embedded", arch, hybrid.rollout_tp_group, pad_token_id=0)
    copied_engine.load_weights({n: t.clone() for n, t in hybrid.to_rollout(actor.model).items()})
    copied = copied_engine.generate(prompts, params)
    assert torch.equal(aliased.response_ids, copied.response_ids) and torch.equal(out.response_ids, copied.response_ids)
    print(f"WS lifecycle ok rank={rank}", flush=True)
    print(f"WS alias ok rank={rank}", flush=True)

    class Boom(RuntimeError):
        pass

    real_generate = engine.generate
    engine.generate = lambda *a, **k: (_ for _ in ()).throw(Boom("planted"))
    try:
        sync.generate(prompts, params)
        raise AssertionError("the planted generate error did not propagate")
    except Boom:
        pass
    engine.generate = real_generate
    assert sync.events[-1] == "release" and engine.memory_bytes() == 0
    print(f"WS error ok rank={rank}", flush=True)

    # ---- TP2, rollout TP2: the SGLang push payload, bucket by bucket ------------------------------------
    layout2 = ParallelLayout(tp=2, pp=1, name="actor2", arch=arch)
    actor2 = PolicyWorker("actor2", arch, layout2, hf_dir, trainable=False)
    hybrid2 = HybridEngine(arch, layout2, 2)
    shard = hybrid2.to_rollout(actor2.model)
    budget = 24 << 10
    buckets = hf_buckets(arch, shard, 2, budget)
    assert sorted(n for b in buckets for n in b) == sorted(shard) and len(buckets) > 2
    want = load_file(f"{hf_dir}/model.safetensors")
    seen = {}
    for names in buckets:
        full_bytes = sum(shard[n].element_size() * torch.Size(family_of(arch).shape(arch, n)).numel() for n in names)
        assert full_bytes <= budget or len(names) == 1, (names, full_bytes)
        named = gather_bucket_full(arch, names, shard, hybrid2.rollout_tp_group, 2)
        for dtype, (flat, meta) in flatten_by_dtype(named).items():
            assert flat.dim() == 1 and flat.dtype == dtype
            for name, t in unflatten(flat, meta):
                seen[name] = t.clone()
    if arch.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    assert sorted(seen) == sorted(want), (sorted(set(want) ^ set(seen)))[:6]
    for name, t in want.items():
        torch.testing.assert_close(seen[name], t.to(seen[name].dtype), rtol=0, atol=0, msg=name)
    print(f"WS buckets ok rank={rank} n={len(buckets)}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
