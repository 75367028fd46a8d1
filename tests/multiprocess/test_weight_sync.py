"""engine/rollout/weight_sync.py: the rollout life cycle owned in one place, the zero-copy generation shard, and the
payload the SGLang backend pushes (engine/rollout/sglang_buckets.py: full HF tensors, bucket by bucket, flattened
per dtype)."""
import re

import pytest
import torch

from tests.helpers.common import make_tiny_hf_model, run_torchrun


def test_flatten_by_dtype_round_trip_mixed_dtypes():
    from tripod.engine.rollout.sglang_buckets import flatten_by_dtype, unflatten

    g = torch.Generator().manual_seed(2)
    named = [("a", torch.randn(3, 4, generator=g)), ("b", torch.randn(5, generator=g).to(torch.bfloat16)),
             ("c", torch.randn(2, 2, 2, generator=g)), ("d", torch.randn(7, 3, generator=g).to(torch.bfloat16))]
    groups = flatten_by_dtype(named)
    assert set(groups) == {torch.float32, torch.bfloat16}
    assert groups[torch.float32][0].numel() == 12 + 8 and groups[torch.bfloat16][0].numel() == 5 + 21
    back = dict(kv for flat, meta in groups.values() for kv in unflatten(flat, meta))
    for name, t in named:
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


@pytest.mark.dist
def test_weight_sync_lifecycle_alias_and_sglang_buckets(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", seed=3, num_hidden_layers=2)
    out = run_torchrun("weight_sync_worker.py", 2, hf_dir, timeout=400).stdout
    for check in ("lifecycle", "alias", "error", "buckets"):
        assert len(re.findall(rf"WS {check} ok rank=\d", out)) == 2, (check, out[-3000:])
