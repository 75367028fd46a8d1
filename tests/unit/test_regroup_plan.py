"""Rollout TP that training TP does not divide (parallel/hybrid_engine/regroup.py), by pure arithmetic: the rollout
TP groups and their order, every generation element received exactly once, bytes == closed form, refusals."""
import pytest
import torch

from tripod.parallel.arch import arch_from_hf
from tripod.parallel.hybrid_engine import regroup
from tripod.parallel.hybrid_engine.plan import ReshardPlanError, build_reshard_plan


def tiny_arch(**kw):
    cfg = dict(model_type="qwen2", vocab_size=700, hidden_size=96, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=12, num_key_value_heads=12, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg.update(kw)
    return arch_from_hf(cfg)


LAYOUTS = [(1, 1, 2, 2), (2, 1, 2, 4), (1, 2, 1, 2), (1, 2, 2, 2), (2, 2, 2, 4), (2, 1, 3, 3), (3, 1, 2, 2),
           (1, 1, 4, 4), (2, 1, 3, 6)]


@pytest.mark.parametrize("tp,pp,dp,tg", LAYOUTS)
@pytest.mark.parametrize("local_order", [True, False])
def test_every_generation_element_arrives_exactly_once_from_a_rank_that_holds_it(tp, pp, dp, tg, local_order):
    plan = build_reshard_plan(tiny_arch(), tp, pp, dp, tg, bucket_bytes=4096, local_order=local_order)
    assert plan.p2p
    world = tp * pp * dp
    assert sorted(r for g in plan.rollout_tp_groups for r in g) == list(range(world))
    assert all(sorted(g) == list(range(min(g), min(g) + tg)) for g in plan.rollout_tp_groups)  # consecutive blocks
    if not local_order:
        assert all(g == sorted(g) for g in plan.rollout_tp_groups)
    shapes, owned = plan.generation_shapes(), {r: {s.name for s in plan.owned_specs(r)} for r in range(world)}
    for rank in range(world):
        cover = {n: torch.zeros(s, dtype=torch.int32) for n, s in shapes.items()}
        for src, segs in plan.dense_recv(rank).items():
            for seg in segs:
                assert seg.name in owned[src], (rank, src, seg.name)  # the source holds it in training
                cover[seg.name][seg.dst_slices] += 1
            if src != rank:
                assert plan.dense_send(src)[rank] == segs  # both ends enumerate the same segments
        for n, c in cover.items():
            assert torch.all(c == 1), (rank, n)
        closed = plan.bytes_received(rank, fast=True)
        assert plan.bytes_received(rank) == closed <= plan.generation_shard_bytes()
        for _, _, outs, ins in regroup.rounds_of(plan, rank):
            assert all(c.numel * plan.elem_size(c.dtype) <= plan.bucket_bytes // 2 for c in outs + ins)
    assert plan.max_bucket_bytes() <= plan.bucket_bytes


def test_the_local_order_puts_each_rollout_slice_inside_the_training_slice_its_rank_holds():
    plan = build_reshard_plan(tiny_arch(), 2, 1, 2, 4)
    assert plan.rollout_tp_groups == [[0, 2, 1, 3]]
    assert [plan.bytes_received(r) for r in range(4)] == [0, 0, 0, 0]
    ranked = build_reshard_plan(tiny_arch(), 2, 1, 2, 4, local_order=False)  # vLLM / SGLang: slice j on rank j
    assert ranked.rollout_tp_groups == [[0, 1, 2, 3]]
    assert [ranked.bytes_received(r) > 0 for r in range(4)] == [False, True, True, False]
    # TP1 -> TP2 (NeMo-RL's layout): every rank holds whole tensors, the rank order is already local
    plan = build_reshard_plan(tiny_arch(), 1, 1, 4, 2)
    assert plan.rollout_tp_groups == [[0, 1], [2, 3]] and plan.bytes_received(3) == 0


def test_pp_stages_receive_the_other_stages_generation_slices():
    plan = build_reshard_plan(tiny_arch(), 1, 2, 1, 2)
    for rank in range(2):
        other = sum(torch.Size(s).numel() * 4 for n, s in plan.generation_shapes().items()
                    if next(x for x in plan.specs if x.name == n).stage != rank)
        assert plan.bytes_received(rank) == plan.bytes_received(rank, fast=True) == other


def test_neither_divides_the_other_straddling_slice_takes_half_its_shard():
    plan = build_reshard_plan(tiny_arch(), 2, 1, 3, 3)  # slice 1 of 3 straddles training slices 0 and 1
    assert plan.rollout_tp_groups == [[0, 2, 1], [4, 5, 3]]
    for rank in range(6):
        got = plan.bytes_received(rank)
        if plan.rollout_tp_rank(rank) == 1:
            _, sharded = plan.stage_dense_bytes(0)
            assert got == sharded // 6  # the half of a third it does not hold
        else:
            assert got == 0


def test_the_tg_divides_t_path_is_unchanged():
    plan = build_reshard_plan(tiny_arch(num_key_value_heads=4, num_attention_heads=4), 2, 2, 1, 2)
    assert not plan.p2p and plan.micro_dp_groups == [[0, 2], [1, 3]] and plan.rollout_tp_groups == [[0, 1], [2, 3]]


@pytest.mark.parametrize("kw,msg", [
    (dict(tp=2, pp=1, dp=1, rollout_tp=4), "tensor_model_parallel_size=4 must divide the world size TP*PP*DP=2"),
    (dict(tp=2, pp=1, dp=3, rollout_tp=3, arch=dict(vocab_size=300)),
     "tensor_model_parallel_size=3 must divide the padded vocabulary 512"),
    (dict(tp=2, pp=1, dp=3, rollout_tp=3, arch=dict(intermediate_size=100)),
     "tensor_model_parallel_size=3 must divide the split size 100 of linear_fc1"),
    (dict(tp=2, pp=1, dp=4, rollout_tp=8), "tensor_model_parallel_size=8 must divide num_attention_heads=12"),
])
def test_rollout_tp_the_regrouping_cannot_serve_is_refused_naming_the_key(kw, msg):
    arch = tiny_arch(**kw.pop("arch", {}))
    with pytest.raises(ReshardPlanError) as e:
        build_reshard_plan(arch, **kw)
    assert msg in str(e.value) and "actor_rollout_ref.rollout." in str(e.value)


@pytest.mark.parametrize("tp,pp,dp,tg", LAYOUTS)
@pytest.mark.parametrize("local_order", [True, False])
def test_replaying_the_plan_on_numbered_tensors_gives_each_rank_its_rollout_slice(tp, pp, dp, tg, local_order):
    """Every element numbered uniquely, each rank's training shard cut the megatron way, the plan's segments copied
    from their source ranks: each rank ends with exactly the rollout TP slice it is assigned (catches a wrong source
    rank or slice bound that the coverage count alone would not)."""
    from tripod.parallel.families.spec import shard

    plan = build_reshard_plan(tiny_arch(), tp, pp, dp, tg, bucket_bytes=4096, local_order=local_order)
    full, base = {}, 0
    for s in plan.specs:
        n = torch.Size(s.global_shape).numel()
        full[s.name] = torch.arange(base, base + n, dtype=torch.float64).view(s.global_shape)
        base += n
    world = tp * pp * dp
    train = {r: {s.name: shard(s.rule, full[s.name], tp, plan.train_coords(r)[0]) for s in plan.owned_specs(r)}
             for r in range(world)}
    for rank in range(world):
        gen = {n: torch.full(s, -1.0, dtype=torch.float64) for n, s in plan.generation_shapes().items()}
        for src, segs in plan.dense_recv(rank).items():
            for seg in segs:
                gen[seg.name][seg.dst_slices] = train[src][seg.name][seg.src_slices]
        j = plan.rollout_tp_rank(rank)
        for s in plan.specs:
            assert torch.equal(gen[s.name], shard(s.rule, full[s.name], tg, j)), (rank, s.name)
