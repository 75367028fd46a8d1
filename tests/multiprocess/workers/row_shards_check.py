"""torchrun worker for tests/multiprocess/test_row_shards.py. Every rank generates "its replica's" share of a random
rollout, names a random share of the rows as the ones it needs, and

1. exchanges the rollout (engine/rollout/exchange.py `exchange_rollout(needs=...)`): it must receive exactly the rows
   it named (plus its own replica's), equal to the whole rollout's, every other row None;
2. builds its batch of those rows only (engine/workers/row_shards.py `step_batch`): exactly its rows, laid out as the
   whole batch lays them out;
3. reduces the statistics the step reads over the whole batch (GAE's whitened advantages, the KL-in-reward mean,
   rollout correction's mismatch metrics, `batch_metrics`, GRPO's / RLOO's group advantages) over the ranks, and they
   must equal those of the whole batch on one rank.
Prints ROW_SHARDS_OK."""
import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker
from tripod.engine.algorithms import apply_kl_penalty, compute_advantage
from tripod.engine.algorithms.rollout_correction import mismatch_metrics
from tripod.engine.rollout.exchange import exchange_rollout
from tripod.engine.workers.batch import PPOBatch, RowLengths, batch_metrics
from tripod.engine.workers.row_shards import RowShards, step_batch

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
    assert want.keys() == have.keys(), (sorted(want), sorted(have))
    for key, w in want.items():
        v = have[key]
        if isinstance(w, torch.Tensor):
            exact = key in ("grpo", "rloo")  # a per-row function of the scores: the same numbers
            torch.testing.assert_close(v, w[rows], rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5,
                                       msg=lambda m: f"{key}: {m}")
        else:
            assert abs(v - w) <= 1e-5 * max(1.0, abs(w)), (key, v, w)
    print(f"ROW_SHARDS_OK rank={rank} rows={len(rows)} of {n} metrics={len(want)}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
