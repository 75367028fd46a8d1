"""torchrun x4 worker: tripod checkpoints and HF weights move between layouts exactly.

argv: QWEN_CKPT (saved at TP2xPP2 by `tripod convert`) QWEN_HF (its source) LLAMA_HF WORK_DIR
1. QWEN_CKPT loads at TP1xPP1, TP1xPP2, TP2xPP1, TP2xPP2 (DP fills the 4 ranks); at each layout the
   exported HF tensors equal the source bit-for-bit and the logits match transformers' forward.
2. LLAMA_HF (untied, vocab padding 384 at TP1 vs 512 at TP2) goes load_hf_weights at TP2xPP1 ->
   save_model_checkpoint -> load at TP1xPP2 -> export (to_all_ranks) equal to the source; and
   save_hf_checkpoint with tiny shards + index json -> load_hf_weights at TP2xPP2 from the shards.
3. Tied QWEN_HF straight into TP1xPP2; a critic (value head, bias set nonzero) checkpoint resharded TP2xPP2 ->
   TP1xPP1; rank 0 saves the TP1xPP1 critic's values of its inputs to <work>/critic_values.pt ({"ids", "values"})
   for the pytest side, which exports the checkpoint and scores it in transformers.
"""
import os
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker

LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2)]


def _hf_reference(hf_dir):
    import transformers
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return model, load_file(os.path.join(hf_dir, "model.safetensors"))


def _check_export(model, arch, layout, reference, what, to_all_ranks=False):
    from tripod.parallel.convert import export_hf_weights

    exported = dict(export_hf_weights(model, arch, layout, to_all_ranks=to_all_ranks))
    expect_here = to_all_ranks or (layout.tp_rank == 0 and layout.pp_rank == 0)
    if not expect_here:
        assert not exported, f"{what}: rank {dist.get_rank()} got tensors it should not"
        return 0
    assert sorted(exported) == sorted(reference), f"{what}: names {sorted(set(exported) ^ set(reference))}"
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), f"{what}: {name} differs"
    return len(exported)


def _check_logits(model, layout, hf_model, what):
    from tests.helpers.model_forward import forward_logits

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, hf_model.config.vocab_size, (2, 12), generator=g)
    logits = forward_logits(model, layout, ids)
    if layout.is_last_stage:
        with torch.no_grad():
            ref = hf_model(ids).logits
        err = (logits - ref).abs().max().item()
        assert err < 1e-5, f"{what}: logits max abs err {err}"
        return err
    return None


def main():
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.checkpoint import load_model_checkpoint, save_model_checkpoint
    from tripod.parallel.convert import load_hf_weights, save_hf_checkpoint
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.model import build_gpt_model

    qwen_ckpt, qwen_hf, llama_hf, work = sys.argv[1:5]
    rank = dist.get_rank()

    # 1. TP2xPP2 checkpoint at every layout
    arch = arch_from_hf(qwen_hf)
    hf_model, reference = _hf_reference(qwen_hf)
    for tp, pp in LAYOUTS:
        what = f"qwen2 ckpt(TP2xPP2) -> TP{tp}xPP{pp}"
        layout = ParallelLayout(tp=tp, pp=pp, name=f"tp{tp}pp{pp}")
        model = build_gpt_model(arch, layout, seed=100 + tp * 10 + pp)  # random weights until loaded
        meta = load_model_checkpoint(model, qwen_ckpt, layout)
        assert meta["saved_layout"]["tp"] == 2 and meta["saved_layout"]["pp"] == 2, meta
        n = _check_export(model, arch, layout, reference, what)
        err = _check_logits(model, layout, hf_model, what)
        print(f"[rank{rank}] OK {what}: exported {n} tensors bit-exact, logits err {err}", flush=True)

    # 2. llama: HF -> TP2xPP1 -> checkpoint -> TP1xPP2; HF shards written at TP1xPP2 -> TP2xPP2
    arch = arch_from_hf(llama_hf)
    hf_model, reference = _hf_reference(llama_hf)
    src = ParallelLayout(tp=2, pp=1, name="src")
    model = build_gpt_model(arch, src, seed=1)
    assert load_hf_weights(model, llama_hf, arch, src) == []
    ckpt = os.path.join(work, "llama_ckpt")
    save_model_checkpoint(model, ckpt, arch, src, tokenizer_dir=llama_hf)
    dst = ParallelLayout(tp=1, pp=2, name="dst")
    model = build_gpt_model(arch, dst, seed=2)
    load_model_checkpoint(model, ckpt, dst)
    n = _check_export(model, arch, dst, reference, "llama TP2xPP1 ckpt -> TP1xPP2", to_all_ranks=True)
    print(f"[rank{rank}] OK llama ckpt TP2xPP1 -> TP1xPP2: {n} tensors bit-exact on every rank", flush=True)

    sharded_dir = os.path.join(work, "llama_sharded_hf")
    save_hf_checkpoint(model, arch, dst, sharded_dir, tokenizer_dir=llama_hf, max_shard_bytes=40_000)
    dist.barrier()
    files = sorted(f for f in os.listdir(sharded_dir) if f.endswith(".safetensors"))
    assert len(files) > 2 and "model.safetensors.index.json" in os.listdir(sharded_dir), files
    both = ParallelLayout(tp=2, pp=2, name="both")
    model = build_gpt_model(arch, both, seed=3)
    load_hf_weights(model, sharded_dir, arch, both)
    _check_export(model, arch, both, reference, "llama sharded HF -> TP2xPP2")
    err = _check_logits(model, both, hf_model, "llama sharded HF -> TP2xPP2")
    print(f"[rank{rank}] OK llama {len(files)} HF shards -> TP2xPP2, logits err {err}", flush=True)

    # 3. tied qwen2 straight from HF at TP1xPP2 (the last stage's output layer comes from
    #    embed_tokens), and a critic: its value head survives a TP2xPP2 -> TP1xPP1 checkpoint reshard
    arch = arch_from_hf(qwen_hf)
    hf_model, _ = _hf_reference(qwen_hf)
    pp2 = ParallelLayout(tp=1, pp=2, name="pp2")
    model = build_gpt_model(arch, pp2, seed=4)
    load_hf_weights(model, qwen_hf, arch, pp2)
    err = _check_logits(model, pp2, hf_model, "tied qwen2 HF -> TP1xPP2")
    print(f"[rank{rank}] OK tied qwen2 HF -> TP1xPP2, logits err {err}", flush=True)
    from tests.helpers.model_forward import forward_logits

    critic_layout = ParallelLayout(tp=2, pp=2, name="critic")
    critic = build_gpt_model(arch, critic_layout, value_head=True, seed=5)
    skipped = load_hf_weights(critic, qwen_hf, arch, critic_layout)
    assert skipped == (["output_layer.weight", "output_layer.bias"] if critic_layout.is_last_stage else []), skipped
    if critic_layout.is_last_stage:  # a trained critic's bias is not 0 (the export must say what HF drops)
        with torch.no_grad():
            critic.output_layer.bias.fill_(0.375)
    ids = torch.randint(0, arch.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    values = forward_logits(critic, critic_layout, ids)
    save_model_checkpoint(critic, os.path.join(work, "critic"), arch, critic_layout)
    single = ParallelLayout(tp=1, pp=1, name="critic1")
    critic1 = build_gpt_model(arch, single, value_head=True, seed=6)
    load_model_checkpoint(critic1, os.path.join(work, "critic"), single)
    values1 = forward_logits(critic1, single, ids)
    if rank == 0:
        torch.save({"ids": ids, "values": values1}, os.path.join(work, "critic_values.pt"))
    if critic_layout.is_last_stage:
        assert values.shape == (2, 9)
        err = (values - values1).abs().max().item()
        assert err < 1e-5, f"critic values differ after reshard: {err}"
        print(f"[rank{rank}] OK critic ckpt TP2xPP2 -> TP1xPP1, values err {err}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
