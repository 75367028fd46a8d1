"""MoE / MLA in the rollout room: the embedded decoder against transformers, and the expert resharding plan.

* Greedy generation of the embedded engine (engine/rollout/moe_decoder.py, fed the rollout-TP slice of the HF
  checkpoint through the family table) equals `transformers` `generate` token for token, and its log-probs equal the
  HF model's (fp32, 1e-5), for Qwen3-MoE, Qwen2-MoE and DeepSeek-V3 (MLA). Rollout TP > 1 runs in
  tests/multiprocess/test_hybrid_engine.py (a resharded megatron MoE actor).
* The expert part of the reshard plan (parallel/hybrid_engine/experts.py) delivers every element of every rank's
  generation shard exactly once, takes nothing a rank already holds (zero redundancy), and its closed-form byte count
  equals the enumerated one, for training layouts with EP, expert TP != TP, PP and expert-DP; a planted off-by-one in
  the overlap geometry fails the coverage check.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.moe_models import COMMON, FAMILIES, YARN, make_tiny_moe_model


def _arch(family: str, **kw):
    from tripod.parallel.arch import arch_from_hf

    return arch_from_hf({**COMMON, **FAMILIES[family], "model_type": family, **kw})


@pytest.mark.parametrize("family,overrides", [(f, {}) for f in sorted(FAMILIES)] +
                         [("deepseek_v3", {"rope_parameters": YARN})], ids=sorted(FAMILIES) + ["deepseek_v3_yarn"])
def test_embedded_moe_decoder_generates_like_transformers(tmp_path, family, overrides):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tripod.engine.rollout import SamplingParams, make_rollout_engine
    from tripod.engine.rollout.moe_decoder import MoEDecoder
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import family_of, hf_to_megatron

    torch.set_num_threads(1)
    hf_dir = make_tiny_moe_model(tmp_path, family, seed=5, **overrides)
    arch = arch_from_hf(hf_dir)
    canon = hf_to_megatron(arch, load_file(os.path.join(hf_dir, "model.safetensors")))
    engine = make_rollout_engine("embedded", arch, None, pad_token_id=0)
    assert isinstance(engine.decoder, MoEDecoder)
    engine.load_weights({n: family_of(arch).shard(arch, n, t, 1, 0) for n, t in canon.items()})
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=7, greedy=True, ignore_eos=True))
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for i, p in enumerate(prompts):
        full = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=7, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.responses()[i] == full[0, len(p):].tolist(), (family, i)
        with torch.no_grad():
            logp = torch.log_softmax(ref(full).logits[0, len(p) - 1:-1].float(), -1)
        want = logp.gather(-1, full[0, len(p):, None])[:, 0]
        torch.testing.assert_close(out.log_probs[i, :7], want, atol=1e-5, rtol=0)


PLAN_CASES = [  # (tp, pp, dp, ep, etp, rollout tp)
    (1, 1, 2, 2, 1, 1), (2, 1, 2, 2, 1, 2), (2, 1, 2, 2, 1, 1), (2, 2, 2, 2, 2, 2), (2, 2, 2, 2, 2, 1),
    (2, 1, 4, 4, 1, 2), (4, 1, 2, 2, 2, 2), (2, 2, 2, 4, 1, 1),
]


def _coverage(plan) -> None:
    """Simulate the exchange on index tensors: every element of every rank's generation shard is written exactly
    once, with the element of the global tensor that belongs there (its rollout-TP slice), from a rank that holds it
    in training, and sender and receiver enumerate the same segments."""
    from tripod.parallel.families.spec import shard

    lay, shapes = plan.expert_layout, plan.generation_shapes()
    specs = {s.name: s for s in plan.expert_specs}
    index = {n: torch.arange(torch.Size(s.global_shape).numel()).view(s.global_shape) for n, s in specs.items()}
    for rank in range(plan.world_size):
        gen = {n: torch.full(shapes[n], -1) for n in specs}
        count = {n: torch.zeros(shapes[n], dtype=torch.int32) for n in specs}
        for src, segs in plan.expert_recv(rank).items():
            sent = plan.expert_send(src).get(rank, []) if src != rank else segs
            assert [(s.name, s.src_slices) for s in sent] == [(s.name, s.src_slices) for s in segs]
            for seg in segs:
                spec = specs[seg.name]
                assert lay.owns(src, spec.expert, spec.stage)
                piece = shard(spec.rule, index[seg.name], lay.etp, lay.coords(src)[0])  # src's training piece
                gen[seg.name][seg.dst_slices] = piece[seg.src_slices]
                count[seg.name][seg.dst_slices] += 1
        j = plan.rollout_tp_rank(rank)
        for n, spec in specs.items():
            assert torch.all(count[n] == 1), f"rank {rank}: {n} written {int(count[n].min())}..{int(count[n].max())}x"
            assert torch.equal(gen[n], shard(spec.rule, index[n], plan.rollout_tp, j)), f"rank {rank}: {n} misplaced"


@pytest.mark.parametrize("tp,pp,dp,ep,etp,tg", PLAN_CASES)
def test_expert_plan_delivers_each_element_once_and_counts_bytes(tp, pp, dp, ep, etp, tg):
    from tripod.parallel.hybrid_engine.plan import build_reshard_plan

    arch = _arch("deepseek_v3")
    plan = build_reshard_plan(arch, tp, pp, dp, tg, ep=ep, etp=etp, bucket_bytes=4096)
    assert plan.expert_specs and all(s.expert is not None for s in plan.expert_specs)
    _coverage(plan)
    need = sum(torch.Size(plan.generation_shapes()[s.name]).numel() for s in plan.expert_specs) * 4
    for rank in range(plan.world_size):
        held = sum(seg.numel for seg in plan.expert_recv(rank).get(rank, [])) * 4
        assert plan.expert_bytes_received(rank) == plan.expert_bytes_received_fast(rank) == need - held
        assert plan.bytes_received(rank) == plan.bytes_received(rank, fast=True)


def test_planted_overlap_bug_fails_the_coverage_check(monkeypatch):
    from tripod.parallel.hybrid_engine import experts
    from tripod.parallel.hybrid_engine import plan as plan_mod

    original = experts.overlap_segments.__wrapped__

    def off_by_one_rank(rule, shape, a, etp, j, tg):  # the rollout slice index shifted by one
        return original(rule, shape, a, etp, (j + 1) % tg, tg)

    monkeypatch.setattr(plan_mod, "overlap_segments", off_by_one_rank)
    plan = plan_mod.build_reshard_plan(_arch("deepseek_v3"), 2, 1, 2, 2, ep=2, etp=1)
    monkeypatch.setattr(plan_mod, "overlap_segments", lambda *a: original(*a))
    _coverage(plan)  # the correct geometry passes
    monkeypatch.setattr(plan_mod, "overlap_segments", off_by_one_rank)
    with pytest.raises(AssertionError):
        _coverage(plan)


def test_expert_plan_refusals_name_the_key():
    from tripod.parallel.hybrid_engine.plan import ReshardPlanError, build_reshard_plan

    arch = _arch("deepseek_v3")
    with pytest.raises(ReshardPlanError, match="expert_model_parallel_size=3"):
        build_reshard_plan(arch, 2, 1, 3, 1, ep=3, etp=1)
    with pytest.raises(ReshardPlanError, match="rollout.tensor_model_parallel_size=.*expert intermediate size"):
        build_reshard_plan(_arch("deepseek_v3", moe_intermediate_size=30), 4, 1, 1, 4, ep=1, etp=1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sglang_backend_sends_the_checkpoint_names(tmp_path, family):
    """The SGLang backend pushes full HF tensors under the names `save_pretrained` writes: per-expert
    `mlp.experts.{e}.{gate,up,down}_proj.weight` (SGLang's qwen3_moe / qwen2_moe / deepseek_v2 `load_weights` map
    them with FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ...)), the router as
    `mlp.gate.weight` (+ `e_score_correction_bias`), and bit-identical values. A layer's q_a_proj and
    kv_a_proj_with_mqa share a bucket (SGLang fuses them inside one load_weights call). sglang itself needs a GPU."""
    import re

    from safetensors.torch import load_file

    from tripod.engine.rollout.weight_sync import gather_bucket_full, hf_buckets
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import family_of, hf_to_megatron

    hf_dir = make_tiny_moe_model(tmp_path, family, seed=2)
    arch = arch_from_hf(hf_dir)
    disk = load_file(os.path.join(hf_dir, "model.safetensors"))
    shard = {n: family_of(arch).shard(arch, n, t, 1, 0) for n, t in hf_to_megatron(arch, disk).items()}
    sent: dict[str, torch.Tensor] = {}
    buckets = hf_buckets(arch, shard, 1, bucket_bytes=8 << 10)  # small: many bucket boundaries
    for bucket in buckets:
        for hf_name, tensor in gather_bucket_full(arch, bucket, shard, None, 1):
            assert hf_name not in sent
            sent[hf_name] = tensor
    assert sent.keys() == disk.keys()
    assert all(torch.equal(sent[k], disk[k]) for k in disk)
    experts = [k for k in sent if ".mlp.experts." in k]
    assert experts and all(re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", k)
                           and int(k.split(".")[5]) < arch.moe.num_experts for k in experts)
    if arch.mla is not None:
        for bucket in buckets:
            for name in bucket:
                if ".linear_q_down_proj." in name:
                    assert name.replace("linear_q_down_proj", "linear_kv_down_proj") in bucket


def test_target_char_reward_is_the_share_of_the_target_character():
    from tripod.engine.rewards import get_reward_fn

    fn = get_reward_fn("target_char")
    assert fn("7a77", "7") == 0.75 and fn("", "7") == 0.0 and fn("abc", "7") == 0.0
    with pytest.raises(ValueError, match="one character"):
        fn("77", "77")
