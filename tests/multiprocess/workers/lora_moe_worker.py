"""torchrun worker (4 ranks): LoRA on a tiny Qwen3-MoE's experts (one adapter per expert, living with its expert)
and on its dense MLP layer, against the HF model with the adapters merged into its weights (float64 merge), at
EP2 x DP2 [ranks 0, 1], at TP2 x DP2 with EP2 x ETP2 (sequence parallel) [0..3]: each expert's linears and
adapters split over two ranks, the dense MLP's adapters at TP2; and where the expert TP differs from the dense TP:
TP2 x DP2 with EP2 x ETP1, DP4 with EP2 x ETP2 [0..3].

argv: case.pt from the pytest side: hf_dir, input_ids (DP rank 1 takes them flipped), the merged model's logits of
both batches, the loss weights, the adapters (peft names) and the adapters' expected gradients of the DP-mean loss.
Through megatron's DDP (expert adapters reduced over the expert-data-parallel group only, like the experts).
Prints `LORA_MOE_LOGITS <layout> rank <r> maxdiff <x>` (last-stage ranks), `LORA_MOE_GRAD <layout> rank <r> maxrel
<x>`, and for the planted bugs `PLANTED_MOE <layout> rank <r> maxrel <x>`: at ETP1 the expert adapters marked as
dense parameters (DDP then averages different experts' gradients over DP); at ETP2 the experts' replicated factors
(fc1's A, fc2's B) without their gradient's all-reduce over expert TP (adapter.py's `_sum_grad_over_expert_tp`).
`LORA_MOE_NORM <layout> rank <r> rel <x> planted <y>`: megatron's optimizer's gradient norm (what clipping and
actor/grad_norm use) against the norm of all expected gradients, and with the adapters' grad-norm marks as they were
before adapter.py's `_count_once_in_grad_norm` (the planted bug: wrong wherever the expert TP is not the dense TP).
"""
import sys

import torch

from tests.helpers.common import dist_worker

LAYOUTS = {"EP2DP2": (dict(tp=1, ep=2, etp=1, dp=2), [0, 1]),
           "TP2EP2ETP2DP2SP": (dict(tp=2, ep=2, etp=2, dp=2), [0, 1, 2, 3]),
           "TP2EP2ETP1DP2SP": (dict(tp=2, ep=2, etp=1, dp=2), [0, 1, 2, 3]),
           "DP4EP2ETP2": (dict(tp=1, ep=2, etp=2, dp=4), [0, 1, 2, 3])}


def _build(case, layout, plant: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import load_hf_weights
    from tripod.parallel.families import get_family
    from tripod.parallel.lora import LoraSettings, apply_lora
    from tripod.parallel.lora.state import load_peft_state
    from tripod.parallel.model import build_gpt_model

    arch = arch_from_hf(case["hf_dir"])
    model = build_gpt_model(arch, layout)
    assert not load_hf_weights(model, case["hf_dir"], arch, layout)
    adapters = apply_lora([model], arch, LoraSettings(rank=case["rank"], alpha=case["alpha"],
                                                      target_modules=["linear_fc1", "linear_fc2"]))
    assert sum(a.spec.expert is not None for a in adapters) == 2 * 3 * 2  # 3 MoE layers x 2 local experts x fc1/fc2
    load_peft_state(adapters, case["adapters"], get_family(arch.family).hf_layer_prefix, "case")
    if plant and layout.etp == 1:
        for a in adapters:
            for p in a.parameters():
                p.allreduce = True
    with layout.activate():
        ddp = DistributedDataParallel(config=model.config, module=model, pg_collection=layout.pg_collection,
                                      ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    model.config.finalize_model_grads_func = finalize_model_grads
    return model, ddp, adapters, arch


def _grad_error(adapters, grads) -> float:
    from tripod.parallel.families import get_family
    from tripod.parallel.lora.apply import local_piece
    from tripod.parallel.lora.state import adapter_names

    worst = 0.0
    for a in adapters:
        prefix = get_family("qwen3_moe").hf_layer_prefix
        for name, (key, which) in adapter_names(a, prefix).items():
            param = (a.lora_A if which == "A" else a.lora_B)[key]
            want = local_piece(a, which, grads[name]).float()
            err = ((param.main_grad - want).abs().max() / want.abs().max()).item()
            worst = err if not err <= worst else worst
    return worst


def main() -> None:
    from tripod.parallel.layout import ParallelLayout

    case = torch.load(sys.argv[1])
    layouts = [ParallelLayout(pp=1, ranks=ranks, name=name, **sizes) for name, (sizes, ranks) in LAYOUTS.items()]
    for layout in layouts:
        if layout.is_member:
            _check(case, layout)


def _check(case, layout) -> None:
    from tests.helpers.model_forward import forward_logits
    from tests.multiprocess.workers.lora_parity_worker import _loss_grads
    from tripod.parallel.lora.adapter import LoraAdapter

    rank, tag = layout.dp_rank % 2, f"{layout.name} rank {torch.distributed.get_rank()}"  # odd DP ranks: flipped
    ids, weight = case["input_ids"], case["weight"]
    ref = case["ref_logits"][rank]
    if rank == 1:
        ids, weight = ids.flip(0), weight.flip(0)
    # at TP2 x DP2 with EP2 x ETP1 the expert-DP group is the dense DP group: a dense mark would change nothing there
    for plant in (False,) if layout.etp == 1 and layout.edp == layout.dp else (False, True):
        model, ddp, adapters, arch = _build(case, layout, plant)
        if not plant:
            with torch.no_grad():
                logits = forward_logits(model, layout, ids)
            if layout.is_last_stage:
                print(f"LORA_MOE_LOGITS {tag} maxdiff {(logits - ref).abs().max().item():.3e}", flush=True)
        ddp.zero_grad_buffer()
        real = LoraAdapter._sum_grad_over_expert_tp
        if plant and layout.etp > 1:
            LoraAdapter._sum_grad_over_expert_tp = lambda self, factor: factor
        try:
            _loss_grads(ddp, layout, ids, weight, arch.vocab_size)
        finally:
            LoraAdapter._sum_grad_over_expert_tp = real
        what = "PLANTED_MOE" if plant else "LORA_MOE_GRAD"
        print(f"{what} {tag} maxrel {_grad_error(adapters, case['grads']):.3e}", flush=True)
        if not plant and len(layout.ranks) == torch.distributed.get_world_size():  # megatron's optimizer: world-wide
            _check_grad_norm(case, layout, ddp, adapters, tag)                      # collectives at its construction


def _check_grad_norm(case, layout, ddp, adapters, tag) -> None:
    """megatron's optimizer's gradient norm over the adapters just back-propagated, with tripod's marks and with the
    marks before the fix (only an ETP-split factor tensor-parallel, nothing shared)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    with layout.activate():
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [ddp],
                                     use_gloo_process_groups=False, pg_collection=layout.pg_collection)
    want = sum(g.double().pow(2).sum() for g in case["grads"].values()).sqrt().item()
    opt.prepare_grads()  # main_grad -> grad, as step() does first
    got = opt.get_grad_norm()
    for a in (a for a in adapters if a.expert):
        for key in a.lora_A:
            split = a.lora_A[key] if a.row else a.lora_B[key]
            for factor in (a.lora_A[key], a.lora_B[key]):
                factor.tensor_model_parallel, factor.shared = factor is split and a.tp > 1, False
    planted = opt.get_grad_norm()
    print(f"LORA_MOE_NORM {tag} rel {abs(got - want) / want:.3e} planted {abs(planted - want) / want:.3e}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
