"""Adding a model family is one FamilySpec plus a registration: a toy family, registered from this file,
goes through the shared conversion, parity and resharding machinery unchanged.

The toy family serves HF's `mistral` model type (MistralForCausalLM: Llama's math and names plus a sliding
window, which is refused unless it covers every position). Its table is written out here on purpose: nothing
outside this file knows about it. The 2-rank part (tests/multiprocess/workers/toy_family_worker.py) registers it again by
importing this module.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.common import run_torchrun
from tripod.parallel.arch import ModelArch
from tripod.parallel.families import FamilySpec, Fuse, Split, Weight, register_family, unregister_family
from tripod.parallel.families.llama import local_gpt_layer_spec

TOY_CONFIG = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=None,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)


def toy_weights(arch: ModelArch) -> tuple[Weight, ...]:
    qkv = lambda a: ((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, a.hidden_size)  # noqa: E731
    return (
        Weight("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
               lambda a: (a.vocab_size, a.hidden_size), Split.VOCAB, per_layer=False),
        Weight("input_layernorm.weight", ("input_layernorm.weight",), lambda a: (a.hidden_size,), Split.REPLICATED),
        Weight("self_attention.linear_qkv.weight",
               ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), qkv, Split.ROW,
               Fuse.QKV_GROUPED),
        Weight("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",),
               lambda a: (a.hidden_size, a.num_heads * a.head_dim), Split.COL),
        Weight("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), lambda a: (a.hidden_size,),
               Split.REPLICATED),
        Weight("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
               lambda a: (2 * a.ffn_hidden_size, a.hidden_size), Split.GATED_ROW, Fuse.CONCAT),
        Weight("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), lambda a: (a.hidden_size, a.ffn_hidden_size),
               Split.COL),
        Weight("decoder.final_layernorm.weight", ("model.norm.weight",), lambda a: (a.hidden_size,),
               Split.REPLICATED, per_layer=False),
        Weight("output_layer.weight", ("lm_head.weight",), lambda a: (a.vocab_size, a.hidden_size), Split.VOCAB,
               per_layer=False),
    )


def check_toy(arch: ModelArch) -> None:
    window = arch.hf_config.get("sliding_window")
    if window is not None and window < arch.max_position_embeddings:
        raise ValueError(f"config.json sliding_window={window} < max_position_embeddings: not supported; "
                         "set sliding_window=null")


TOY = FamilySpec(name="toy_mistral", hf_model_types=("mistral",), hf_layer_prefix="model.layers.",
                 weights=toy_weights, check_supported=check_toy, qkv_bias=lambda cfg: False,
                 layer_spec=local_gpt_layer_spec)


def register_toy_family() -> FamilySpec:
    return register_family(TOY)


def make_toy_checkpoint(out_dir: str, seed: int = 0) -> str:
    import transformers

    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**TOY_CONFIG)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():  # fresh random values everywhere, norms included
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture
def toy(tmp_path):
    register_toy_family()
    try:
        yield make_toy_checkpoint(str(tmp_path / "toy"))
    finally:
        unregister_family(TOY.name)


def test_unregistered_family_is_refused(tmp_path):
    from tripod.parallel.arch import arch_from_hf

    with pytest.raises(ValueError, match="model_type='mistral'.*not supported.*FamilySpec"):
        arch_from_hf(dict(TOY_CONFIG, model_type="mistral"))


def test_toy_family_converts_and_splits_through_the_shared_machinery(toy):
    from safetensors.torch import load_file

    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import canonical_names, family_of, hf_to_megatron, megatron_to_hf

    arch = arch_from_hf(toy)
    assert arch.family == "toy_mistral" and family_of(arch) is TOY
    hf = load_file(os.path.join(toy, "model.safetensors"))
    full = hf_to_megatron(arch, hf)
    assert list(full) == canonical_names(arch)
    for tp in (1, 2):
        back = {}
        for name, t in full.items():
            shards = [TOY.shard(arch, name, t, tp, r) for r in range(tp)]
            back.update(megatron_to_hf(arch, name, TOY.merge(arch, name, shards)))
        assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf), f"tp={tp}"
    with pytest.raises(ValueError, match="sliding_window=8"):
        family_of(arch_from_hf(dict(arch.hf_config, sliding_window=8)))


def test_toy_family_rollout_decoder_matches_hf_generate(toy):
    import transformers
    from safetensors.torch import load_file

    from tripod.engine.rollout import SamplingParams, make_rollout_engine
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import hf_to_megatron

    arch = arch_from_hf(toy)
    engine = make_rollout_engine("embedded", arch, None)
    engine.load_weights(hf_to_megatron(arch, load_file(os.path.join(toy, "model.safetensors"))))  # TP=1 shard
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 9)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(toy, dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert out.responses()[i] == want.tolist()


@pytest.mark.dist
def test_toy_family_megatron_parity_and_resharding(toy, tmp_path):
    """2 ranks: megatron TP2 and PP2 logits == HF; hybrid-engine reshard TP2 -> rollout TP1 == the family's
    slices; greedy tokens from the resharded shard == HF generate."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(toy, dtype=torch.float32).eval()
    ids = torch.randint(3, TOY_CONFIG["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(7))
    prompt = ids[0, :8]
    with torch.no_grad():
        ref = hf(ids).logits
        greedy = hf.generate(prompt[None], attention_mask=torch.ones(1, 8, dtype=torch.long), max_new_tokens=5,
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0, 8:]
    torch.save({"hf_dir": toy, "ids": ids, "ref": ref, "prompt": prompt.tolist(), "greedy": greedy.tolist()},
               tmp_path / "case.pt")
    out = run_torchrun("toy_family_worker.py", 2, tmp_path / "case.pt", timeout=400).stdout
    for check in ("PARITY TP2", "PARITY PP2", "RESHARD", "GREEDY"):
        assert f"TOY {check} OK" in out, out[-3000:]
