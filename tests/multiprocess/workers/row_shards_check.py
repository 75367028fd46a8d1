"""torchrun worker for tests/multiprocess/test_row_shards.py. Every rank generates "its replica's" share of a random
rollout, names a random share of the rows as the ones it needs, and

1. exchanges the rollout (engine/rollout/exchange.py `exchange_rollout(needs=...)`): it must receive exactly the rows
   it named (plus its own replica's), equal to the whole rollout's, every other row None;
2. builds its batch of those rows only (engine/workers/row_shards.py `step_batch`): exactly its rows, laid out as the
   whole batch lays them out;
3. reduces the statistics the step reads over the whole batch (GAE's whitened advantages, the KL-in-reward mean,
   rollout correction's mismatch metrics, `batch_metrics`, GRPO's / RLOO's group advantages, reinforce_plus_plus's
   and reinforce_plus_plus_baseline's whitened ones) over the ranks, and they must equal those of the whole batch on
   one rank;
4. runs rollout correction (IS weights, rejection) on its rows and on the whole batch: the same weights, mask,
   metrics, every row's counted tokens after the rejection, and advantages.
Prints ROW_SHARDS_OK."""
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker
from tripod.engine.algorithms import apply_kl_penalty, compute_advantage
from tripod.engine.algorithms.rollout_correction import correct_batch, mismatch_metrics
from tripod.engine.rollout.exchange import exchange_rollout
from tripod.engine.workers.batch import PPOBatch, RowLengths, batch_metrics
from tripod.engine.workers.row_shards import RowShards, step_advantages, step_batch

N_SAMPLES = 2


def _rollout(prompts: int, resp: int, g: torch.Generator):
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    input_ids = [torch.randint(3, 90, (rand(2, 6),), generator=g).tolist() for _ in range(prompts)]
    rows = prompts * N_SAMPLES
    responses = [torch.randint(3, 90, (rand(0, resp + 1),), generator=g).tolist() for _ in range(rows)]
    log_probs = [-torch.rand(len(r), generator=g) * 3 for r in responses]
    finish = ["stop" if rand(0, 2) else "length" for _ in range(rows)]
    return input_ids, list(range(100, 100 + prompts)), responses, log_probs, finish


def _with_outputs(batch: PPOBatch, outputs: dict[str, torch.Tensor], rows: list[int]) -> PPOBatch:
    for key, value in outputs.items():  # the model outputs of these rows (computed where the rows are)
        batch[key] = value[rows]
    return batch


def _step(batch: PPOBatch, scores: list[float], shards: RowShards | None) -> dict:
    mask = batch["response_mask"]
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(batch.size), (mask.sum(-1).long() - 1).clamp(min=0)] = torch.tensor(scores)
    kw = {} if shards is None else {"mean": shards.masked_mean}
    rewards, kl = apply_kl_penalty(rewards, batch["old_log_probs"], batch["ref_log_probs"], mask, 0.1, "k3", **kw)
    kw = {} if shards is None else {"whiten": shards.masked_whiten}
    adv, ret = compute_advantage("gae", rewards, mask, values=batch["values"], index=batch["index"], gamma=0.99,
                                 lam=0.95, **kw)
    batch["advantages"], batch["returns"] = adv, ret
    kw = {} if shards is None else {"mean": shards.masked_mean, "max_of": shards.masked_max}
    metrics = mismatch_metrics(batch["old_log_probs"], batch["rollout_log_probs"], mask.float(), **kw)
    return {"kl": float(kl), "adv": adv, "ret": ret, **metrics}


def main() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    prompts, resp = 12, 9
    input_ids, indices, responses, log_probs, finish = _rollout(prompts, resp, g)
    n = len(responses)
    scores = torch.randn(n, generator=g).tolist()
    outputs = {key: -torch.rand(n, resp, generator=g) * 3 for key in ("old_log_probs", "ref_log_probs")}
    outputs["values"] = torch.randn(n, resp, generator=g)
    owner = torch.randint(0, world, (n,), generator=g)
    owner[:world] = torch.arange(world)  # every rank holds a row
    rows = (owner == rank).nonzero().squeeze(-1).tolist()

    # 1. the exchange: replica r (= rank r) generated a contiguous share of the rows
    bounds = [n * r // world for r in range(world + 1)]
    mine = slice(bounds[rank], bounds[rank + 1])
    seen: list = []
    got = exchange_rollout([[r] for r in range(world)], rank, responses[mine], log_probs[mine], finish[mine],
                           needs=lambda lengths: seen.append(lengths) or rows)
    assert seen == [[len(r) for r in responses]], "needs() is called once, with every row's response length"
    assert got[3] == seen[0] and got[4] == rows
    own = set(range(bounds[rank], bounds[rank + 1]))
    for gid in range(n):
        held = gid in own or gid in rows
        assert (got[0][gid] is not None) == held, (gid, held)
        if held:
            assert got[0][gid] == responses[gid] and got[2][gid] == finish[gid]
            assert torch.equal(got[1][gid], log_probs[gid])

    # 2. this rank's batch: exactly its rows, as wide as the whole batch
    lengths = RowLengths.of_rollout([len(input_ids[i // N_SAMPLES]) for i in range(n)], got[3],
                                    [indices[i // N_SAMPLES] for i in range(n)])
    shards = RowShards(rows, lengths, dist.group.WORLD, world)
    whole, _ = step_batch(input_ids, indices, N_SAMPLES, responses, log_probs, finish, scores, resp, 0, None)
    part, part_scores = step_batch(input_ids, indices, N_SAMPLES, got[0], got[1], got[2], scores, resp, 0, shards)
    assert part.size == len(rows) and part.shard.rows == rows and part_scores == [scores[i] for i in rows]
    assert part.meta["finish_reasons"] == [finish[i] for i in rows]
    for key, value in whole.tensors.items():
        assert torch.equal(part[key], value[rows]), key
    assert torch.equal(RowLengths.of(whole).seq_lens, lengths.seq_lens)

    # 3. the statistics over the ranks' rows equal the whole batch's
    want = _step(_with_outputs(whole, outputs, list(range(n))), scores, None)
    have = _step(_with_outputs(part, outputs, rows), part_scores, shards)
    want.update(batch_metrics(whole, scores))
    have.update(batch_metrics(part, scores, shards))
    mask = whole["response_mask"]
    for name, opts in (("grpo", {"norm_by_std": True}), ("rloo", {})):
        rewards = torch.zeros_like(mask)
        rewards[torch.arange(n), (mask.sum(-1).long() - 1).clamp(min=0)] = torch.tensor(scores)
        want[name] = compute_advantage(name, rewards, mask, index=whole["index"], **opts)[0]
        have[name] = shards.outcome_advantages(name, scores, part["response_mask"], **opts)[0]
    part_mask = part["response_mask"]
    part_rewards = torch.zeros_like(part_mask)
    part_rewards[torch.arange(part.size), (part_mask.sum(-1).long() - 1).clamp(min=0)] = torch.tensor(part_scores)
    whole_rewards = torch.zeros_like(mask)
    whole_rewards[torch.arange(n), (mask.sum(-1).long() - 1).clamp(min=0)] = torch.tensor(scores)
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):  # the trainer's own dispatch, both ways
        algo = SimpleNamespace(adv_estimator=name, norm_adv_by_std_in_grpo=True, gamma=0.99, lam=0.95)
        want[name] = step_advantages(algo, whole_rewards, mask, whole, scores, None)[0]
        have[name] = step_advantages(algo, part_rewards, part_mask, part, scores, shards)[0]
    assert want.keys() == have.keys(), (sorted(want), sorted(have))
    # The bound 1e-5: the whole batch's statistics are fp32 sums of <= 24 x 9 = 216 terms of magnitude <= 3, the
    # sharded ones float64 sums of the ranks' fp32 partial sums. torch's CPU sum is a cascade (pairwise, blocked by
    # vector lanes: aten SumKernel.cpp), whose error is O(log2 N) u of the summed magnitudes, ~1e-6 here on any CPU's
    # vector width; whitening divides by a std ~1 and the mean / variance each add one such error. A reduction that
    # is missing or over-counted moves these values by O(0.1-1) (the planted bugs).
    for key, w in want.items():
        v = have[key]
        if isinstance(w, torch.Tensor):
            exact = key in ("grpo", "rloo")  # a per-row function of the scores: the same numbers
            torch.testing.assert_close(v, w[rows], rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5,
                                       msg=lambda m: f"{key}: {m}")
        else:
            assert abs(v - w) <= 1e-5 * max(1.0, abs(w)), (key, v, w)
    corrected = _rollout_correction_both_ways(input_ids, indices, responses, log_probs, finish, scores, outputs,
                                              lengths, rows, g)
    print(f"ROW_SHARDS_OK rank={rank} rows={len(rows)} of {n} metrics={len(want)} corrected={corrected}", flush=True)


def _rollout_correction_both_ways(input_ids, indices, responses, log_probs, finish, scores, outputs, lengths, rows,
                                  g: torch.Generator) -> int:
    """4. rollout correction (IS weights + rejection) on this rank's rows with the statistics reduced, against the
    whole batch on one rank: the same weights, mask, rollout_corr/* metrics, every row's counted tokens (the update's
    loss normalisers read them) and the advantages after the rejection. Odd rows' old log-probs sit 0.1 above the
    rollout's (truncated and rejected), even rows' within 1e-3 (kept). Returns how many configurations ran."""
    n, resp = len(responses), outputs["values"].shape[1]
    noise = torch.randn(n, resp, generator=g) * 1e-3 + 0.1 * (torch.arange(n) % 2)[:, None]
    configs = (SimpleNamespace(rollout_is="token", rollout_is_threshold=1.02, rollout_rs="seq_mean_k1",
                               rollout_rs_threshold=math.exp(0.02)),
               SimpleNamespace(rollout_is="sequence", rollout_is_threshold=1.05, rollout_rs="seq_mean_k3",
                               rollout_rs_threshold=1e-3),
               SimpleNamespace(rollout_is="token", rollout_is_threshold=1.05, rollout_rs=None, rollout_rs_threshold=None))
    for cfg in configs:
        shards = RowShards(rows, lengths, dist.group.WORLD, dist.get_world_size())
        whole, _ = step_batch(input_ids, indices, N_SAMPLES, responses, log_probs, finish, scores, resp, 0, None)
        part, _ = step_batch(input_ids, indices, N_SAMPLES, responses, log_probs, finish, scores, resp, 0, shards)
        out = {}
        for batch, ids, sh in ((whole, list(range(n)), None), (part, rows, shards)):
            batch["values"] = outputs["values"][ids]
            batch["old_log_probs"] = batch["rollout_log_probs"] + noise[ids] * batch["response_mask"]
            rewards = torch.zeros_like(batch["response_mask"])
            rewards[torch.arange(batch.size), (batch["response_mask"].sum(-1).long() - 1).clamp(min=0)] = \
                torch.tensor([scores[i] for i in ids])
            scored = batch["response_mask"].clone()  # a rejected row keeps its score in its group (verl's)
            metrics, _ = correct_batch(batch, cfg, sh)
            mask = batch["response_mask"]
            adv = {"gae": compute_advantage("gae", rewards, mask, values=batch["values"], gamma=0.99, lam=0.95,
                                            **({} if sh is None else {"whiten": sh.masked_whiten}))[0]}
            for name in ("grpo", "rloo"):
                adv[name] = compute_advantage(name, rewards, mask, index=batch["index"], score_mask=scored)[0] \
                    if sh is None else \
                    sh.outcome_advantages(name, scores, mask)[0]
            out["part" if sh else "whole"] = (batch, metrics, adv)
        (w, w_metrics, w_adv), (p, p_metrics, p_adv) = out["whole"], out["part"]
        if cfg.rollout_rs is not None:
            assert 0 < w_metrics["rollout_corr/rollout_rs_seq_masked_fraction"] < 1, w_metrics
            # the counted tokens every rank holds (the loss normalisers') are the whole batch's after the rejection
            assert torch.equal(p.shard.lengths.response_lens, RowLengths.of(w).response_lens), cfg
            assert torch.equal(shards.lengths.response_lens, p.shard.lengths.response_lens)
        assert 0 < w_metrics["rollout_corr/rollout_is_ratio_fraction_high"] < 1, w_metrics
        assert w_metrics.keys() == p_metrics.keys(), (sorted(w_metrics), sorted(p_metrics))
        for key, value in w_metrics.items():
            assert abs(p_metrics[key] - value) <= 1e-5 * max(1.0, abs(value)), (cfg, key, p_metrics[key], value)
        assert torch.equal(p["response_mask"], w["response_mask"][rows]), cfg
        torch.testing.assert_close(p["rollout_is_weights"], w["rollout_is_weights"][rows], rtol=1e-6, atol=0)
        for name, value in w_adv.items():
            exact = name != "gae"  # a per-row function of the scores and counted tokens: the same numbers
            torch.testing.assert_close(p_adv[name], value[rows], rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5,
                                       msg=lambda m: f"{cfg} {name}: {m}")
    return len(configs)


if __name__ == "__main__":
    dist_worker(main)
