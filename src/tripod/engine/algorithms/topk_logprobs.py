"""Top-k log-probs from hidden states and the (vocab-parallel) LM head, never holding [tokens, vocab] logits.

Two ops, both chunked over tokens and over this rank's vocab slice, with the slices merged over the tensor-parallel
group as `kernels/logprobs.py` merges its statistics (running max and sum of exp for log Z):

* `topk_from_hidden`: the teacher's side, forward only: the k most likely tokens per position (ids in the global
  vocabulary) and their log-probs. Each rank keeps a running top-k of its slice; the ranks' candidates are
  all-gathered ([tokens, k * TP]) and the top k of them kept.
* `logprobs_at_ids`: the student's side, differentiable: log p at given ids [tokens, k] (the teacher's top-k).
  Backward recomputes each chunk's logits: d(sum_j g_j log p_j)/dz_v = sum_j g_j [v = id_j] - (sum_j g_j) p_v.

`weight` is this rank's [V_local, H] rows of the padded vocab (megatron's ColumnParallelLinear output layer), the
padding columns past `vocab_size` are cut off. The gradient of `hidden` is all-reduced over `tp_group` in backward
(as `copy_to_tensor_model_parallel_region`) unless `reduce_hidden_grad=False` (the caller's graph already reduces it:
sequence parallel).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_TOKENS = 512
CHUNK_VOCAB = 4096


def _rank_world(tp_group) -> tuple[int, int]:
    if tp_group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _slice(weight: torch.Tensor, vocab_size: int | None, tp_group) -> tuple[int, int]:
    """(first global id of this rank's rows, how many of them are real vocabulary)."""
    rank, _ = _rank_world(tp_group)
    start = rank * weight.shape[0]
    valid = weight.shape[0] if vocab_size is None else max(0, min(weight.shape[0], vocab_size - start))
    return start, valid


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _log_z(m: torch.Tensor, s: torch.Tensor, tp_group, world: int) -> torch.Tensor:
    """log sum exp over the whole vocabulary from each rank's (max, sum exp(z - max))."""
    if world > 1:
        top = m.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
        s = s * torch.exp(m - top)
        dist.all_reduce(s, group=tp_group)
        m = top
    return m + torch.log(s)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, v0: int, v1: int, inv_temp: float) -> torch.Tensor:
    return (h @ weight[v0:v1].to(h.dtype).t()) * inv_temp


def _merge(m: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cm = z.amax(dim=1)
    new = torch.maximum(m, cm)
    s = s * torch.exp(m - new) + torch.exp(z - new[:, None]).sum(dim=1)
    return new, s


@torch.no_grad()
def topk_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, k: int, *, temperature: float = 1.0,
                     tp_group=None, vocab_size: int | None = None, chunk_tokens: int = CHUNK_TOKENS,
                     chunk_vocab: int = CHUNK_VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [T, k], global ids [T, k]) of the k most likely tokens of softmax(hidden W^T / temperature) per
    row of `hidden` [T, H], most likely first (see the module docstring)."""
    rank, world = _rank_world(tp_group)
    start, valid = _slice(weight, vocab_size, tp_group)
    total = valid if world == 1 else (vocab_size or weight.shape[0] * world)
    if not 1 <= k <= total:
        raise ValueError(f"top-k with k={k} needs 1 <= k <= the vocabulary size {total}")
    dt, inv = _work_dtype(hidden.dtype), 1.0 / temperature
    n = hidden.shape[0]
    lz_parts, vals_parts, ids_parts = [], [], []
    for t0 in range(0, n, chunk_tokens):
        h = hidden[t0:t0 + chunk_tokens].to(dt)
        m = torch.full((h.shape[0],), -torch.inf, dtype=dt, device=h.device)
        s = torch.zeros_like(m)
        best = torch.full((h.shape[0], k), -torch.inf, dtype=dt, device=h.device)
        best_ids = torch.zeros((h.shape[0], k), dtype=torch.long, device=h.device)
        for v0 in range(0, valid, chunk_vocab):
            v1 = min(valid, v0 + chunk_vocab)
            z = _chunk_logits(h, weight, v0, v1, inv)
            m, s = _merge(m, s, z)
            cz, ci = z.topk(min(k, v1 - v0), dim=1)
            both, pos = torch.cat([best, cz], 1).topk(k, dim=1)
            best, best_ids = both, torch.cat([best_ids, ci + start + v0], 1).gather(1, pos)
        lz_parts.append((m, s))
        vals_parts.append(best)
        ids_parts.append(best_ids)
    if n == 0:
        empty = hidden.new_zeros((0, k), dtype=dt)
        return empty, empty.long()
    m, s = (torch.cat(x) for x in zip(*lz_parts))
    vals, ids = torch.cat(vals_parts), torch.cat(ids_parts)
    log_z = _log_z(m, s, tp_group, world)
    if world > 1:  # every rank's candidates, then the top k of them
        all_vals = [torch.empty_like(vals) for _ in range(world)]
        all_ids = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(all_vals, vals.contiguous(), group=tp_group)
        dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
        vals, pos = torch.cat(all_vals, 1).topk(k, dim=1)
        ids = torch.cat(all_ids, 1).gather(1, pos)
    return vals - log_z[:, None], ids


class _LogprobsAtIds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, inv_temp, tp_group, vocab_size, reduce_hidden_grad, chunk_tokens,
                chunk_vocab):
        rank, world = _rank_world(tp_group)
        start, valid = _slice(weight, vocab_size, tp_group)
        dt = _work_dtype(hidden.dtype)
        n = hidden.shape[0]
        m = torch.full((n,), -torch.inf, dtype=dt, device=hidden.device)
        s = torch.zeros_like(m)
        picked = torch.zeros(ids.shape, dtype=dt, device=hidden.device)
        for t0 in range(0, n, chunk_tokens):
            t1 = min(n, t0 + chunk_tokens)
            h = hidden[t0:t1].to(dt)
            for v0 in range(0, valid, chunk_vocab):
                v1 = min(valid, v0 + chunk_vocab)
                z = _chunk_logits(h, weight, v0, v1, inv_temp)
                m[t0:t1], s[t0:t1] = _merge(m[t0:t1], s[t0:t1], z)
                local = ids[t0:t1] - (start + v0)
                owns = (local >= 0) & (local < v1 - v0)
                picked[t0:t1] += torch.where(owns, z.gather(1, local.clamp(0, v1 - v0 - 1)), 0.0)
        log_z = _log_z(m, s, tp_group, world)
        if world > 1:  # each id's logit lives on the one rank that owns it
            dist.all_reduce(picked, group=tp_group)
        ctx.save_for_backward(hidden, weight, ids, log_z)
        ctx.args = (inv_temp, tp_group, vocab_size, reduce_hidden_grad, chunk_tokens, chunk_vocab, world, start,
                    valid)
        return (picked - log_z[:, None]).to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, ids, log_z = ctx.saved_tensors
        inv_temp, tp_group, _, reduce_hidden_grad, chunk_tokens, chunk_vocab, world, start, valid = ctx.args
        dt = log_z.dtype
        grad = grad.to(dt)
        total = grad.sum(dim=1)
        grad_h = torch.zeros(hidden.shape, dtype=dt, device=hidden.device)
        grad_w = torch.zeros(weight.shape, dtype=dt, device=weight.device)
        n = hidden.shape[0]
        for t0 in range(0, n, chunk_tokens):
            t1 = min(n, t0 + chunk_tokens)
            h = hidden[t0:t1].to(dt)
            for v0 in range(0, valid, chunk_vocab):
                v1 = min(valid, v0 + chunk_vocab)
                z = _chunk_logits(h, weight, v0, v1, inv_temp)
                dz = torch.exp(z - log_z[t0:t1, None]).mul_(-total[t0:t1, None])
                local = ids[t0:t1] - (start + v0)
                owns = (local >= 0) & (local < v1 - v0)
                dz.scatter_add_(1, local.clamp(0, v1 - v0 - 1), torch.where(owns, grad[t0:t1], 0.0))
                dz.mul_(inv_temp)
                grad_h[t0:t1] += dz @ weight[v0:v1].to(dt)
                grad_w[v0:v1] += dz.t() @ h
        if world > 1 and reduce_hidden_grad:
            dist.all_reduce(grad_h, group=tp_group)
        return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), None, None, None, None, None, None, None


def logprobs_at_ids(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0,
                    tp_group=None, vocab_size: int | None = None, reduce_hidden_grad: bool = True,
                    chunk_tokens: int = CHUNK_TOKENS, chunk_vocab: int = CHUNK_VOCAB) -> torch.Tensor:
    """log softmax(hidden W^T / temperature) at `ids` [T, k] (global vocabulary ids), differentiable w.r.t. `hidden`
    [T, H] and `weight` (see the module docstring)."""
    if ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"ids has shape {tuple(ids.shape)}; expected [tokens={hidden.shape[0]}, k]")
    return _LogprobsAtIds.apply(hidden, weight, ids.long(), 1.0 / temperature, tp_group, vocab_size,
                                reduce_hidden_grad, chunk_tokens, chunk_vocab)
