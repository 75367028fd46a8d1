"""The loss of one global batch, and its gradient, do not depend on how the batch is split into
micro-batches and data-parallel ranks, for every aggregation mode.

A tiny policy/value "model" (two weight matrices over fixed random features) produces log-probs,
entropy and values; the full actor+critic objective (policy + value + KL + entropy terms) is
computed once on the whole batch (local normaliser) and again split 1/2/4 ways into micro-batches
in-process, and across gloo DP ranks started with torch.multiprocessing (4 ranks x 1 micro-batch
and 2 ranks x 2 micro-batches, the latter as two DP groups inside the same 4-process launch).
Split runs pass global_norm = the sum of agg_norm over all micro-batches on all ranks, SUM the
micro-batch losses and gradients, and all_reduce(SUM) them over ranks.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.bounds import worst
from tripod.engine.algorithms import AGG_MODES, agg_norm, entropy_loss, kl_loss, policy_loss, value_loss

B, T, H, V = 8, 6, 5, 7
TOL = 1e-6


def make_problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(B, T, H, generator=gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) < 0.6
    mask[3] = False  # an all-masked row inside one micro-batch
    mask[5, 1:] = False  # a length-1 response
    data = {
        "features": features, "tokens": tokens, "mask": mask,
        "old_logp": -torch.rand(B, T, generator=gen) * 3,
        "ref_logp": -torch.rand(B, T, generator=gen) * 3,
        "advantages": torch.randn(B, T, generator=gen),
        "returns": torch.randn(B, T, generator=gen),
        "old_values": torch.randn(B, T, generator=gen) * 0.5,
    }
    params = {"policy": torch.randn(H, V, generator=gen), "value": torch.randn(H, generator=gen)}
    return data, params


def objective_terms(data, params, agg, global_norm):
    logits = data["features"] @ params["policy"]
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, data["tokens"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    values = data["features"] @ params["value"]
    mask = data["mask"]
    pg, _ = policy_loss(data["old_logp"], logp, data["advantages"], mask, agg=agg, global_norm=global_norm)
    vf, _ = value_loss(values, data["returns"], data["old_values"], mask, clip=0.3, agg=agg, global_norm=global_norm)
    kl = kl_loss(logp, data["ref_logp"], mask, kind="low_var_kl", agg=agg, global_norm=global_norm)
    ent = entropy_loss(entropy, mask, agg, global_norm=global_norm)
    return torch.stack([pg, vf, kl, ent])


def objective(terms):
    return terms[0] + 0.5 * terms[1] + 0.1 * terms[2] - 0.01 * terms[3]


def leaf_params(params):
    return {k: v.clone().requires_grad_() for k, v in params.items()}


def run_split(data, params, agg, rows, n_micro, norm_reduce=lambda x: x):
    """Loss terms and grads of the micro-batches of `rows`, normalised by the global normaliser."""
    leaves = leaf_params(params)
    micro_rows = rows.chunk(n_micro)
    global_norm = norm_reduce(sum(agg_norm(data["mask"][r], agg) for r in micro_rows))
    terms = torch.zeros(4)
    for r in micro_rows:
        micro_terms = objective_terms({k: v[r] for k, v in data.items()}, leaves, agg, global_norm)
        objective(micro_terms).backward()  # gradients accumulate (sum) over micro-batches
        terms += micro_terms.detach()
    return terms, {k: v.grad for k, v in leaves.items()}


def reference(data, params, agg):
    leaves = leaf_params(params)
    terms = objective_terms(data, leaves, agg, None)
    objective(terms).backward()
    return terms.detach(), {k: v.grad for k, v in leaves.items()}


def max_rel_error(terms, grads, ref_terms, ref_grads) -> float:
    pairs = [(terms, ref_terms)] + [(grads[k], ref_grads[k]) for k in ref_grads]
    return worst(((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in pairs)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batch_split_invariance(agg):
    data, params = make_problem()
    ref_terms, ref_grads = reference(data, params, agg)
    rows = torch.arange(B)
    for n_micro in (1, 2, 4):
        terms, grads = run_split(data, params, agg, rows, n_micro)
        assert max_rel_error(terms, grads, ref_terms, ref_grads) <= TOL, f"{agg} split {n_micro} ways"
    # Control: per-micro-batch (local) normalisation averaged over micro-batches is NOT invariant.
    naive = sum(objective_terms({k: v[r] for k, v in data.items()}, params, agg, None)
                for r in rows.chunk(4)) / 4
    assert (naive - ref_terms).abs().max() > 1e-3


def _dp_worker(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    pair_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    layouts = {"dp4_mb1": (dist.group.WORLD, rank, 4, 1), "dp2_mb2": (pair_groups[rank // 2], rank % 2, 2, 2)}
    data, params = make_problem()
    errors = {}
    for agg in AGG_MODES:
        ref_terms, ref_grads = reference(data, params, agg)
        for name, (group, dp_rank, dp_size, n_micro) in layouts.items():
            def all_reduce_sum(x, group=group):
                x = x.detach().contiguous().clone()
                dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
                return x
            rows = torch.arange(B).chunk(dp_size)[dp_rank]
            terms, grads = run_split(data, params, agg, rows, n_micro, norm_reduce=all_reduce_sum)
            terms = all_reduce_sum(terms)
            grads = {k: all_reduce_sum(g) for k, g in grads.items()}
            errors[f"{agg}/{name}"] = max_rel_error(terms, grads, ref_terms, ref_grads)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(errors, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.dist
def test_data_parallel_split_invariance(tmp_path):
    world_size = 4
    # fork: the ranks inherit the imported torch (spawn re-imports it per rank, ~10x slower on a busy CPU)
    start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(_dp_worker, args=(world_size, str(tmp_path / "store"), str(tmp_path)), nprocs=world_size,
                       join=True, start_method=start_method)
    for rank in range(world_size):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(errors) == sorted(f"{a}/{l}" for a in AGG_MODES for l in ("dp4_mb1", "dp2_mb2"))
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank}: loss/grad differ from the unsplit batch: {bad}"
