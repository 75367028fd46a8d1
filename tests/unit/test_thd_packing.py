"""THD packing for Transformer Engine (engine/workers/packing.py's `pack_thd`, parallel/model.py's
`packed_seq_params`): the `cu_seqlens` handed to TE describe exactly the blocks of tripod's block-diagonal causal mask
for the same layout, every row's tokens sit at RoPE positions 0..len-1 of their sequence (what megatron's THD RoPE
applies from cu_seqlens), and the outputs read back predict each response token from the row's own earlier tokens.
A cu_seqlens off by one at a boundary must be caught by the same comparison. CPU only: the TE forward is unrun here."""
import pytest
import torch

from tripod.engine.workers.batch import build_ppo_batch
from tripod.engine.workers.packing import pack_thd, pack_without_padding
from tripod.parallel.model import packed_seq_params


def _batch(seed: int, rows: int = 7, resp_len: int = 6):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 100, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    prompts[1] = prompts[0]  # a shared prompt: THD still runs it once per row (a THD sequence sees only itself)
    responses = [torch.randint(3, 100, (int(torch.randint(1, resp_len + 1, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(rows)]
    return build_ppo_batch(prompts, responses, resp_len, 0, list(range(rows)))


def visible_from_cu_seqlens(cu: torch.Tensor, seq: int) -> torch.Tensor:
    """[S, S] bool, True where query slot q may attend to key slot k under THD: same sequence, k <= q."""
    seg = torch.bucketize(torch.arange(seq), cu[1:].long(), right=True)  # sequence index of each slot
    slots = torch.arange(seq)
    return (seg[:, None] == seg[None, :]) & (slots[None, :] <= slots[:, None])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_cu_seqlens_describe_the_block_diagonal_mask(seed):
    batch = _batch(seed)
    packed = pack_thd(batch, with_mask=True)
    cu, s = packed.cu_seqlens, packed.seq
    tokens = batch["attention_mask"].sum(-1)
    assert packed.input_ids.shape == (1, int(tokens.sum())) and cu.dtype == torch.int32
    assert cu.tolist() == [0] + tokens.cumsum(0).tolist()  # one sequence per row, in row order, no padding
    assert torch.equal(visible_from_cu_seqlens(cu, s), ~packed.mask[0, 0])  # the same blocks, slot for slot
    for i in range(batch.size):  # RoPE positions restart at every boundary, as megatron's THD path applies them
        a, b = int(cu[i]), int(cu[i + 1])
        assert packed.positions[0, a:b].tolist() == list(range(b - a))
    ids, lens = batch["input_ids"], batch["prompt_lens"]
    for i in range(batch.size):  # each response token is read from the slot holding the row's token before it
        for t in range(int(tokens[i]) - int(lens[i])):
            slot = int(packed.gather[i, t])
            assert int(cu[i]) <= slot < int(cu[i + 1])
            assert packed.input_ids[0, slot] == ids[i, int(lens[i]) + t - 1]
    # the production layout carries no mask (TE does not read one) but the same tokens, positions and reads
    bare = pack_thd(batch)
    assert bare.mask is None and torch.equal(bare.cu_seqlens, cu) and torch.equal(bare.input_ids, packed.input_ids)
    assert torch.equal(bare.positions, packed.positions) and torch.equal(bare.gather, packed.gather)


@pytest.mark.parametrize("seed", [0, 1])
def test_planted_off_by_one_is_caught(seed):
    """A boundary moved by one slot (either way, at any boundary) no longer describes the mask."""
    packed = pack_thd(_batch(seed), with_mask=True)
    want = ~packed.mask[0, 0]
    for k in range(1, len(packed.cu_seqlens) - 1):
        for shift in (-1, 1):
            bad = packed.cu_seqlens.clone()
            bad[k] += shift
            assert not torch.equal(visible_from_cu_seqlens(bad, packed.seq), want), (k, shift)


def test_padding_to_a_longer_row_adds_one_sequence():
    """run() pads a micro-batch (sequence parallel: to a multiple of TP): the extra slots become a last sequence."""
    packed = pack_thd(_batch(5))
    wide = packed.padded_to(packed.seq + 3)
    assert wide.mask is None and wide.cu_seqlens.tolist() == packed.cu_seqlens.tolist() + [packed.seq + 3]
    assert torch.equal(wide.gather, packed.gather)  # one row: the flat indices do not move
    assert wide.positions[0, packed.seq:].tolist() == list(range(packed.seq, packed.seq + 3))


def test_packed_seq_params_only_for_transformer_engine():
    batch = _batch(2)
    packed = pack_thd(batch)
    params = packed_seq_params(packed, use_te=True)
    cu = packed.cu_seqlens
    longest = int((cu[1:] - cu[:-1]).max())
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
    assert torch.equal(params.cu_seqlens_q, cu) and torch.equal(params.cu_seqlens_kv, cu)
    assert params.max_seqlen_q == params.max_seqlen_kv == longest == int(batch["attention_mask"].sum(-1).max())
    assert packed_seq_params(packed, use_te=False) is None  # the local spec reads the explicit mask instead
    assert packed_seq_params(pack_without_padding(batch, False), use_te=True) is None  # no cu_seqlens: no THD
    assert packed_seq_params(None, use_te=True) is None
