"""torchrun worker (2 gloo ranks = one rollout TP group of size 2) for tests/multiprocess/test_rollout.py.

For each tiny model variant: every rank loads its own TP=2 generation shard into the embedded
engine, then checks, in this one launch:
  - greedy output == HF generate token for token, log-probs == HF forward (1e-5), left-padded batch;
  - seeded sampling (n=3, temperature, top-k, top-p) gives identical tokens and log-probs on both
    ranks, the same on a second run, and the same as a TP=1 engine with the same seed;
  - EOS / stop ids end rows early without changing the other rows.
Rank 0 prints "ROLLOUT_TP2_OK <variant> <tokens compared>" per variant; pytest checks those lines.
"""
from __future__ import annotations

import os
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def same_on_all_ranks(t: torch.Tensor) -> bool:
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return all(torch.equal(parts[0], p) for p in parts)


def check_variant(variant: str, tmp_dir: str) -> int:
    from tests.multiprocess.workers import hf_rollout_reference as ref
    from tripod.engine.rollout import SamplingParams, make_rollout_engine

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        ref.tiny_checkpoint(tmp_dir, variant)
    dist.barrier()
    arch, model, state = ref.load_hf(os.path.join(tmp_dir, variant))
    engine = make_rollout_engine("embedded", arch, dist.group.WORLD)
    engine.load_weights(ref.generation_shard(arch, state, world, rank))
    prompts = ref.random_prompts(arch.vocab_size, [6, 2, 9], seed=11)
    compared = ref.check_against_hf(engine, model, prompts, max_new_tokens=10)

    single = make_rollout_engine("embedded", arch, None)
    single.load_weights(ref.generation_shard(arch, state, 1, 0))
    params = SamplingParams(max_new_tokens=8, temperature=1.3, top_k=50, top_p=0.9, n=3, seed=1234)
    first, second = engine.generate(prompts, params), engine.generate(prompts, params)
    assert first.response_ids.shape[0] == len(prompts) * 3
    assert same_on_all_ranks(first.response_ids) and same_on_all_ranks(first.log_probs)
    assert torch.equal(first.response_ids, second.response_ids), "same seed, different output across runs"
    reference = single.generate(prompts, params)
    assert torch.equal(first.response_ids, reference.response_ids), "TP=2 and TP=1 sample differently"
    assert torch.allclose(first.log_probs, reference.log_probs, atol=1e-5)

    # Stop on a token every row emits at some step: each row must end right at its first occurrence.
    greedy = SamplingParams(max_new_tokens=10, greedy=True)
    free_run = engine.generate(prompts, greedy).responses()
    stop_token = free_run[0][3]
    stopped = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[stop_token]))
    for row, full in enumerate(free_run):
        want = full[: full.index(stop_token) + 1] if stop_token in full else full
        assert stopped.responses()[row] == want, f"row {row}: stop at {stop_token} gave {stopped.responses()[row]}"
    return compared


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=3))
    from tests.multiprocess.workers import hf_rollout_reference as ref

    tmp_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    for variant in ref.VARIANTS:
        compared = check_variant(variant, tmp_dir)
        if dist.get_rank() == 0:
            print(f"ROLLOUT_TP2_OK {variant} {compared}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        print(f"[rank{os.environ.get('RANK')}] FAILED\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)
