"""Throughput, MFU and peak memory of a PPO step (perf/* metrics; memory read by runtime/memory.py).

FLOPs follow the usual transformer count: 2 * params * tokens for a forward, 6 * params * tokens for a forward +
backward, where params are the matmul weights one token runs through (`active_matmul_params`: with MoE the router,
the top-k routed experts and the shared expert, not every expert; with MLA its low-rank projections), plus the
attention scores (2 * seq * heads * (qk head dim + v head dim) per layer and token forward: 4 * hidden * seq when
heads * head_dim = hidden); the LM head only counts at response positions, where tripod computes it. The count is
held to torch's FlopCounterMode over Hugging Face's own models in tests/unit/test_flop_count.py. MFU divides the actor's
achieved FLOP/s per device by the device peak: on CUDA a table of bf16 dense peaks, on CPU the best fp32 matmul
rate over a quarter second at start-up (so CPU "MFU" reads as the fraction of what this machine's BLAS reaches at its
best; `tripod bench` measures it again after its steps and keeps the higher).
Peak memory is gathered from every rank (one small all-gather per step): `perf/peak_memory_gb/rank{r}` for worlds
of up to PER_RANK_MEMORY_KEYS ranks, and the largest and smallest over all ranks always.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tripod.engine.workers.batch import RowLengths
from tripod.parallel.arch import ModelArch
from tripod.runtime.memory import peak_memory_gb

PER_RANK_MEMORY_KEYS = 16
CUDA_BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def peak_memory_per_rank(mine: float) -> dict[str, float]:
    """Every rank's peak memory `mine` (GiB, runtime.memory.peak_memory_gb), gathered: a collective, so every rank
    calls it.
    Keys: `perf/peak_memory_gb/rank{r}` (worlds of up to PER_RANK_MEMORY_KEYS ranks), `perf/peak_memory_gb/max`
    and `perf/peak_memory_gb/min` over the ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {"perf/peak_memory_gb/rank0": mine, "perf/peak_memory_gb/max": mine, "perf/peak_memory_gb/min": mine}
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    peaks = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    peaks[dist.get_rank()] = mine
    dist.all_reduce(peaks)
    values = peaks.tolist()
    out = {f"perf/peak_memory_gb/rank{r}": v for r, v in enumerate(values)} if len(values) <= PER_RANK_MEMORY_KEYS \
        else {}
    out.update({"perf/peak_memory_gb/max": max(values), "perf/peak_memory_gb/min": min(values)})
    return out


def _attention_params(arch: ModelArch) -> int:
    h, heads = arch.hidden_size, arch.num_heads
    if arch.mla is None:
        hd = arch.head_dim
        return h * (heads + 2 * arch.num_kv_heads) * hd + heads * hd * h
    m = arch.mla
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = h * m.q_lora_rank + m.q_lora_rank * heads * qk if m.q_lora_rank else h * heads * qk
    kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + heads * m.v_head_dim * h


def _mlp_params(arch: ModelArch, layer: int) -> int:
    """Matmul weights one token runs through in `layer`'s MLP: a dense SwiGLU, or an MoE layer's router, its top-k
    routed experts and its shared expert (with its gate)."""
    h, moe = arch.hidden_size, arch.moe
    if moe is None or not moe.layer_is_moe[layer]:
        return 3 * h * arch.ffn_hidden_size
    shared = 3 * h * moe.shared_expert_ffn_hidden_size if moe.shared_expert_ffn_hidden_size else 0
    return h * moe.num_experts + moe.topk * 3 * h * moe.expert_ffn_hidden_size + shared + \
        (h if moe.shared_expert_gate else 0)


def active_matmul_params(arch: ModelArch) -> int:
    """Matmul weights every token runs through in the transformer layers (not the embedding or LM head): with MoE the
    router, the top-k routed experts and the shared expert of each MoE layer (so an MoE model counts its active
    parameters, not its total)."""
    return sum(_attention_params(arch) + _mlp_params(arch, i) for i in range(arch.num_layers))


def attention_width(arch: ModelArch) -> int:
    """heads * (qk head dim + v head dim), summed over the layers: the attention scores and the weighted sum cost
    2 * seq * attention_width FLOPs per token forward."""
    if arch.mla is None:
        per_layer = arch.num_heads * 2 * arch.head_dim
    else:
        m = arch.mla
        per_layer = arch.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    return arch.num_layers * per_layer


def measure_peak_flops(min_seconds: float = 0.25) -> float:
    """Device peak FLOP/s: a table for known GPUs; on CPU the best rate of a 1024^3 fp32 matmul repeated for at least
    `min_seconds` (the analogue of a spec-sheet peak: the best moment, so a start-up neighbour that takes the core for
    a few milliseconds does not lower it)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, tflops in CUDA_BF16_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    best, start, runs = float("inf"), time.perf_counter(), 0
    while runs < 5 or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return 2 * n ** 3 / best


class PerfCounter:
    def __init__(self, arch: ModelArch, world_size: int):
        self.arch, self.world = arch, world_size
        self.params = active_matmul_params(arch)
        self.attention_width = attention_width(arch)
        self.peak = measure_peak_flops()

    def flops_per_token(self, seq: float, backward: bool) -> float:
        attn = 2 * self.attention_width * seq
        return (6 if backward else 2) * self.params + (3 if backward else 1) * attn

    def head_flops(self, response_tokens: float, backward: bool) -> float:
        """The LM head runs on the real response tokens only (response_mask: MegatronWorker.token_logprobs,
        kernels.logprobs_from_hidden), the count `RowLengths.response_lens` holds."""
        return (6 if backward else 2) * self.arch.vocab_size * self.arch.hidden_size * response_tokens

    @staticmethod
    def model_tokens(batch, shared_prompts: bool) -> tuple[float, float]:
        """(tokens the policy's forward runs, tokens the rollout runs): response tokens plus every prompt token, or
        with shared prompts each prompt once (rows of one prompt share its `index`; engine/workers/packing.py and
        the rollout's single prefill). Padding is not counted. `batch`: a PPOBatch or every row's `RowLengths`."""
        rows = RowLengths.of(batch)
        response = float(rows.response_lens.sum())
        first = {}
        for row, i in enumerate(rows.index.tolist()):
            first.setdefault(i, row)
        unique_prompt = float(rows.prompt_lens[list(first.values())].sum())
        all_prompt = float(rows.prompt_lens.sum())
        return (unique_prompt if shared_prompts else all_prompt) + response, unique_prompt + response

    def metrics(self, batch, times: dict[str, float], ppo_epochs: int,
                recomputed_old_log_probs: bool = True, shared_prompts: bool = False) -> dict[str, float]:
        """perf/* of one step. total_num_tokens counts every row's prompt + response (the work a step stands for);
        the FLOPs behind MFU count the tokens the model really ran (`model_tokens`). `batch`: a PPOBatch or every
        row's `RowLengths` (a batch sharded by DP rank: engine/workers/row_shards.py)."""
        rows = RowLengths.of(batch)
        tokens = float(rows.seq_lens.sum())
        response = float(rows.response_lens.sum())
        seq = tokens / rows.size
        run_tokens, gen_tokens = self.model_tokens(rows, shared_prompts)
        step_s = times.get("timing_s/step", 0.0) or 1e-9
        actor_s = times.get("timing_s/update_actor", 0.0) + times.get("timing_s/old_log_prob", 0.0)
        fwd = 1 if recomputed_old_log_probs else 0  # the old log-prob forward, skipped when exactly on-policy
        actor_flops = (run_tokens * (ppo_epochs * self.flops_per_token(seq, True) + fwd * self.flops_per_token(seq, False))
                       + ppo_epochs * self.head_flops(response, True) + fwd * self.head_flops(response, False))
        out = {"perf/total_num_tokens": tokens, "perf/model_tokens": run_tokens, "perf/gen_tokens": gen_tokens,
               "perf/throughput": tokens / step_s / self.world,
               "perf/max_memory_allocated_gb": (peak := peak_memory_gb()), **peak_memory_per_rank(peak)}
        if actor_s > 0:
            out["perf/mfu/actor"] = actor_flops / actor_s / self.world / self.peak
        return out
