"""Vocab-parallel logprobs_from_hidden on 2 gloo ranks == the single-rank op on the full vocab.

Launched by tests/multiprocess/test_logprobs.py as `torchrun --standalone --nproc-per-node 2` this file. Every
rank builds the same inputs from one seed, holds half of the (padded) LM-head rows, and checks
values, the hidden gradient (all-reduced by the op, Megatron's ColumnParallelLinear convention)
and its weight-gradient slice against the single-rank result, for the torch twin (fp32, fp64) and
the Triton kernels under TRITON_INTERPRET=1. Prints TP2-LOGPROBS-OK per rank.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch
import torch.distributed as dist

from tripod.kernels.logprobs import logprobs_from_hidden


def run(h, w, labels, g_logp, g_ent, group, **kw):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    logp, ent = logprobs_from_hidden(h, w, labels, tp_group=group, **kw)
    loss = (logp * g_logp.to(logp.dtype)).sum()
    if ent is not None:
        loss = loss + (ent * g_ent.to(ent.dtype)).sum()
    loss.backward()
    return logp.detach(), (None if ent is None else ent.detach()), h.grad, w.grad


def check_case(name, rank, world, *, dtype, lead, hidden, v_local, vocab_size, temperature,
               backend="torch", with_entropy=True, reduce_hidden_grad=True, tol=1e-5):
    gen = torch.Generator().manual_seed(1234)
    h = torch.randn(*lead, hidden, generator=gen).to(dtype) * 2.0
    w_full = (torch.randn(v_local * world, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    labels = torch.randint(0, vocab_size, lead, generator=gen)
    g_logp = torch.randn(lead, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(lead, generator=gen, dtype=torch.float64)
    common = dict(temperature=temperature, with_entropy=with_entropy, backend=backend,
                  chunk_tokens=7, chunk_vocab=19, vocab_size=vocab_size)

    ref = run(h, w_full, labels, g_logp, g_ent, None, **common)
    w_local = w_full[rank * v_local:(rank + 1) * v_local].contiguous()
    out = run(h, w_local, labels, g_logp, g_ent, dist.group.WORLD,
              reduce_hidden_grad=reduce_hidden_grad, **common)
    logp, ent, gh, gw = out
    if not reduce_hidden_grad:  # the caller's job then: sum the partial hidden grads over TP
        gh = gh.contiguous()
        dist.all_reduce(gh)
    pairs = [("logp", logp, ref[0]), ("grad_hidden", gh, ref[2]),
             ("grad_weight_slice", gw, ref[3][rank * v_local:(rank + 1) * v_local])]
    if with_entropy:
        pairs.append(("entropy", ent, ref[1]))
    else:
        assert ent is None
    for what, got, want in pairs:
        bound = tol * max(1.0, want.abs().max().item())
        err = (got.double() - want.double()).abs().max().item()
        assert err <= bound, f"rank {rank} {name} {what}: max error {err:.3g} > {bound:.3g}"


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    base = dict(lead=(3, 13), hidden=24, v_local=50)
    check_case("fp32", rank, world, dtype=torch.float32, vocab_size=100, temperature=0.8, **base)
    check_case("fp64-padded", rank, world, dtype=torch.float64, vocab_size=87, temperature=1.3,
               tol=1e-11, **base)
    # rank 1 holds only padding rows: its partial stats are empty and must merge cleanly.
    check_case("fp64-rank1-all-padding", rank, world, dtype=torch.float64, vocab_size=41,
               temperature=1.0, tol=1e-11, **base)
    check_case("fp32-logp-only-caller-reduces", rank, world, dtype=torch.float32, vocab_size=95,
               temperature=0.6, with_entropy=False, reduce_hidden_grad=False, **base)
    check_case("triton-interpreter", rank, world, dtype=torch.float32, vocab_size=93,
               temperature=0.9, backend="triton", lead=(2, 11), hidden=40, v_local=70)
    dist.barrier()
    print(f"TP2-LOGPROBS-OK rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
