"""Uneven pipeline stages (megatron's num_layers_in_first/last_pipeline_stage, parallel/stages.py): the split is
megatron's, what it refuses megatron refuses too, and the reshard plan, memory plan and config read the same split."""
import itertools

import pytest

from tests.helpers.common import REPO_ROOT
from tripod.parallel.stages import StageSplit

MEG = "actor_rollout_ref.actor.megatron."


def _arch(layers=7, **kw):
    from tripod.parallel.arch import arch_from_hf

    cfg = dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg.update(kw)
    return arch_from_hf(cfg)


@pytest.mark.parametrize("split,sizes", [
    (StageSplit(7, 3, 1, 2, 2), [2, 3, 2]),
    (StageSplit(61, 16, 1, 1, 4), [1] + [4] * 15),            # DeepSeek-V3 at PP16 (verl's 80 GB recipe)
    (StageSplit(61, 12, 1, 6, 5), [6] + [5] * 11),            # DeepSeek-V3 at PP12
    (StageSplit(8, 3, 1, None, 2), [3, 3, 2]),
    (StageSplit(8, 3, 1, 2, None), [2, 3, 3]),
    (StageSplit(8, 2), [4, 4]),
])
def test_stage_sizes_and_contiguous_layers(split, sizes):
    assert split.stage_sizes() == sizes
    layers = [split.stage_layers(r) for r in range(split.pp)]
    assert [i for stage in layers for i in stage] == list(range(split.num_layers))  # contiguous, in order
    assert [split.stage_of_layer[i] for i in range(split.num_layers)] == [r for r, n in enumerate(sizes)
                                                                           for _ in range(n)]


def test_interleaved_uneven_stages_follow_megatron():
    split = StageSplit(12, 3, 2, 2, 2)  # each chunk of the first / last stage holds 1 layer, middle chunks 4
    assert [[list(split.layers(r, v)) for v in range(2)] for r in range(3)] == [
        [[0], [6]], [[1, 2, 3, 4], [7, 8, 9, 10]], [[5], [11]]]


def _megatron_refuses(L, pp, vpp, first, last) -> bool:
    """megatron's TransformerConfig refuses the split, or its layer arithmetic fails on some stage (0.16.1 divides by
    the number of middle stages in the interleaved offset: PP2 x VPP with both ends set), or leaves a stage empty."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        config = TransformerConfig(num_layers=L, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
                                   pipeline_dtype=torch.float32,
                                   virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                   num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
        built = []
        for r, v in itertools.product(range(pp), range(vpp) if vpp > 1 else [None]):
            offset = get_transformer_layer_offset(config, vp_stage=v, pp_rank=r)
            built.append(range(offset, offset + get_num_layers_to_build(config, vp_stage=v, pp_rank=r)))
    except (ValueError, AssertionError, ZeroDivisionError):
        return True
    # megatron 0.16.1 accepts e.g. 4 layers at PP3 as 1 / -1 / 4: a stage that would be empty counts as refused
    return min(len(b) for b in built) < 1 or sorted(i for b in built for i in b) != list(range(L))


def test_refuses_what_megatron_refuses():
    """Every uneven split of 4..9 layers over PP2..4 (x VPP 1, 2): `problems()` is empty exactly when megatron's
    TransformerConfig accepts it, and an accepted split places every layer once."""
    checked = 0
    for L, pp, vpp, first, last in itertools.product(range(4, 10), (2, 3, 4), (1, 2), (None, 1, 2, 3),
                                                     (None, 1, 2, 4)):
        if first is None and last is None:
            continue
        split = StageSplit(L, pp, vpp, first, last)
        assert bool(split.problems()) == _megatron_refuses(L, pp, vpp, first, last), (split, split.problems())
        if not split.problems():
            assert sorted(i for r in range(pp) for i in split.stage_layers(r)) == list(range(L)), split
        checked += 1
    assert checked > 500


@pytest.mark.parametrize("split,line", [
    (StageSplit(7, 2, 1, 2, 2), f"{MEG}num_layers_in_first_pipeline_stage=2 + num_layers_in_last_pipeline_stage=2 = 4 "
                                "must sum to num_hidden_layers=7"),
    (StageSplit(8, 4, 1, 1, 2), f"{MEG}num_layers_in_first_pipeline_stage=1 + num_layers_in_last_pipeline_stage=2 "
                                "leave 5 of num_hidden_layers=8 layers for the 2 middle stage(s)"),
    (StageSplit(7, 3, 1, 7, None), "leave 0 of num_hidden_layers=7 layers for the 2 middle stage(s)"),
    (StageSplit(7, 1, 1, 2, None), f"need {MEG}pipeline_model_parallel_size >= 2 (it is 1); set them to null"),
    (StageSplit(7, 3, 1, 0, 2), f"{MEG}num_layers_in_first_pipeline_stage=0 must be a positive integer"),
    (StageSplit(7, 3), f"{MEG}pipeline_model_parallel_size=3 does not divide num_hidden_layers=7; use one of [1, 7], "
                       f"or set {MEG}num_layers_in_first_pipeline_stage"),
])
def test_bad_splits_give_one_line_naming_the_key(split, line):
    problems = split.problems(MEG)
    assert len(problems) == 1 and line in problems[0], problems
    assert "\n" not in problems[0]


def test_reshard_plan_places_layers_by_the_uneven_split():
    from tripod.parallel.hybrid_engine.plan import ReshardPlanError, build_reshard_plan

    arch = _arch(7)
    plan = build_reshard_plan(arch, 1, 3, 1, 1, bucket_bytes=4096, first=2, last=2)
    owned = [sorted({int(s.name.split(".")[2]) for s in plan.owned_specs(r) if s.name.startswith("decoder.layers.")})
             for r in range(3)]
    assert owned == [[0, 1], [2, 3, 4], [5, 6]]
    assert "layers per stage 2/3/2" in plan.describe()
    got = [plan.bytes_received(r) for r in range(3)]
    for r in range(3):  # TP1 -> rollout TP1: each rank receives exactly the layers it does not hold
        own = sum(_numel(s.global_shape) for s in plan.owned_specs(r)) * 4
        assert got[r] == plan.generation_shard_bytes() - own
    assert sum(got) / 3 == pytest.approx(plan.bytes_received_ideal())  # HybridFlow's mean still holds
    with pytest.raises(ReshardPlanError, match="must sum to num_hidden_layers=7"):
        build_reshard_plan(arch, 1, 2, 1, 1, first=2, last=2)


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_memory_plan_counts_each_stage_by_its_layers():
    import torch

    from tripod.parallel.memory_plan import ModelMemory, activation_bytes, stage_numel

    arch = _arch(7)
    per_layer = stage_numel(arch, 1, 7)[3]  # a middle stage of PP7 holds exactly one layer
    uneven = stage_numel(arch, 1, 3, first=2, last=2)
    even_ends = stage_numel(arch, 1, 7)
    assert uneven[1] == 3 * per_layer
    assert uneven[0] == even_ends[0] + per_layer and uneven[2] == even_ends[-1] + per_layer
    assert sum(uneven) == sum(stage_numel(arch, 1, 1))
    m = ModelMemory("actor", 1, 3, 1, torch.float32, True, first=2, last=2).compute(arch)
    assert m.numel == max(uneven) and "(first 2, last 2)" in m.layout
    # activations of one micro-batch: the 3-layer middle stage is the largest (no embedding, no head), one layer more
    # than the 2-layer last stage
    from tripod.parallel.activation_plan import ActivationLayout, layer_bytes

    layer = layer_bytes(arch, ActivationLayout(), 0, 2, 32, 4, True)
    middle = activation_bytes(arch, 1, 3, 2, 32, torch.float32, first=2, last=2)
    assert middle == 3 * layer
    assert activation_bytes(arch, 1, 7, 2, 32, torch.float32) < 2 * layer  # one layer a stage


def test_config_keys_reach_the_plans_and_the_reference_follows_the_actor():
    from tripod.engine.config import load_config
    from tripod.parallel.hybrid_engine import reshard_plan_from_config
    from tripod.parallel.memory_plan import plan_from_config

    cfg = load_config(str(REPO_ROOT / "recipes" / "defaults.yaml"),
                      [f"{MEG}pipeline_model_parallel_size=3", f"{MEG}num_layers_in_first_pipeline_stage=2",
                       f"{MEG}num_layers_in_last_pipeline_stage=2", "actor_rollout_ref.actor.use_kl_loss=true",
                       "critic.megatron.num_layers_in_last_pipeline_stage=3", "critic.megatron.pipeline_model_parallel_size=2",
                       "critic.megatron.num_layers_in_first_pipeline_stage=4", "trainer.n_gpus_per_node=3"])
    ref = cfg.actor_rollout_ref.ref.megatron
    assert (ref.num_layers_in_first_pipeline_stage, ref.num_layers_in_last_pipeline_stage) == (2, 2)
    arch = _arch(7)
    assert reshard_plan_from_config(cfg, 3, arch).stages == StageSplit(7, 3, 1, 2, 2)
    models = {m.name: m for m in plan_from_config(cfg, 3, arch).models}
    assert (models["actor"].first, models["reference"].last, models["critic"].first, models["critic"].last) == \
        (2, 2, 4, 3)
