"""MoE routing replay (R3 / R2, parallel/router_replay.py) on a tiny Qwen3-MoE and a tiny DeepSeek-V3-like model:
the embedded engine generates in bf16 recording each token's experts, a bf16 megatron actor at EP2, PP2 (shared-prompt
packing), TP2 with sequence parallelism and DP2 with padding-free packing routes some tokens differently without replay (`moe/routing_mismatch_frac` > 0), none with it, and its log-probs come
closer to the rollout's; the trainer's own record replayed (R2) reproduces its forward exactly; an update under replay
still trains the router; a planted bug (layer i's ids replayed into layer i+1) is caught; a record shifted by one
token (each token replayed with the next token's experts) keeps the mismatch at 0 and is caught by
`moe/replay_live_mismatch_frac`; with an fp32 engine and
an fp32 actor R2's record equals R3's. One 2-rank world (tests/multiprocess/workers/routing_replay_check.py).

The tiny models' routers are scaled down (x0.2) and their experts up (x3): near-tied router scores, as the issue
reports them in real MoE models, so bf16 rounding does flip some choices (about 1% of tokens per layer here), and a
flip changes a token's output enough to see in its log-prob."""
import re

import pytest
import torch

from tests.helpers.moe_models import hf_moe_model


def near_tied_moe_model(tmp, family: str, seed: int) -> str:
    model = hf_moe_model(family, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(0.2)
            elif ".mlp.experts." in name:
                p.mul_(3.0)
    out = str(tmp / f"{family}_near_tied")
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    from tests.helpers.common import run_torchrun

    tmp = tmp_path_factory.mktemp("routing_replay")
    dirs = [near_tied_moe_model(tmp, "qwen3_moe", 3), near_tied_moe_model(tmp, "deepseek_v3", 4)]
    return run_torchrun("routing_replay_check.py", 2, *dirs, timeout=900).stdout


def _values(out: str, quantity: str) -> dict[tuple[str, str], float]:
    return {(m, lay): float(v) for m, lay, v in re.findall(rf"^RR (\S+) (\S+) {quantity} (\S+)$", out, re.M)}


def test_replay_closes_the_routing_gap(output):
    assert "RR-OK" in output, output[-3000:]
    free, replay = _values(output, "mismatch_without_replay"), _values(output, "mismatch_with_replay")
    g_free, g_replay = _values(output, "gap_without_replay"), _values(output, "gap_with_replay")
    assert len(free) == 8 and set(free) == set(replay) == set(g_free) == set(g_replay), output[-3000:]
    for key in free:
        assert free[key] > 0 and replay[key] == 0 and g_replay[key] < g_free[key], (key, free, replay, g_free, g_replay)
    planted = _values(output, "planted_mismatch")
    assert len(planted) == 8 and all(v > 0 for v in planted.values()), planted
    # a record shifted by one token (the reference with it): invisible to routing_mismatch_frac, not to the replayed
    # ids vs the live router's choice of the same token (moe/replay_live_mismatch_frac)
    live, shifted = _values(output, "live_mismatch_with_replay"), _values(output, "token_shift_live_mismatch")
    blind = _values(output, "token_shift_mismatch")
    print(f"replay_live_mismatch_frac aligned: max {max(live.values()):.4f}; shifted one token: min "
          f"{min(shifted.values()):.4f} (routing_mismatch_frac shifted: max {max(blind.values())})")
    assert set(live) == set(shifted) == set(blind) == set(free), output[-3000:]
    assert all(v == 0 for v in blind.values()), blind
    assert max(live.values()) < 0.05 and min(shifted.values()) > 0.3, (live, shifted)


def test_r2_is_the_trainers_own_routing(output):
    assert len(_values(output, "r2_vs_unreplayed_maxdiff")) == 8
    assert all(v == 0 for v in _values(output, "r2_vs_unreplayed_maxdiff").values())
    assert len(re.findall(r"^RR \S+ fp32 mismatch 0\.0 r2_vs_r3_maxdiff 0\.0$", output, re.M)) == 2, output[-3000:]
    assert all(v > 0 for v in _values(output, "router_weight_moved").values())


def test_replay_with_expert_tensor_parallel_and_virtual_stages(tmp_path):
    """4 ranks: ETP2 (experts split over 2 ranks that run attention as DP ranks) and PP2 with 2 virtual stages
    (tests/multiprocess/workers/routing_replay_layouts_check.py: the checks above, the planted layer shift too)."""
    from tests.helpers.common import run_torchrun

    out = run_torchrun("routing_replay_layouts_check.py", 4, near_tied_moe_model(tmp_path, "qwen3_moe", 3),
                       timeout=600).stdout
    assert "RRL-OK" in out, out[-3000:]
    for quantity, ok in (("mismatch_without_replay", lambda v: v > 0), ("mismatch_with_replay", lambda v: v == 0),
                         ("planted_mismatch", lambda v: v > 0), ("r2_vs_unreplayed_maxdiff", lambda v: v == 0),
                         ("router_weight_moved", lambda v: v > 0)):
        values = _values(out, quantity)
        assert set(values) == {("qwen3_moe", "ETP2"), ("qwen3_moe", "VPP2")} and all(map(ok, values.values())), \
            (quantity, values)

