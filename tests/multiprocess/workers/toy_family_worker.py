"""torchrun worker (2 ranks) for tests/multiprocess/test_toy_family.py: the toy family, registered by importing that test
module, through megatron (TP2 and PP2 logits vs HF), the hybrid engine (TP2 -> rollout TP1 and TP2) and the
embedded decoder (greedy from the resharded shard).

argv: case.pt written by the pytest side. Prints `TOY <check> OK` per passed check (rank 0).
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker

TOLERANCE = 1e-5  # fp32 logits of O(1) from ~10^2-term reductions in a different order


def say(line):
    if dist.get_rank() == 0:
        print(f"TOY {line}", flush=True)


def main():
    from safetensors.torch import load_file
    from test_toy_family import register_toy_family

    from tests.helpers.model_forward import forward_logits
    from tripod.engine.rollout import SamplingParams, make_rollout_engine
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import family_of, hf_to_megatron, load_hf_weights
    from tripod.parallel.families.spec import Split, pad_rows, shard
    from tripod.parallel.hybrid_engine.engine import HybridEngine
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.model import build_gpt_model

    register_toy_family()
    case = torch.load(sys.argv[1])
    arch = arch_from_hf(case["hf_dir"])
    family = family_of(arch)
    assert arch.family == "toy_mistral"
    for tp, pp in ((2, 1), (1, 2)):
        layout = ParallelLayout(tp=tp, pp=pp, name=f"toy_tp{tp}pp{pp}", arch=arch)
        model = build_gpt_model(arch, layout)
        assert not load_hf_weights(model, case["hf_dir"], arch, layout)
        logits = forward_logits(model, layout, case["ids"])
        if layout.is_last_stage:
            diff = (logits - case["ref"]).abs().max().item()
            assert diff < TOLERANCE, f"TP{tp}PP{pp}: max |logits - HF| = {diff}"
        dist.barrier()
        say(f"PARITY {'TP2' if tp == 2 else 'PP2'} OK")
        if tp == 2:
            actor, actor_layout = model, layout

    full = hf_to_megatron(arch, load_file(f"{case['hf_dir']}/model.safetensors"))
    for tg in (1, 2):
        hybrid = HybridEngine(arch, actor_layout, tg, bucket_bytes=4 << 10)
        gen = hybrid.to_rollout(actor)
        vocab_rows = gen["embedding.word_embeddings.weight"].shape[0] * tg
        j = hybrid.rollout_tp_rank
        for name, t in full.items():  # the generation shard keeps the training vocab padding
            split = family.row(arch, name).tp
            src = pad_rows(t, arch.vocab_size, vocab_rows) if split is Split.VOCAB else t
            want = shard(split, src, tg, j)
            assert torch.equal(gen[name], want), f"tg={tg} {name}"
        engine = make_rollout_engine("embedded", arch, hybrid.rollout_tp_group, pad_token_id=0)
        engine.load_weights(gen)
        out = engine.generate([case["prompt"]], SamplingParams(max_new_tokens=5, greedy=True, ignore_eos=True))
        assert out.responses()[0] == case["greedy"], (tg, out.responses()[0], case["greedy"])
        engine.release_memory()
    say("RESHARD OK")
    say("GREEDY OK")


if __name__ == "__main__":
    dist_worker(main)
