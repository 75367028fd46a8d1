"""Tiny preference parquet files for `tripod train-rm` tests: arithmetic prompts whose right answer is preferred.

Rows alternate between a (chosen, rejected) pair and a `ranking` of three answers (right, off by one, off by
more), so both row kinds and the all-pairs expansion of a ranking are exercised."""
from __future__ import annotations

import os
import random


def make_preference_files(tmp_path, n_train: int = 12, n_val: int = 4) -> dict[str, str]:
    """{'train': parquet, 'val': parquet}; rows of even index are pairs, odd ones rankings of 3 (3 pairs each)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}
    for split, n, seed in (("train", n_train, 0), ("val", n_val, 1)):
        rng = random.Random(seed)
        rows = {"prompt": [], "chosen": [], "rejected": [], "ranking": []}
        for i in range(n):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            right = a + b
            rows["prompt"].append(f"What is {a}+{b}? ")
            if i % 2 == 0:
                rows["chosen"].append(f"#### {right}")
                rows["rejected"].append(f"#### {right + rng.randint(1, 5)}")
                rows["ranking"].append(None)
            else:
                rows["chosen"].append(None)
                rows["rejected"].append(None)
                rows["ranking"].append([f"#### {right}", f"#### {right + 1}", f"#### {right + 7}"])
        out[split] = os.path.join(str(tmp_path), f"prefs_{split}.parquet")
        pq.write_table(pa.table(rows), out[split])
    return out
