"""Expert parallelism in ParallelLayout: the groups equal megatron's own rank generators, the parallel_state
getters agree inside `activate()`, and layouts that cannot shard the experts are refused naming the key."""
import itertools
import re

import pytest

from tests.helpers.common import run_torchrun


def _megatron_groups(world, tp, pp, ep, etp):
    """Reference: megatron-core's RankGenerator, exactly as initialize_model_parallel calls it."""
    from megatron.core.parallel_state import RankGenerator

    dp = world // (tp * pp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    return {"tp": dense.get_ranks("tp"), "dp": dense.get_ranks("dp"), "pp": dense.get_ranks("pp"),
            "mp": dense.get_ranks("tp-pp"), "tp_dp": dense.get_ranks("tp-dp"),
            "expt_tp": expert.get_ranks("tp"), "ep": expert.get_ranks("ep"), "tp_ep": expert.get_ranks("tp-ep"),
            "tp_ep_pp": expert.get_ranks("tp-ep-pp"), "expt_dp": expert.get_ranks("dp"),
            # one distributed-optimizer instance: megatron concatenates every tp-ep-pp group into one
            "intra_dist_opt": [[r for g in expert.get_ranks("tp-ep-pp") for r in g]]}


def _canon(groups):
    return sorted(sorted(g) for g in groups)


SIZES = [(w, tp, pp, ep, etp) for w, tp, pp, ep, etp in itertools.product((1, 2, 4, 8, 16), (1, 2, 4), (1, 2, 4),
                                                                          (1, 2, 4, 8), (1, 2, 4))
         if w % (tp * pp) == 0 and (w // pp) % (ep * etp) == 0]


@pytest.mark.parametrize("world, tp, pp, ep, etp", SIZES)
def test_rank_groups_equal_megatrons_rank_generator(world, tp, pp, ep, etp):
    from tripod.parallel.layout import rank_groups

    ours = rank_groups(list(range(world)), tp, pp, world // (tp * pp), ep, etp)
    for kind, groups in _megatron_groups(world, tp, pp, ep, etp).items():
        assert _canon(ours[kind]) == _canon(groups), kind


CP_SIZES = [(w, tp, cp, pp) for w, tp, cp, pp in itertools.product((2, 4, 8, 16), (1, 2, 4), (2, 4), (1, 2))
            if w % (tp * cp * pp) == 0]


@pytest.mark.parametrize("world, tp, cp, pp", CP_SIZES)
def test_context_parallel_rank_groups_equal_megatrons_rank_generator(world, tp, cp, pp):
    """With context_parallel_size: tp, cp, dp, dp x cp (DDP's and the distributed optimizer's group), pp, tp x pp,
    tp x dp, tp x cp and tp x dp x cp are megatron's ("tp-cp-ep-dp-pp"), and so is the expert view (no cp in it)."""
    from megatron.core.parallel_state import RankGenerator

    from tripod.parallel.layout import rank_groups

    dp = world // (tp * cp * pp)
    ours = rank_groups(list(range(world)), tp, pp, dp, cp=cp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for kind, token in (("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("dp_cp", "dp-cp"), ("pp", "pp"), ("mp", "tp-pp"),
                        ("tp_dp", "tp-dp"), ("tp_cp", "tp-cp"), ("tp_dp_cp", "tp-dp-cp")):
        assert _canon(ours[kind]) == _canon(dense.get_ranks(token)), kind
    assert _canon(ours["expt_dp"]) == _canon(expert.get_ranks("dp"))


def test_rank_groups_catch_a_swapped_expert_order():
    """The comparison above can fail: ep-fastest ordering (a plausible slip) differs from megatron's."""
    from tripod.parallel.layout import rank_groups

    ours = rank_groups(list(range(8)), 2, 1, 4, ep=2, etp=2)
    ep_fastest = [[r, r + 1] for r in range(0, 8, 2)]  # what swapping etp and ep in the index would give
    assert _canon(ours["ep"]) != _canon(ep_fastest)
    assert _canon(ours["ep"]) == _canon(_megatron_groups(8, 2, 1, 2, 2)["ep"])


def _moe_arch(num_experts=6):
    from types import SimpleNamespace

    return SimpleNamespace(num_heads=4, num_kv_heads=2, num_layers=4, num_experts=num_experts)


@pytest.mark.parametrize("kwargs, arch, message", [
    (dict(ep=4), _moe_arch(6), "actor expert_model_parallel_size=4 does not divide num_experts=6; use one of [1, 2, 3, 6]"),
    (dict(ep=2), _moe_arch(0), "actor expert_model_parallel_size=2 but the model has no experts (a dense model); use 1"),
    (dict(ep=0), _moe_arch(6), "actor expert_model_parallel_size=0 must be a positive integer"),
    (dict(etp=0), _moe_arch(6), "actor expert_tensor_parallel_size=0 must be a positive integer"),
])
def test_expert_layout_refused_before_any_group(kwargs, arch, message):
    from tripod.parallel.layout import ParallelLayout

    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelLayout(name="actor", arch=arch, **kwargs)


@pytest.mark.dist
def test_expert_groups_seen_by_megatron():
    out = run_torchrun("expert_layout_worker.py", 4, timeout=300).stdout
    assert out.count("EXPERT_LAYOUT_OK") == 4, out[-3000:]
    assert out.count("EXPERT ") == 4 * 6
