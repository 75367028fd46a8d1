"""torchrun worker (4 ranks): actor TP2xPP2 and critic TP1xPP2xDP2 (value head) share one world.

argv: hf_dir. Checks bad layouts are refused before any group is made, rank arithmetic, that both
models' forwards match references computed independently with `transformers` (interleaved, so a
wrong group would mix them up), and one megatron train step of each: loss and grad norm equal the
plain-torch HF gradient of the same loss; the critic's DP replicas stay identical.
"""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common_layout_train import train_step, wrap_for_training

from tests.helpers.common import dist_worker


def expect_error(fn, *needles):
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        assert all(n in msg for n in needles), f"message {msg!r} lacks {needles}"
        print(f"REFUSED {msg}", flush=True)
        return
    raise AssertionError(f"expected ValueError mentioning {needles}")


def main() -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers.model_forward import forward_logits, gather_vocab_logits
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import load_hf_weights
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.model import build_gpt_model

    hf_dir = sys.argv[1]
    arch = arch_from_hf(hf_dir)
    rank = dist.get_rank()
    expect_error(lambda: ParallelLayout(tp=2, pp=1, dp=3, name="actor"), "world size 4", "tp*pp*dp", "launch 6")
    expect_error(lambda: ParallelLayout(tp=3, pp=1, name="actor"), "world size 4", "tensor_model_parallel_size")
    expect_error(lambda: ParallelLayout(tp=4, pp=1, name="actor", arch=arch),
                 "actor tensor_model_parallel_size=4 does not divide num_key_value_heads=2", "[1, 2]")

    actor = ParallelLayout(tp=2, pp=2, name="actor", arch=arch)
    critic = ParallelLayout(tp=1, pp=2, dp=2, name="critic", arch=arch)
    print(actor.describe(), "|", critic.describe(), flush=True)
    assert (actor.tp_rank, actor.dp_rank, actor.pp_rank) == (rank % 2, 0, rank // 2)
    assert (critic.tp_rank, critic.dp_rank, critic.pp_rank) == (0, rank % 2, rank // 2)
    assert actor.group_ranks("tp") == [rank - rank % 2, rank - rank % 2 + 1]
    assert critic.group_ranks("dp") == actor.group_ranks("tp") and critic.group_ranks("pp") == [rank % 2, rank % 2 + 2]
    assert actor.stage_layers(arch.num_layers) == critic.stage_layers(arch.num_layers) == \
        ([0, 1] if rank < 2 else [2, 3])
    assert actor.pg_collection.tp.size() == 2 and critic.pg_collection.tp.size() == 1
    assert critic.pg_collection.dp.size() == 2 and actor.pg_collection.dp.size() == 1

    actor_model = build_gpt_model(arch, actor)
    critic_model = build_gpt_model(arch, critic, value_head=True)
    assert not load_hf_weights(actor_model, hf_dir, arch, actor)
    assert load_hf_weights(critic_model, hf_dir, arch, critic) == (["output_layer.weight", "output_layer.bias"]
                                                                    if critic.is_last_stage else [])
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    # no pad id (0): HF's nn.Embedding(padding_idx=0) gives that row no gradient, megatron does
    ids = torch.randint(3, arch.vocab_size, (4, 24), generator=g)
    labels = torch.randint(0, arch.vocab_size, (4, 24), generator=g)
    targets = torch.randn(4, 24, generator=g)
    head = None
    if critic.is_last_stage:
        head = critic_model.output_layer
        assert head.weight.abs().sum() > 0

    def hf_values(x):
        hidden = hf.model(x).last_hidden_state
        return F.linear(hidden, head.weight.detach(), head.bias.detach()).squeeze(-1)

    # critic DP rank r forwards its own half of the batch
    half = slice(critic.dp_rank * 2, critic.dp_rank * 2 + 2)
    for _ in range(2):  # interleave the two models' collectives
        logits = forward_logits(actor_model, actor, ids)
        values = forward_logits(critic_model, critic, ids[half])
        with torch.no_grad():
            if actor.is_last_stage:
                diff = (logits - hf(ids).logits).abs().max().item()
                print(f"ACTOR_FWD maxdiff {diff:.3e}", flush=True)
                assert diff < 1e-5
            if critic.is_last_stage:
                assert values.shape == (2, 24)
                diff = (values - hf_values(ids[half])).abs().max().item()
                print(f"CRITIC_FWD maxdiff {diff:.3e}", flush=True)
                assert diff < 1e-5

    # reference gradients (plain torch on the HF model; actor: CE over the full batch)
    hf.zero_grad()
    ref_actor_loss = F.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten())
    ref_actor_loss.backward()
    ref_actor_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in hf.parameters() if p.grad is not None)).item()

    ddp, opt = wrap_for_training(actor_model, actor)
    loss, norm = train_step(ddp, opt, actor, dict(input_ids=ids, position_ids=torch.arange(24).expand(4, 24),
                                                   attention_mask=torch.ones(24, 24, dtype=torch.bool).triu(1)[None, None]),
                            lambda out: F.cross_entropy(gather_vocab_logits(out, actor, arch.vocab_size).flatten(0, 1),
                                                        labels.flatten()))
    print(f"ACTOR_STEP loss {loss} ref {ref_actor_loss.item()} grad_norm {norm:.6f} ref {ref_actor_norm:.6f}", flush=True)
    assert abs(norm - ref_actor_norm) < 1e-5 * ref_actor_norm
    if actor.is_last_stage:
        assert abs(loss - ref_actor_loss.item()) < 1e-5

    # critic: full-batch MSE = mean of the two DP halves' MSEs; head params join the reference
    if critic.is_last_stage:
        hf.zero_grad()
        w = head.weight.detach().clone().requires_grad_(True)
        bias = head.bias.detach().clone().requires_grad_(True)
        v = F.linear(hf.model(ids).last_hidden_state, w, bias).squeeze(-1)
        ref_critic_loss = F.mse_loss(v, targets)
        ref_critic_loss.backward()
        grads = [p.grad for p in hf.model.parameters() if p.grad is not None] + [w.grad, bias.grad]
        ref = torch.stack([torch.sqrt(sum((x ** 2).sum() for x in grads)), ref_critic_loss.detach()])
    else:
        ref = torch.zeros(2)
    ref_list = [torch.zeros(2) for _ in range(4)]
    dist.all_gather(ref_list, ref.contiguous())
    ref_critic_norm = ref_list[2][0].item()
    ddp_c, opt_c = wrap_for_training(critic_model, critic)
    loss, norm = train_step(ddp_c, opt_c, critic, dict(input_ids=ids[half], position_ids=torch.arange(24).expand(2, 24),
                                                        attention_mask=torch.ones(24, 24, dtype=torch.bool).triu(1)[None, None]),
                            lambda out: F.mse_loss(out.squeeze(-1), targets[half]))
    print(f"CRITIC_STEP loss {loss} grad_norm {norm:.6f} ref {ref_critic_norm:.6f}", flush=True)
    assert abs(norm - ref_critic_norm) < 1e-5 * ref_critic_norm
    # DP replicas of the critic hold identical weights after the step
    flat = torch.cat([p.detach().flatten() for p in critic_model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(replicas, flat.contiguous(), group=critic.dp_group)
    assert torch.equal(replicas[0], replicas[1]), "critic DP replicas diverged"
    print("LAYOUT_WORKER_OK", flush=True)


if __name__ == "__main__":
    dist_worker(main)
