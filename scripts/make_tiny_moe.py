"""Create what recipes/deepseek/tiny-v3-cpu.yaml trains: a tiny randomly initialised DeepSeek-V3-like model (MLA with
q/kv LoRA and decoupled RoPE, 8 routed experts of which 2 per token with sigmoid group-limited routing and an expert
bias, a shared expert, the first layer dense), a character-level tokenizer with a chat template, and prompt parquet
files whose reward is the share of the response made of one target character (engine/rewards/target_char.py).

    python scripts/make_tiny_moe.py --out outputs/tiny-v3        # then:
    python -m tripod train recipes/deepseek/tiny-v3-cpu.yaml

Everything is made offline with transformers (`save_pretrained`): no download.
"""
from __future__ import annotations

import argparse
import os

from tripod.engine.data.char_tokenizer import char_tokenizer  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_theta=10000.0, moe_intermediate_size=32,
              n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=32,
              kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True,
              num_nextn_predict_layers=0)


def make_model(out: str, seed: int) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**CONFIG)).float()
    with torch.no_grad():  # the DeepSeek init leaves the expert bias at 0: give it random values (it steers routing)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)
    model.save_pretrained(out)
    char_tokenizer().save_pretrained(out)


def make_data(out: str, target: str, train: int, val: int) -> None:
    import random

    from tripod.engine.data.dataset import write_prompt_parquet

    rng = random.Random(0)
    for split, count in (("train", train), ("test", val)):
        rows = []
        for index in range(count):
            word = "".join(rng.choice("abcdefghij") for _ in range(4))
            rows.append({"data_source": "target_char",
                         "prompt": [{"role": "user", "content": f"{word}: say {target}"}],
                         "ability": "toy", "reward_model": {"style": "rule", "ground_truth": target},
                         "extra_info": {"split": split, "index": index}})
        write_prompt_parquet(rows, os.path.join(out, f"{split}.parquet"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/tiny-v3", help="model in OUT/model, data in OUT/data")
    parser.add_argument("--target", default="7", help="the character the reward asks for")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_model(os.path.join(args.out, "model"), args.seed)
    make_data(os.path.join(args.out, "data"), args.target, train=512, val=16)
    print(f"wrote {args.out}/model (tiny DeepSeek-V3, random init) and {args.out}/data/{{train,test}}.parquet")


if __name__ == "__main__":
    main()
