"""torchrun worker (2 ranks): gradients of a tiny MoE megatron model at TP2 against transformers' own backward.

argv: HF_DIR CASE [CASE ...], a CASE being SP (0|1) or SP:without_fix, run in order in this one world (a
without_fix case undoes the workaround for the rest of the process, so it comes last). The same loss (logits . fixed random weights) is back-propagated through the
megatron model at TP2 (sequence parallel or not) and through the HF fp32 model; every megatron gradient, merged over TP
with the family table (SP-tagged replicated grads summed over TP, as finalize_model_grads does), must equal the HF
gradient mapped by the same table within 1e-5 relative to the tensor's largest HF gradient (fp32 reduction order
only). Prints GRAD_MATCH sp=1|0 or GRAD_MISMATCH sp=1|0 <names> per case. `without_fix` skips parallel/megatron_patches/cpu_compat.py's
mla_rope_key_grad workaround: megatron's own TP > 1 MLA gradients must then still MISMATCH (the canary that says
when the workaround can go).
"""
import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker


def grads(model, arch, layout, ids, weight):
    from tripod.parallel.convert import global_params
    from tripod.parallel.model import causal_attention_mask

    with layout.activate():
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        logits = model(input_ids=ids, position_ids=pos, attention_mask=causal_attention_mask(ids.shape[1]))
        if layout.tp > 1:  # vocab-parallel: this rank's columns of the fixed weights
            rows = logits.shape[-1]
            weight = weight[..., layout.tp_rank * rows:(layout.tp_rank + 1) * rows]
        loss = (logits * weight[..., :logits.shape[-1]]).sum()
        loss.backward()

    return {n: (p.grad, getattr(p, "sequence_parallel", False)) for n, p in global_params(model).items()
            if isinstance(p, torch.nn.Parameter)}


def hf_grads(hf_dir, arch, ids, weight):
    """The reference: transformers' fp32 model, same loss, gradients mapped to megatron names by the family table."""
    from transformers import AutoModelForCausalLM

    from tripod.parallel.convert import hf_to_megatron

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager")
    logits = model(ids).logits
    (logits * weight[..., :logits.shape[-1]]).sum().backward()
    state = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    state.update({n: torch.zeros_like(b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    return hf_to_megatron(arch, state)


def main():
    import sys

    hf_dir, cases = sys.argv[1], [c.split(":") for c in sys.argv[2:]]
    unfixed = [i for i, c in enumerate(cases) if c[1:] == ["without_fix"]]
    assert unfixed in ([], [len(cases) - 1]), f"one without_fix case at most, and last: {sys.argv[2:]}"
    for sp, *without_fix in cases:
        check_case(hf_dir, sp == "1", bool(without_fix))


def check_case(hf_dir, sp, without_fix):
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import family_of, load_hf_weights
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.model import build_gpt_model

    if without_fix:  # the canary: megatron as installed
        from megatron.core.transformer import multi_latent_attention as mla

        from tripod.parallel.megatron_patches.cpu_compat import apply_no_te_fixes
        apply_no_te_fixes()  # installs the fix (idempotent), then undo it
        mla.gather_from_tensor_model_parallel_region, mla.MLASelfAttention.get_query_key_value_tensors = \
            mla._tripod_unfixed
    arch = arch_from_hf(hf_dir)
    family = family_of(arch)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, arch.vocab_size, (2, 12), generator=g)
    weight = torch.randn(2, 12, 512, generator=g)
    tp2 = ParallelLayout(tp=dist.get_world_size(), name="tp", arch=arch)
    model = build_gpt_model(arch, tp2, sequence_parallel=sp)
    with tp2.activate():
        load_hf_weights(model, hf_dir, arch, tp2)
    mine = grads(model, arch, tp2, ids, weight)
    gathered = {}
    for name in sorted(mine):
        grad, tagged = mine[name]
        parts = [torch.empty_like(grad) for _ in range(tp2.tp)]
        dist.all_gather(parts, grad.contiguous(), group=tp2.tp_group)
        if family.row(arch, name).tp.value != "replicated":
            gathered[name] = family.merge(arch, name, parts)
        else:  # SP-tagged replicated grads are per-token-slice partials: finalize_model_grads sums them over TP
            gathered[name] = sum(parts) if tagged else parts[0]
    if dist.get_rank() != 0:
        return
    ref = hf_grads(hf_dir, arch, ids, weight)
    bad = []
    for name, got in gathered.items():
        want = ref[name]
        if not (got - want).abs().max() <= 1e-5 * want.abs().max().clamp(min=1e-30):  # a NaN mismatches
            bad.append(f"{name} {float((got - want).abs().max()):.3g}/{float(want.abs().max()):.3g}")
    print(f"GRAD_MISMATCH sp={int(sp)} " + "; ".join(bad) if bad else f"GRAD_MATCH sp={int(sp)}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
