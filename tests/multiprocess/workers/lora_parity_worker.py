"""torchrun worker (4 ranks): a tripod GPTModel with LoRA adapters (parallel/lora/) == peft on the HF model, at
(TP, PP) = (1, 1) [rank 0], (2, 1) [0, 1], (2, 1) with sequence parallelism [2, 3], (1, 2) [2, 3], (2, 2) [0..3].

argv: cases.pt from the pytest side, a list of: name, hf_dir, input_ids, peft's logits, its loss weights and its
adapter weights and gradients (peft names), lora rank / alpha / target_modules, optionally the layouts to run.
Prints per last-stage rank `LORA_LOGITS <model> <layout> maxdiff <x>`, per rank `LORA_GRAD <model> <layout> maxrel <x>` (gradients of
every local A and B against peft's, sharded the same way), `LORA_OFF <model> <layout> maxdiff <x>`, `LORA_MERGE <model> <layout> err/bound <x>` (merged weights vs float64) (adapters switched off
against the model without adapters: must be 0), and `PLANTED <bug> maxdiff <x>` at TP2 for bugs the checks must see;
for the MLA case (deepseek_v3) at TP2, `PLANTED_GRAD mla_hook_after_tag|mla_rope_unreduced maxrel <x>` (`_plant_mla`).
"""
import sys

import torch

from tests.helpers.common import dist_worker

LAYOUTS = [("TP1PP1", (1, 1, False), [0]), ("TP2PP1", (2, 1, False), [0, 1]), ("TP2PP1SP", (2, 1, True), [2, 3]),
           ("TP1PP2", (1, 2, False), [2, 3]), ("TP2PP2", (2, 2, False), [0, 1, 2, 3])]
PLANT_LAYOUT = "TP2PP1"
EXPORT_LAYOUT = "TP2PP2"  # the peft directory is written from this layout (parallel/lora/export.py)


def _loss_grads(model, layout, input_ids, weight, vocab):
    """Backward of sum(logits * weight) through the production pipeline driver (gradients into .grad)."""
    from tests.helpers.model_forward import gather_vocab_logits
    from tripod.parallel.model import causal_attention_mask
    from tripod.parallel.pipeline import run_pipeline

    b, s = input_ids.shape
    batch = dict(input_ids=input_ids, position_ids=torch.arange(s).unsqueeze(0).expand(b, s),
                 attention_mask=causal_attention_mask(s))

    def forward_step(mb, chunk):
        out = chunk(input_ids=mb["input_ids"], position_ids=mb["position_ids"], attention_mask=mb["attention_mask"])

        def loss(o):
            value = (gather_vocab_logits(o, layout, vocab) * weight).sum()
            return value, value.detach()
        return out, loss

    run_pipeline([model], layout, [batch], forward_step, forward_only=False, seq_length=s, micro_batch_size=b)


def _grad_error(adapters, grads, prefix) -> float:
    from tripod.parallel.lora.apply import local_piece
    from tripod.parallel.lora.state import adapter_names

    worst = 0.0
    for adapter in adapters:
        for name, (key, which) in adapter_names(adapter, prefix).items():
            param = (adapter.lora_A if which == "A" else adapter.lora_B)[key]
            want = local_piece(adapter, which, grads[name])
            err = ((param.grad - want).abs().max() / want.abs().max()).item()
            worst = err if not err <= worst else worst
    return worst


def _merge_error(model, adapters, case, prefix) -> float:
    """max over adapted weights of |merged - float64 (W + scale * B @ A)| / its rounding bound (merged lazily, in
    small chunks, as the rollout sync merges it: parallel/lora/merge.py), where the float64
    delta is fused and split by the converter's own code (fuse_to_megatron, FamilySpec.shard) from peft's tensors."""
    from tripod.parallel.convert import global_params
    from tripod.parallel.convert.common import fuse_to_megatron
    from tripod.parallel.families import get_family
    from tripod.parallel.lora.merge import merged_shard

    arch = model.tripod_arch
    family = get_family(arch.family)
    scale = case["alpha"] / case["rank"]  # peft's, not the adapter's (a planted bug may change that)
    params = global_params(model)
    names = {id(p): n for n, p in params.items()}
    worst = 0.0
    for a in adapters:
        name = names[id(a.base_weight[0])]
        lazy = merged_shard(model, {name: params[name].data}, names, bucket_bytes=1024)[name]
        merged = torch.full(lazy.shape, float("nan"), dtype=lazy.dtype)
        lazy.copy_into((slice(None),), merged)  # as the transport reads it: chunks of 256 elements
        deltas = []
        for part, rows in zip(a.spec.target.parts, a.spec.target.rows()):
            module = a.spec.hf_module(part, prefix)
            if part in a.spec.parts:
                b, aa = case["adapters"][f"base_model.model.{module}.lora_B.weight"], \
                    case["adapters"][f"base_model.model.{module}.lora_A.weight"]
                deltas.append(scale * b.double() @ aa.double())
            else:
                deltas.append(torch.zeros(rows, a.spec.in_features, dtype=torch.float64))
        full = fuse_to_megatron(arch, family, name, deltas)
        want = params[name].data.double() + family.shard(arch, name, full, a.tp, a.tp_rank)
        bound = 4 * torch.finfo(torch.float32).eps * (want.abs().max().item() + scale * a.rank * max(
            t.abs().max().item() for t in list(a.lora_A.values()) + list(a.lora_B.values())) ** 2)
        err = (merged.double() - want).abs().max().item() / bound
        worst = err if not err <= worst else worst
    return worst


def _checkpoint_entries(model, layout) -> int:
    """megatron checkpoint entries of the adapters: a split tensor (column-parallel B, row-parallel A) is saved as
    this rank's piece of its full shape, at its offset; the replicated one whole."""
    with layout.activate():
        entries = {k: v for k, v in model.sharded_state_dict().items() if ".lora.lora_" in k}
    for key, entry in entries.items():
        row = ".linear_proj." in key or ".linear_fc2." in key
        dim = (1 if row else 0) if (".lora_A." in key) == row else None
        want = list(entry.local_shape)  # the last two dims (megatron puts the layer index in front)
        if dim is not None:
            want[dim] *= layout.tp
            assert entry.global_offset[-2:][dim] == layout.tp_rank * entry.local_shape[dim], (key, entry.global_offset)
        assert list(entry.global_shape[-2:]) == want, (key, entry.global_shape, entry.local_shape)
    return len(entries)


def main() -> None:
    from tripod.parallel.layout import ParallelLayout

    cases = torch.load(sys.argv[1])
    layouts = [(name, ParallelLayout(tp=t, pp=p, dp=1, ranks=ranks, name=name), sp)
               for name, (t, p, sp), ranks in LAYOUTS]
    for i, case in enumerate(cases if isinstance(cases, list) else [cases]):
        for name, layout, sp in layouts:
            if layout.is_member and name in case.get("layouts", [n for n, _, _ in LAYOUTS]):
                _check(case, name, layout, sp, plants=i == 0 and name == PLANT_LAYOUT,
                       mla_plants=case["name"] == "deepseek_v3" and name == PLANT_LAYOUT)


def _check(case, name, layout, sp, plants: bool, mla_plants: bool = False) -> None:
    from tests.helpers.model_forward import forward_logits
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import load_hf_weights
    from tripod.parallel.families import get_family
    from tripod.parallel.lora import LoraSettings, adapters_disabled, apply_lora
    from tripod.parallel.lora.state import load_peft_state
    from tripod.parallel.model import build_gpt_model

    arch = arch_from_hf(case["hf_dir"])
    prefix = get_family(arch.family).hf_layer_prefix
    settings = LoraSettings(rank=case["rank"], alpha=case["alpha"], target_modules=case["targets"])
    ids, ref = case["input_ids"], case["ref_logits"]
    tag = f"{case['name']} {name}"
    model = build_gpt_model(arch, layout, sequence_parallel=sp)
    assert not case.get("no_sequence_parallel") or not model.config.sequence_parallel, tag  # MLA's dense case
    assert not load_hf_weights(model, case["hf_dir"], arch, layout)
    base = forward_logits(model, layout, ids)
    adapters = apply_lora([model], arch, settings)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".lora." not in n)
    load_peft_state(adapters, case["adapters"], prefix, "peft")
    with torch.no_grad():
        logits = forward_logits(model, layout, ids)
        with adapters_disabled([model]):
            off = forward_logits(model, layout, ids)
    if layout.is_last_stage:
        print(f"LORA_LOGITS {tag} maxdiff {(logits - ref).abs().max().item():.3e}", flush=True)
        print(f"LORA_OFF {tag} maxdiff {(off - base).abs().max().item():.3e}", flush=True)
    print(f"LORA_MERGE {tag} err/bound {_merge_error(model, adapters, case, prefix):.3e}", flush=True)
    _loss_grads(model, layout, ids, case["weight"], arch.vocab_size)
    print(f"LORA_GRAD {tag} maxrel {_grad_error(adapters, case['grads'], prefix):.3e}", flush=True)
    if name == EXPORT_LAYOUT and case.get("export_dir"):  # every rank of the world is in this layout
        from tripod.parallel.lora.export import save_peft_adapter
        save_peft_adapter(adapters, arch, case["export_dir"], case["hf_dir"])
    if layout.tp > 1:
        print(f"LORA_CKPT {tag} entries {_checkpoint_entries(model, layout)}", flush=True)
    if plants:
        _plant(model, layout, adapters, case, ids, ref)
    if mla_plants:
        _plant_mla(model, layout, adapters, case)


def _plant(model, layout, adapters, case, ids, ref):
    """Bugs the parity checks must see: the other TP rank's rows of every column-parallel B; scale alpha (not
    alpha / rank); the row-parallel partial products left unreduced; A's gradient not all-reduced over TP."""
    from megatron.core.tensor_parallel import mappings

    from tests.helpers.model_forward import forward_logits
    from tripod.parallel.families import get_family
    from tripod.parallel.lora.state import load_peft_state

    prefix = get_family(model.tripod_arch.family).hf_layer_prefix

    def report(bug):
        with torch.no_grad():
            logits = forward_logits(model, layout, ids)
        if layout.is_last_stage:
            print(f"PLANTED {bug} maxdiff {(logits - ref).abs().max().item():.3e}", flush=True)

    column = [a for a in adapters if not a.row]
    saved = [{k: v.detach().clone() for k, v in a.lora_B.items()} for a in column]
    for a in column:
        a.tp_rank = 1 - a.tp_rank
    load_peft_state(column, case["adapters"], prefix)
    report("b_other_rank")
    for a, s in zip(column, saved):
        a.tp_rank = 1 - a.tp_rank
        with torch.no_grad():
            for k, v in s.items():
                a.lora_B[k].copy_(v)
    for a in adapters:
        a.scale *= a.rank
    report("scale_alpha")
    print(f"PLANTED_MERGE scale_alpha err/bound {_merge_error(model, adapters, case, prefix):.3e}", flush=True)
    for a in adapters:
        a.scale /= a.rank
    real = mappings.reduce_from_tensor_model_parallel_region
    mappings.reduce_from_tensor_model_parallel_region = lambda x, group=None: x
    try:
        report("row_unreduced")
    finally:
        mappings.reduce_from_tensor_model_parallel_region = real
    real = mappings.copy_to_tensor_model_parallel_region  # A's gradient left partial: the logits do not see it
    mappings.copy_to_tensor_model_parallel_region = lambda x, group=None: x
    try:
        for a in adapters:
            for p in a.parameters():
                p.grad = None
        _loss_grads(model, layout, ids, case["weight"], model.tripod_arch.vocab_size)
        print(f"PLANTED_GRAD a_unreduced maxrel {_grad_error(adapters, case['grads'], prefix):.3e}", flush=True)
    finally:
        mappings.copy_to_tensor_model_parallel_region = real


def _plant_mla(model, layout, adapters, case) -> None:
    """MLA at TP2, bugs the gradient check must see: the adapter's hook on linear_kv_down_proj after cpu_compat's
    mla_rope_key_grad tag (the adapted output then misses the RoPE key gradient's sum over TP); that TP all-reduce
    missing altogether (megatron as installed)."""
    from megatron.core.transformer import multi_latent_attention as mla

    from tripod.parallel.families import get_family
    from tripod.parallel.lora.apply import _add_adapter_output

    prefix = get_family(model.tripod_arch.family).hf_layer_prefix

    def report(bug):
        for a in adapters:
            for p in a.parameters():
                p.grad = None
        _loss_grads(model, layout, case["input_ids"], case["weight"], model.tripod_arch.vocab_size)
        print(f"PLANTED_GRAD {bug} maxrel {_grad_error(adapters, case['grads'], prefix):.3e}", flush=True)

    kv_down = [m for m in model.modules() if getattr(getattr(m, "lora", None), "spec", None) is not None
               and m.lora.spec.target.name == "linear_kv_down_proj"]
    assert kv_down and all(len(m._forward_hooks) == 2 for m in kv_down)  # the adapter's and the RoPE-key tag
    keys = [next(k for k, h in m._forward_hooks.items() if h is _add_adapter_output) for m in kv_down]
    for m, k in zip(kv_down, keys):
        m._forward_hooks.move_to_end(k)
    try:
        report("mla_hook_after_tag")
    finally:
        for m, k in zip(kv_down, keys):
            m._forward_hooks.move_to_end(k, last=False)
    fixed = mla.gather_from_tensor_model_parallel_region, mla.MLASelfAttention.get_query_key_value_tensors
    mla.gather_from_tensor_model_parallel_region, mla.MLASelfAttention.get_query_key_value_tensors = mla._tripod_unfixed
    try:
        report("mla_rope_unreduced")
    finally:
        mla.gather_from_tensor_model_parallel_region, mla.MLASelfAttention.get_query_key_value_tensors = fixed


if __name__ == "__main__":
    dist_worker(main)
