"""The rollout sync of a LoRA actor merges lazily (parallel/lora/merge.py): with 4 KiB buckets (an adapted weight of
the tiny model is up to 24 KiB on a TP2 rank) the generation shard equals the eager merge's bit for bit, at rollout TP1
(fp32 and bf16) and TP2 into the embedded engine's buffers, while at most one bucket of merged values and one adapted
weight's delta are alive at once; merging everything up front (the worker plants train_with_hooks.py's
lora_eager_merge) breaks the bound (tests/multiprocess/workers/lora_sync_worker.py)."""
import re

import pytest

from tests.helpers.common import make_tiny_hf_model, run_torchrun

BUCKET = 4096


@pytest.mark.dist
def test_lora_sync_merges_a_bucket_at_a_time(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", seed=5)
    out = run_torchrun("lora_sync_worker.py", 2, hf_dir, BUCKET, timeout=300).stdout
    rows = re.findall(r"LORA_SYNC (\S+) rank (\d) merged_peak (\d+) delta_peak (\d+) largest (\d+) adapted (\d+)", out)
    assert {(case, r) for case, r, *_ in rows} == {(c, r) for c in ("tp2to1_fp32", "tp2to1_bf16", "tp2to2_embedded")
                                                   for r in "01"}, out[-3000:]
    assert out.count("LORA_SYNC params_unchanged") == 2, out[-3000:]
    for case, rank, merged, delta, largest, adapted in rows:
        merged, delta, largest, adapted = map(int, (merged, delta, largest, adapted))
        print(f"{case} rank {rank}: merged chunks alive at most {merged} B (bucket {BUCKET} B), delta {delta} B "
              f"(largest adapted weight {largest} B, all adapted {adapted} B)")
        assert largest > BUCKET and 0 < merged <= BUCKET, (case, merged)  # fp32 weights: the fp32 sum is the chunk
        assert 0 < delta <= largest, (case, delta, largest)
    planted = [int(x) for x in re.findall(r"PLANTED_EAGER rank \d merged_peak (\d+)", out)]
    print(f"planted eager merge: merged bytes alive at most {planted}")
    assert len(planted) == 2 and all(p > 4 * BUCKET for p in planted), planted
