"""Shared-prompt packing (engine/workers/packing.py): the layout itself on random batches, and the packed model
against the unpacked one (log-probs, entropy, values, losses, grad norms, log-probs after an update) on DP2, PP2 and
TP2 + sequence parallel, with a planted mask leak that the same comparison must catch (tests/multiprocess/workers/packing_check.py)."""
import re

import pytest
import torch

from tests.helpers.common import make_tiny_hf_model, run_torchrun
from tripod.engine.workers.batch import build_ppo_batch
from tripod.engine.workers.packing import first_fit_rows, pack_shared_prompts, pack_without_padding, prompt_groups


def _random_batch(seed: int, copies=(4, 1, 3), resp_len=6):
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for k in copies:
        p = torch.randint(3, 100, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(k):
            prompts.append(p)
            responses.append(torch.randint(3, 100, (int(torch.randint(1, resp_len + 1, (1,), generator=g)),),
                                           generator=g).tolist())
    order = torch.randperm(len(prompts), generator=g).tolist()
    return build_ppo_batch([prompts[i] for i in order], [responses[i] for i in order], resp_len, 0, order)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_layout_reproduces_every_row(seed):
    """Every row's tokens, the keys each of its tokens sees (as relative RoPE positions) and the output slot that
    predicts each response token, read back from the packed layout, equal those of the unpacked row."""
    batch = _random_batch(seed)
    packed = pack_shared_prompts(batch)
    assert packed is not None and packed.input_ids.shape[0] == len(prompt_groups(batch)) == 3
    s = packed.seq
    ids, lens = batch["input_ids"], batch["prompt_lens"]
    for i in range(batch.size):
        n_tok = int(batch["attention_mask"][i].sum())
        resp_n = n_tok - int(lens[i])
        pred = packed.gather[i]
        g = int(pred[0]) // s
        slots = (pred % s).tolist()
        for t in range(resp_n):
            # the slot predicting response token t holds token t-1 of the row (or the last prompt token)
            want = ids[i, int(lens[i]) + t - 1]
            assert packed.input_ids[g, slots[t]] == want
            visible = (~packed.mask[g, 0, slots[t]]).nonzero().squeeze(-1)
            got = packed.input_ids[g, visible].tolist()
            assert got == ids[i, : int(lens[i]) + t].tolist()  # exactly the row's tokens before it, in order
            rel = (packed.positions[slots[t]] - packed.positions[visible]).tolist()
            assert rel == list(range(int(lens[i]) + t - 1, -1, -1))  # the same relative RoPE positions
    unique = _random_batch(seed, copies=(1, 1, 1))
    assert pack_shared_prompts(unique) is None  # nothing shared: the plain layout is kept


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_padding_free_layout_reproduces_every_row(seed, share):
    """use_remove_padding: every row's tokens, the keys each token sees and their RoPE positions (absolute: those of
    the unpacked row) read back from the packed rows equal the unpacked row's; slots only pad at row tails; rows
    are no longer than the longest unit and hold several units."""
    batch = _random_batch(seed, copies=(4, 1, 3, 1, 2, 1))
    ids, lens = batch["input_ids"], batch["prompt_lens"]
    units = prompt_groups(batch) if share else [[i] for i in range(batch.size)]
    resp = batch["response_mask"].sum(-1)
    unit_lens = [int(lens[u[0]]) + sum(int(resp[i]) for i in u) for u in units]
    packed = pack_without_padding(batch, share)
    if not share and sorted(unit_lens)[0] + sorted(unit_lens)[1] > max(unit_lens):
        assert packed is None  # no two rows fit in the longest: the plain rows are as good
        return
    assert packed is not None
    s = packed.seq
    assert s == max(unit_lens) and packed.input_ids.shape[0] < len(units)
    real = packed.input_ids != 0  # _random_batch's tokens are >= 3; pads are 0
    assert int(real.sum()) == sum(unit_lens)  # every token once: the prompt once per unit, no padding inside
    assert all(r[: int(r.sum())].all() for r in real)  # padding only at a row's tail
    for i in range(batch.size):
        n_tok = int(batch["attention_mask"][i].sum())
        for t in range(n_tok - int(lens[i])):
            g, slot = divmod(int(packed.gather[i, t]), s)
            assert packed.input_ids[g, slot] == ids[i, int(lens[i]) + t - 1]
            assert packed.positions[g, slot] == int(lens[i]) + t - 1  # the unpacked row's own position
            visible = (~packed.mask[g, 0, slot]).nonzero().squeeze(-1)
            assert packed.input_ids[g, visible].tolist() == ids[i, : int(lens[i]) + t].tolist()
            assert packed.positions[g, visible].tolist() == list(range(int(lens[i]) + t))
    assert pack_without_padding(_random_batch(seed, copies=(1,)), share) is None  # one row: nothing to pack


def test_first_fit_rows():
    assert first_fit_rows([5, 9, 4, 3], 9) == [[1], [0, 2], [3]]
    assert sorted(u for row in first_fit_rows([2] * 7, 4) for u in row) == list(range(7))


def test_padded_packing_keeps_rows_and_gathers(seed=3):
    batch = _random_batch(seed)
    packed = pack_shared_prompts(batch)
    wide = packed.padded_to(packed.seq + 5)
    s, w = packed.seq, wide.seq
    assert torch.equal(wide.input_ids[:, :s], packed.input_ids) and torch.equal(wide.mask[:, :, :s, :s], packed.mask)
    assert torch.equal(wide.gather // w, packed.gather // s) and torch.equal(wide.gather % w, packed.gather % s)
    assert wide.mask[:, 0, :s, s:].all()  # the original slots never see the added pads
    assert not wide.mask[:, 0].all(-1).any()  # no query row is fully masked


@pytest.mark.dist
def test_packed_model_equals_unpacked_and_catches_a_planted_leak(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", vocab_size=96, max_position_embeddings=128)
    out = run_torchrun("packing_check.py", 2, hf_dir, timeout=600).stdout
    # Both ranks print to one pipe, so a report can start mid-line: find them anywhere, not at line starts.
    reports = set(re.findall(r"PACK (\w+ \w+)", out))
    assert "planted" in {r.split()[0] for r in reports}, out[-3000:]
    for layout in ("DP2", "PP2", "TP2SP"):
        for variant in ("", "_RMPAD", "_RMPAD_SHARED"):  # shared-prompt packing; padding-free without / with
            assert f"{layout}{variant} logp_after" in reports, out[-3000:]
    assert "planted_rmpad" in {r.split()[0] for r in reports}, out[-3000:]
    for router in ("no_router_stats", "aux_loss", "bias_update"):  # MoE packing off when the router keeps stats
        assert f"moe {router}" in reports, out[-3000:]
