"""torchrun worker (2 ranks): the policy head at the real response tokens only == the head over the whole [N, R] grid.

argv: hf_dir. `MegatronWorker.token_logprobs` runs the LM head (kernels.logprobs_from_hidden) only where
response_mask is set and scatters the results into zeros. Here, on a real PolicyWorker of each layout (DP2: one
rank's own head; CP2: each rank holds half of every sequence; TP2: the vocab-parallel head), for rows whose responses
have different lengths (one row's mask zeroed, as rollout correction's rejection does), unpacked, packed behind
shared prompts and packed without padding, it is compared with `full_grid` below: the head as it ran before, over
every response position, padding included. Random hidden states [rows, seq / cp, H] (the same full sequence on every
rank, each CP rank taking its slots) stand for the model output; the head weight is made trainable.

Checked, at the real tokens: log-probs and entropy, and the gradients w.r.t. the hidden states and the head weight of
a masked loss (random per-token coefficients); at padding: log-prob and entropy exactly 0; and that the head ran on
exactly the real tokens (summed over the CP ranks). Prints `HEAD <layout> <layout kind> <quantity> <max diff>` lines
and `HEAD <layout> <kind> tokens <ran> of <N*R>`.
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.bounds import worst
from tests.helpers.common import dist_worker

TOL = 1e-5  # fp32: log-probs ~ log(vocab) ~ 5; the two runs differ only in how many rows each matmul sees


def make_batch(arch, g):
    """8 rows [A, A, B, A | C, C, D, D] (prompts of random lengths), responses of 1..7 tokens in 7 columns (one
    full, one of 1 token), row 2's mask zeroed: shared prompts pack, rows of every length leave padding."""
    from tripod.engine.workers.batch import build_ppo_batch

    prompts = [torch.randint(3, arch.vocab_size, (int(torch.randint(3, 9, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(4)]
    index, resp_len = [0, 0, 1, 0, 2, 2, 3, 3], 7
    lens = [7, 3, 5, 1, 6, 2, 4, 7]
    responses = [torch.randint(3, arch.vocab_size, (k,), generator=g).tolist() for k in lens]
    batch = build_ppo_batch([prompts[i] for i in index], responses, resp_len, 0, index)
    batch["response_mask"][2] = 0.0  # a rejected row: tokens laid out, none counted
    return batch


def head_weight(worker) -> torch.Tensor:
    m = worker.module
    return m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight


def full_grid(worker, output, mb, temperature):
    """(log-probs, entropy) [N, R] the pre-change way: every response position, padding included, through the head;
    with CP each rank the positions it holds, zero-filled and summed over the CP group."""
    from tripod.kernels.logprobs import logprobs_from_hidden
    from tripod.parallel.context_parallel import held_positions, sum_over_cp

    lay = worker.layout
    seq = (mb.packed.input_ids if mb.packed is not None else mb["input_ids"]).shape[1]
    flat = output.reshape(-1, output.shape[-1])
    if mb.packed is not None:
        index = mb.packed.gather
    else:
        index = torch.arange(mb.size)[:, None] * seq + mb.response_positions()
    labels = mb["responses"]
    if lay.cp > 1:
        held, local = held_positions(index, seq, lay.cp, lay.cp_rank)
        index, labels = local[held], labels[held]
    logp, ent = logprobs_from_hidden(flat[index], head_weight(worker), labels, temperature=temperature,
                                     tp_group=lay.tp_group if lay.tp > 1 else None, with_entropy=True,
                                     vocab_size=worker.arch.vocab_size)
    if lay.cp > 1:
        logp = sum_over_cp(logp.new_zeros(held.shape).index_put((held,), logp), lay.cp_group)
        ent = sum_over_cp(ent.new_zeros(held.shape).index_put((held,), ent), lay.cp_group)
    return logp, ent


def laid_out(worker, batch, kind):
    """The micro-batch as `MegatronWorker.run` hands it to the head: packed (or not), its sequence padded for CP."""
    from tripod.engine.workers.batch import PPOBatch
    from tripod.engine.workers.packing import pack_shared_prompts, pack_without_padding
    from tripod.parallel.context_parallel import padded_length

    mb = PPOBatch(dict(batch.tensors), batch.meta)
    packed = {"plain": None, "shared": pack_shared_prompts(mb),
              "rmpad": pack_without_padding(mb, share_prompts=False)}[kind]
    assert (packed is None) == (kind == "plain"), kind
    seq = packed.seq if packed is not None else mb["input_ids"].shape[1]
    seq = padded_length(seq, worker.layout.cp) if worker.layout.cp > 1 else seq
    if packed is not None:
        mb.packed = packed.padded_to(seq)
    else:
        for key in ("input_ids", "attention_mask"):
            mb.tensors[key] = torch.nn.functional.pad(mb[key], (0, seq - mb[key].shape[1]))
    return mb, (mb.packed.input_ids.shape[0] if mb.packed is not None else mb.size), seq


def run_head(fn, worker, mb, hidden, weight, coef, mask):
    """(log-probs, entropy, d loss / d hidden, d loss / d weight) of fn's head, loss = sum(mask * (a logp + b H))."""
    output = hidden.detach().clone().requires_grad_()
    logp, ent = fn(output, mb)
    loss = (mask * (coef[0] * logp + coef[1] * ent)).sum()
    g_out, g_w = torch.autograd.grad(loss, [output, weight])
    return dict(logp=logp.detach(), entropy=ent.detach(), grad_hidden=g_out, grad_weight=g_w)


def check_layout(hf_dir, arch, layout, name, batch):
    import tripod.kernels as kernels
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.context_parallel import local_slots

    worker = PolicyWorker("actor", arch, layout, hf_dir, trainable=False)
    weight = head_weight(worker)
    weight.requires_grad_(True)
    mask = batch["response_mask"]
    real = mask > 0
    temperature = 0.8
    g = torch.Generator().manual_seed(5)
    coef = torch.randn(2, *mask.shape, generator=g)
    kinds = ["plain", "shared", "rmpad"]
    ran = []
    real_head = kernels.logprobs_from_hidden

    def counting_head(hidden, *args, **kwargs):  # the real op; records how many positions it was given
        ran.append(hidden.shape[0])
        return real_head(hidden, *args, **kwargs)

    for kind in kinds:
        mb, rows, seq = laid_out(worker, batch, kind)
        hidden = torch.randn(rows, seq, arch.hidden_size, generator=g)  # the same on every rank (same seed)
        if layout.cp > 1:
            hidden = hidden[:, local_slots(seq, layout.cp, layout.cp_rank)]
        ran.clear()
        setattr(kernels, "logprobs_from_hidden", counting_head)  # the lazy package: patched by name
        try:
            new = run_head(lambda out, m: worker.token_logprobs(out, m, temperature, True), worker, mb, hidden,
                           weight, coef, mask)
        finally:
            setattr(kernels, "logprobs_from_hidden", real_head)
        old = run_head(lambda out, m: full_grid(worker, out, m, temperature), worker, mb, hidden, weight, coef, mask)
        errors = []
        for key in ("logp", "entropy"):
            err = (new[key] - old[key])[real].abs().max().item()
            pad = new[key][~real].abs().max().item()
            print(f"HEAD {name} {kind} {key} {err:.3e} padding {pad:.1e}", flush=True)
            assert pad == 0.0, f"{name} {kind}: {key} at padding is {pad}, not 0"
            errors.append(err)
        for key in ("grad_hidden", "grad_weight"):
            err = (new[key] - old[key]).abs().max().item() / max(1.0, old[key].abs().max().item())
            print(f"HEAD {name} {kind} {key} {err:.3e}", flush=True)
            errors.append(err)
        assert worst(errors) < TOL, f"{name} {kind}: real-token head vs full grid differ by {worst(errors):.3e} > {TOL}"
        tokens = torch.tensor(sum(ran))
        if layout.cp > 1:
            dist.all_reduce(tokens, group=layout.cp_group)
        print(f"HEAD {name} {kind} tokens {int(tokens)} of {mask.numel()}", flush=True)
        assert int(tokens) == int(real.sum()), f"{name} {kind}: the head ran on {int(tokens)} positions, " \
            f"the batch has {int(real.sum())} real tokens"


def main():
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout

    hf_dir = sys.argv[1]
    arch = arch_from_hf(hf_dir)
    batch = make_batch(arch, torch.Generator().manual_seed(7))
    for name, kw in (("DP2", dict(dp=2)), ("CP2", dict(cp=2)), ("TP2", dict(tp=2))):
        layout = ParallelLayout(name=name, arch=arch, ranks=[0, 1], **kw)
        check_layout(hf_dir, arch, layout, name, batch)
    dist.barrier()


if __name__ == "__main__":
    dist_worker(main)
