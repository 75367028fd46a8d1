"""torchrun worker for tests/multiprocess/test_row_shards.py: every rank builds the same random batch, keeps a random
share of its rows (the others NaN, as `MegatronWorker.rows_in_place` leaves them), and checks that the statistics
engine/workers/row_shards.py reduces over the ranks equal those of the whole batch on one rank: GAE's whitened
advantages, the KL-in-reward mean, rollout correction's mismatch metrics and `batch_metrics`. Prints ROW_SHARDS_OK."""
import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker
from tripod.engine.algorithms import apply_kl_penalty, compute_advantage
from tripod.engine.algorithms.rollout_correction import mismatch_metrics
from tripod.engine.workers.batch import PPOBatch, batch_metrics, build_ppo_batch
from tripod.engine.workers.row_shards import RowShards


def _batch(n: int, resp: int, g: torch.Generator) -> PPOBatch:
    prompts = [torch.randint(3, 90, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    responses = [torch.randint(3, 90, (int(torch.randint(1, resp + 1, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    batch = build_ppo_batch(prompts, responses, resp, 0, [i // 2 for i in range(n)])
    for key in ("old_log_probs", "ref_log_probs", "rollout_log_probs"):
        batch[key] = -torch.rand(n, resp, generator=g) * 3
    batch["values"] = torch.randn(n, resp, generator=g)
    return batch


def _sharded(batch: PPOBatch, owned: torch.Tensor) -> PPOBatch:
    out = PPOBatch(dict(batch.tensors), batch.meta)
    for key in ("old_log_probs", "ref_log_probs", "values"):
        out[key] = torch.where(owned[:, None], batch[key], float("nan"))
    return out


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
    metrics.update(batch_metrics(batch, scores, shards))
    return {"kl": float(kl), "adv": adv, "ret": ret, **metrics}


def main() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    n, resp = 23, 9
    batch = _batch(n, resp, g)
    scores = torch.randn(n, generator=g).tolist()
    owner = torch.randint(0, world, (n,), generator=g)
    owner[:world] = torch.arange(world)  # every rank holds a row
    rows = (owner == rank).nonzero().squeeze(-1).tolist()
    shards = RowShards(rows, n, dist.group.WORLD, world, torch.device("cpu"))
    want = _step(PPOBatch(dict(batch.tensors), batch.meta), scores, None)
    got = _step(_sharded(batch, shards.owned), scores, shards)
    assert want.keys() == got.keys(), (sorted(want), sorted(got))
    for key, w in want.items():
        v = got[key]
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(v[rows], w[rows], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
            assert torch.isnan(v[shards.owned.logical_not()]).any() or len(rows) == n, key  # not read elsewhere
        else:
            assert abs(v - w) <= 1e-5 * max(1.0, abs(w)), (key, v, w)
    print(f"ROW_SHARDS_OK rank={rank} rows={len(rows)} metrics={len(want)}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
