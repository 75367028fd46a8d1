"""torchrun worker (2 ranks): MoE routing replay (parallel/router_replay.py) against the embedded engine's record.

argv: hf_dir ... (tiny MoE checkpoints). For each model:
  - the embedded engine generates in bf16 from an fp32 generation shard, recording every token's experts (R3);
  - a bf16 megatron actor at EP2 (DP2), PP2, TP2 with sequence parallelism (all three with shared-prompt packing)
    and DP2 with padding-free packing computes (tripod runs MoE models without context parallelism) the log-probs of those rows, without replay (its routers
    choose: `moe/routing_mismatch_frac` > 0) and replaying the rollout's ids (mismatch 0, a smaller gap to the
    rollout's log-probs); its own record (R2) replayed gives its own unreplayed log-probs exactly; one update under
    replay moves the router weights (the routing weights come from the live router);
  - planted: replaying layer i's ids into layer i+1 must give a mismatch > 0; replaying each token with the next
    token's ids (the reference shifted too, so the mismatch stays 0) must give a large
    `moe/replay_live_mismatch_frac` (replayed ids vs the live router's own choice), which stays small when aligned;
  - fp32 engine and fp32 actor (TP1): R2's record equals R3's (mismatch 0) and both replays give the same log-probs.
Prints `RR <model> <layout> <quantity> <value>` lines.
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker

N_SAMPLES, MAX_NEW, TEMP = 2, 12, 1.0
# moe/replay_live_mismatch_frac: replayed ids vs the live router's choice for the same token. Aligned: near-tied flips
# only (about the unreplayed mismatch, ~1% here); shifted by one token: most tokens
LIVE_ALIGNED_MAX, LIVE_SHIFTED_MIN = 0.05, 0.3


def next_tokens_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[N, S, L, k] routed ids with each position given the next position's (the last: no record)."""
    out = torch.full_like(ids, num_experts)
    out[:, :-1] = ids[:, 1:]
    return out


def rollout(hf_dir, arch, dtype):
    """Prompts, the engine's output (bf16 or fp32 generation, routing recorded) and the generating fp32 shard."""
    from tripod.engine.rollout import SamplingParams
    from tripod.engine.rollout.embedded import EmbeddedRolloutEngine
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.hybrid_engine.engine import HybridEngine
    from tripod.parallel.layout import ParallelLayout

    layout = ParallelLayout(tp=1, pp=1, name="gen", arch=arch)
    gen = PolicyWorker("gen", arch, layout, hf_dir, trainable=False)
    shard = HybridEngine(arch, layout, 1).to_rollout(gen.model)
    engine = EmbeddedRolloutEngine(arch, None, dtype=dtype, pad_token_id=0)
    engine.load_weights({k: v.clone() for k, v in shard.items()})
    engine.record_routing = True
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, arch.vocab_size, (int(n),), generator=g).tolist() for n in (5, 9, 7, 12)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=TEMP, n=N_SAMPLES, seed=5,
                                                  ignore_eos=True))
    return prompts, out


def make_batch(prompts, out, arch):
    from tripod.engine.rollout.routing_record import batch_tensor, record_bytes
    from tripod.engine.workers.batch import build_ppo_batch
    from tripod.parallel.router_replay import ROLLOUT_ROUTED_EXPERTS_KEY, ROUTED_EXPERTS_KEY

    rows = [prompts[i] for i in out.prompt_index.tolist()]
    responses = out.responses()
    batch = build_ppo_batch(rows, responses, MAX_NEW, 0, out.prompt_index.tolist(),
                            rollout_log_probs=[out.log_probs[i, :len(r)] for i, r in enumerate(responses)])
    ids = batch_tensor(out.routed_experts, batch["input_ids"].shape[1], arch.moe.num_experts)
    batch[ROUTED_EXPERTS_KEY] = ids
    batch[ROLLOUT_ROUTED_EXPERTS_KEY] = ids
    return batch, record_bytes(out.routed_experts), ids.numel() * ids.element_size()


def gap(logp, batch):
    mask = batch["response_mask"]
    return float(((logp - batch["rollout_log_probs"]).abs() * mask).sum() / mask.sum())


def forward(actor, batch, mode, micro=4):
    actor.routing.mode = mode
    logp, _ = actor.compute_log_probs(batch, micro, TEMP)
    return logp, actor.routing.metrics()


def check_layout(name, hf_dir, arch, batch, layout_kw, model, micro=4, **worker_kw):
    from tests.multiprocess.workers.train_with_hooks import plant, unplant
    from tripod.engine.config import ActorConfig, OptimConfig
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.precision import PrecisionSettings
    from tripod.parallel.router_replay import ROLLOUT_ROUTED_EXPERTS_KEY, ROUTED_EXPERTS_KEY

    layout = ParallelLayout(name=name, arch=arch, **layout_kw)
    # shared-prompt packing on (the default) everywhere: at EP2 the DP ranks' packed shapes differ and
    # MegatronWorker.run pads them to one (engine/workers/moe_shapes.py)
    actor = PolicyWorker(name, arch, layout, hf_dir, routing_replay=True, **worker_kw,
                         precision=PrecisionSettings(param_dtype=torch.bfloat16),
                         optim=OptimConfig(optimizer="sgd", lr=0.5, weight_decay=0.0, lr_warmup_steps=0),
                         grad_clip=1e9)
    say = lambda what, v: dist.get_rank() == 0 and print(f"RR {model} {name} {what} {v}", flush=True)  # noqa: E731
    logp_free, m_free = forward(actor, batch, "record", micro)
    recorded = actor.recorded_routing
    logp_r3, m_r3 = forward(actor, batch, "replay", micro)
    g_free, g_r3 = gap(logp_free, batch), gap(logp_r3, batch)
    say("mismatch_without_replay", m_free["moe/routing_mismatch_frac"])
    say("mismatch_with_replay", m_r3["moe/routing_mismatch_frac"])
    say("gap_without_replay", g_free)
    say("gap_with_replay", g_r3)
    for k, v in sorted(m_free.items()):
        say(f"without {k}", v)
    assert m_free["moe/routing_mismatch_frac"] > 0, f"{name}: no routing flip between rollout and trainer"
    assert m_r3["moe/routing_mismatch_frac"] == 0, f"{name}: replay left mismatches {m_r3}"
    assert g_r3 < g_free, f"{name}: replay did not shrink the log-prob gap ({g_r3} vs {g_free})"
    # the replayed ids against the live router's choice for the same token: only near-tied flips when aligned
    live = m_r3["moe/replay_live_mismatch_frac"]
    say("live_mismatch_with_replay", live)
    assert live <= LIVE_ALIGNED_MAX, f"{name}: replayed ids differ from the live router's on {live:.3f} of the tokens"

    # a record misaligned by one position (each token replayed with the next token's experts, the rollout's reference
    # shifted with it, as a record shifted at its source is): routing_mismatch_frac cannot see it, the live one must
    shifted = batch.select(slice(0, batch.size))
    shifted[ROUTED_EXPERTS_KEY] = shifted[ROLLOUT_ROUTED_EXPERTS_KEY] = next_tokens_ids(batch[ROUTED_EXPERTS_KEY],
                                                                                      arch.moe.num_experts)
    _, m_shift = forward(actor, shifted, "replay", micro)
    say("token_shift_mismatch", m_shift["moe/routing_mismatch_frac"])
    say("token_shift_live_mismatch", m_shift["moe/replay_live_mismatch_frac"])
    assert m_shift["moe/replay_live_mismatch_frac"] >= LIVE_SHIFTED_MIN, \
        f"{name}: a one-token shift of the replayed record was not caught: {m_shift}"

    # R2: the pass's own record, replayed, is the pass itself (record -> batch layout -> router order round trip)
    r2 = batch.select(slice(0, batch.size))
    r2[ROUTED_EXPERTS_KEY] = recorded
    logp_r2, m_r2 = forward(actor, r2, "replay", micro)
    diff = float(((logp_r2 - logp_free).abs() * batch["response_mask"]).max())
    say("r2_vs_unreplayed_maxdiff", diff)
    assert diff == 0.0, f"{name}: replaying the trainer's own record changed the log-probs by {diff}"
    assert abs(m_r2["moe/routing_mismatch_frac"] - m_free["moe/routing_mismatch_frac"]) < 1e-12, (m_r2, m_free)

    # planted: layer i's ids replayed into layer i+1
    plant("replay_layer_shift")
    try:
        logp_bad, m_bad = forward(actor, batch, "replay", micro)
    finally:
        unplant()
    say("planted_mismatch", m_bad["moe/routing_mismatch_frac"])
    say("planted_gap", gap(logp_bad, batch))
    assert m_bad["moe/routing_mismatch_frac"] > 0, f"{name}: the planted layer shift was not caught"

    # an update under replay: the routers still learn (their scores at the replayed experts carry the gradient)
    routers = [p for chunk in actor.chunks for n, p in chunk.named_parameters() if n.endswith("router.weight")]
    before = [p.detach().float().clone() for p in routers]
    upd = batch.select(slice(0, batch.size))
    upd["old_log_probs"] = logp_r3
    upd["advantages"] = torch.randn(logp_r3.shape, generator=torch.Generator().manual_seed(1)) * upd["response_mask"]
    actor.routing.mode = "replay"
    actor.update(upd, ActorConfig(ppo_mini_batch_size=upd.size, ppo_micro_batch_size_per_gpu=micro, ppo_epochs=1,
                                  clip_ratio_low=0.2, clip_ratio_high=0.2,
                                  use_dynamic_bsz=False), TEMP, 1)
    moved = max(float((p.detach().float() - b).abs().max()) for p, b in zip(routers, before)) if routers else 0.0
    moved_t = torch.tensor([moved])
    dist.all_reduce(moved_t, op=dist.ReduceOp.MAX)
    say("router_weight_moved", float(moved_t))
    assert float(moved_t) > 0, f"{name}: the router did not learn under replay"
    m_upd = actor.routing.metrics()
    assert m_upd.get("moe/routing_mismatch_frac", 0.0) == 0, m_upd
    actor.routing.mode = "off"


def check_r2_equals_r3(hf_dir, arch, model):
    """fp32 engine, fp32 actor at TP1 (its own forward's arithmetic): R2's record is R3's, both replays agree."""
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.router_replay import ROUTED_EXPERTS_KEY

    prompts, out = rollout(hf_dir, arch, torch.float32)
    batch, _, _ = make_batch(prompts, out, arch)
    layout = ParallelLayout(tp=1, pp=1, name="fp32", arch=arch)
    actor = PolicyWorker("fp32", arch, layout, hf_dir, trainable=False, routing_replay=True)
    _, m = forward(actor, batch, "record")
    r2 = batch.select(slice(0, batch.size))
    r2[ROUTED_EXPERTS_KEY] = actor.recorded_routing
    logp_r3, _ = forward(actor, batch, "replay")
    logp_r2, _ = forward(actor, r2, "replay")
    diff = float(((logp_r2 - logp_r3).abs() * batch["response_mask"]).max())
    if dist.get_rank() == 0:
        print(f"RR {model} fp32 mismatch {m['moe/routing_mismatch_frac']} r2_vs_r3_maxdiff {diff}", flush=True)
    assert m["moe/routing_mismatch_frac"] == 0, m
    assert diff == 0.0, diff


def main():
    from tripod.parallel.arch import arch_from_hf

    for hf_dir in sys.argv[1:]:
        arch = arch_from_hf(hf_dir)
        model = arch.family
        prompts, out = rollout(hf_dir, arch, torch.bfloat16)
        batch, rec_bytes, batch_bytes = make_batch(prompts, out, arch)
        if dist.get_rank() == 0:
            print(f"RR {model} bytes record={rec_bytes} batch={batch_bytes} dtype={batch['routed_experts'].dtype} "
                  f"shape={tuple(batch['routed_experts'].shape)}", flush=True)
        check_layout("EP2", hf_dir, arch, batch, dict(tp=1, pp=1, ep=2, dp=2, ranks=[0, 1]), model)
        check_layout("PP2", hf_dir, arch, batch, dict(tp=1, pp=2, dp=1, ranks=[0, 1]), model)
        check_layout("TP2SP", hf_dir, arch, batch, dict(tp=2, pp=1, dp=1, ranks=[0, 1]), model,
                     sequence_parallel=True)
        check_layout("DP2nopad", hf_dir, arch, batch, dict(tp=1, pp=1, dp=2, ranks=[0, 1]), model, remove_padding=True)
        check_r2_equals_r3(hf_dir, arch, model)
    dist.barrier()
    if dist.get_rank() == 0:
        print("RR-OK", flush=True)


if __name__ == "__main__":
    dist_worker(main)
