"""One gloo rank: megatron-core MoE and MLA layers without Transformer Engine, with and without tripod's fixes.

Prints BUG_STILL_PRESENT <name> for each megatron bug that still reproduces once its fix is taken away, and
FIXED_FORWARD <name> <max|logit|> when the model runs with the fixes (see parallel/megatron_patches/cpu_compat.py).
"""
import torch
import torch.nn.functional as F

from tests.helpers.common import dist_worker


def _config(mla: bool):
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    common = dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                  normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                  hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, use_cpu_initialization=True,
                  gradient_accumulation_fusion=False, bias_dropout_fusion=False, bias_activation_fusion=False,
                  masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                  num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1],
                  moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_aux_loss_coeff=0.0,
                  moe_router_load_balancing_type="none", moe_router_dtype="fp32")
    if not mla:
        return TransformerConfig(kv_channels=8, num_query_groups=2, **common)
    return MLATransformerConfig(q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
                                kv_channels=8, num_query_groups=4, qk_layernorm=True, rope_type="rope", rotary_scaling_factor=1.0,
                                mscale_all_dim=0.0, multi_latent_attention=True, **common)


def _forward(layout, mla: bool, fix_spec: bool) -> float:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tripod.parallel.megatron_patches.cpu_compat import mla_local_core_attention

    config = _config(mla)
    with layout.activate():
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        if fix_spec:
            mla_local_core_attention(spec)
        model_parallel_cuda_manual_seed(1234)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=32,
                         position_embedding_type="rope", pg_collection=layout.pg_collection).eval()
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(8).expand(2, 8)
        mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).triu(1)
        with torch.no_grad():
            logits = model(tokens, pos, mask)
    assert torch.isfinite(logits).all()
    return float(logits.abs().max())


def _expect(exc_type, fn, name):
    try:
        fn()
    except exc_type as e:
        print(f"BUG_STILL_PRESENT {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        return
    print(f"BUG_GONE {name}: megatron no longer needs this workaround", flush=True)


def main() -> None:
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    from tripod.parallel.layout import ParallelLayout

    layout = ParallelLayout(name="no_te")
    # each fix taken away in turn: the bug it works around must still reproduce
    saved = moe_utils.te_general_gemm
    del moe_utils.te_general_gemm
    _expect(NameError, lambda: _forward(layout, mla=False, fix_spec=False), "moe_te_gemm")
    moe_utils.te_general_gemm = saved
    multi_latent_attention.HAVE_TE = True
    _expect(TypeError, lambda: _forward(layout, mla=True, fix_spec=True), "mla_have_te")
    multi_latent_attention.HAVE_TE = False
    _expect(TypeError, lambda: _forward(layout, mla=True, fix_spec=False), "mla_core_attn")
    # with every fix in place both models run
    print(f"FIXED_FORWARD moe {_forward(layout, mla=False, fix_spec=False):.4f}", flush=True)
    print(f"FIXED_FORWARD mla {_forward(layout, mla=True, fix_spec=True):.4f}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
