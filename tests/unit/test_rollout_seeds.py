"""Rollout seeds: every (replica, row, sample) of a generation batch draws from a seed of its own. The trainer gives
each rollout replica a `SamplingParams.seed` (engine/rollout/factory.py's step_sampling_params); vLLM and SGLang
seed response row k of a replica's request with seed + k, the embedded engine draws its rows from one generator
of the seed. The rows of one replica's request must not reuse another replica's seeds (replica r's row k + 1 was
replica r + 1's row k)."""
from __future__ import annotations

import json

import pytest

from tripod.engine.config import load_config
from tripod.engine.rollout.factory import REPLICA_SEED_SLOTS, replica_seed, step_sampling_params
from tripod.parallel.arch import arch_from_hf

CONFIG = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "eos_token_id": 2}


def test_every_replica_row_and_sample_has_its_own_seed(tmp_path):
    from tripod.engine.rollout.sglang_engine import sglang_sampling_params

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    arch = arch_from_hf(tmp_path)
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.rollout.n=4",
                             "actor_rollout_ref.rollout.temperature=1.0"])
    replicas, prompts = 4, 6  # each replica's request: prompts x n rows (prompt-major), row k seeded seed + k
    rows = prompts * cfg.actor_rollout_ref.rollout.n
    for step, gen_batch in ((1, 0), (1, 1), (2, 0)):
        params = [step_sampling_params(cfg, False, step, gen_batch, r) for r in range(replicas)]
        replica_seeds = [p.seed for p in params]  # the embedded engine's: one generator per replica
        assert len(set(replica_seeds)) == replicas
        row_seeds = [sglang_sampling_params(p, arch, k)["sampling_seed"] for p in params for k in range(rows)]
        assert len(set(row_seeds)) == replicas * rows, f"step {step}: seeds shared between (replica, row) pairs"
        assert all(0 <= s < 2 ** 63 for s in row_seeds)


def test_replica_seed_bounds():
    top = replica_seed(2 ** 23 - 1, REPLICA_SEED_SLOTS - 1)
    assert top + (1 << 24) - 1 < 2 ** 63  # the last replica's last row still fits vLLM's / SGLang's int64
    assert replica_seed(-5, 0) >= 0  # a negative base (validation's step -1) folds into range
    with pytest.raises(ValueError, match="rollout replica 65536"):
        replica_seed(0, REPLICA_SEED_SLOTS)
