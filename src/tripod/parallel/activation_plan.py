"""The activation memory of a training pass: the bytes autograd saves for the backward on one rank, at the peak of
megatron's pipeline schedule (parallel/pipeline.py), for the layer spec that runs (megatron's local spec with
parallel/sdpa_attention.py's core attention, MLA layers with megatron's own; no dropout). `tests/multiprocess/
test_activation_plan.py` measures it (torch.autograd.graph.saved_tensors_hooks, unique storages) at PP2 with 4
micro-batches on a dense, an MoE and an MLA model.

Per layer, with T = micro_batch * seq / cp tokens, Th = T / tp with sequence parallelism (else T), a = heads / tp,
kv = kv_heads / tp, d = head_dim, f = ffn / tp, e = bytes of the activation dtype:
    each RMSNorm (torch's, computed in fp32) of width w: its input and x * rstd in fp32 2*Th*w*4, rstd Th*4, its
    output (the next linear's input; sequence parallelism keeps it un-gathered) Th*w*e;
    attention, SDPA (`fused`): q, k and v of the kv heads (grouped-query: not expanded), the output, the log-sum-exp
    and the additive mask (`fused_attention_saved_bytes`; counted always: packed micro-batches and CP carry one);
    megatron's materialising attention: q and the expanded k and v 3*T*a*d*e, the
    softmax output in fp32 P*4 (P = micro_batch * a * s * keys) plus its 16-bit cast P*e; the out-projection's
    input T*a*d*e; RoPE's cos / sin 4*s*d*e and the boolean causal mask s*keys; Qwen3's q / k norms (per head);
    MLA: the q and kv latent norms (widths q_lora_rank, kv_lora_rank), q and k of qk_nope + qk_rope dims and v of
    v_head_dim per head, always materialising (megatron's MLA core attention), RoPE over qk_rope_head_dim;
    SwiGLU MLP: fc1's output (gate|up) 2*T*f*e, silu(gate), the product and fc2's input 3*T*f*e;
    MoE layer (megatron's allgather token dispatcher; tokens gathered over expert-TP x EP, then the rows routed to
    this rank's experts: R = Th * etp * topk on average): the router's fp32 input (a new tensor in 16-bit runs) and
    top-k indices / probabilities Th*(12*topk + 4*E), the gathered routing map and probabilities Th*etp*E*5, the
    permutation's indices R*8, per routed row its input h*e, six expert-FFN wide tensors 6*(f_e/etp)*e (SwiGLU plus
    the probability-weighted product) and its probability (4), and the shared experts as a SwiGLU MLP.
recompute_granularity=full keeps each recomputed group's input (Th*h*e) plus, during the backward, one group's set
(recompute_method uniform: groups of recompute_num_layers; block: the first recompute_num_layers layers of the stage,
one at a time); selective recomputes the core attention, which keeps only its q, k, v inputs.
First stage: the token ids (int64); last stage: the final norm and the head's input T*h*e (tripod's chunked
log-prob kernel never materialises the logits).

In flight (megatron's schedules): no pipelining 1 micro-batch; 1F1B min(PP - rank, M) on PP rank `rank`
(the first stage holds the most); interleaved 1F1B min(2*(PP - rank - 1) + (VPP - 1)*PP + 1, M*VPP) model-chunk
micro-batches of 1/VPP of the stage each (on the first stage PP * (1 + (PP - 1) / (PP * VPP)) micro-batches, the
factor of Megatron-LM's theoretical_memory_usage.py). The plan is the largest rank: its in-flight micro-batches'
saved bytes plus the backward's recompute working set.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from tripod.parallel.arch import ModelArch
from tripod.parallel.stages import StageSplit


@dataclass(frozen=True)
class ActivationLayout:
    """What the activation memory depends on besides the model and the micro-batch shape."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # None: tp
    vpp: int | None = None
    sequence_parallel: bool = False  # ignored at tp 1; MoE models with tp > 1 always run it (parallel/model.py)
    first: int | None = None  # uneven stages (num_layers_in_first/last_pipeline_stage)
    last: int | None = None
    recompute: str | None = None  # full | selective | None
    recompute_method: str = "uniform"
    recompute_num_layers: int | None = None  # None: 1


def in_flight_microbatches(pp: int, pp_rank: int, num_microbatches: int, vpp: int | None = None) -> float:
    """Micro-batches (in whole-stage units) whose saved activations PP rank `pp_rank` holds at once."""
    if pp == 1:
        return 1
    if vpp and vpp > 1:
        chunks = min(2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1, num_microbatches * vpp)
        return chunks / vpp
    return min(pp - pp_rank, num_microbatches)


def fused_attention_saved_bytes(micro_batch: int, seq: int, heads: int, head_dim: int, elem: int,
                                keys: int | None = None, kv_heads: int | None = None, mask: bool = True) -> int:
    """What SDPA's fused kernels save for the backward of one core attention (parallel/sdpa_attention.py): q and the
    output 2*T*a*d*e, k and v of the `kv_heads` groups (SDPA's grouped-query attention: not copied per query head;
    default `heads`) 2*micro_batch*keys*kv*d*e, the per-row log-sum-exp in fp32 micro_batch*a*seq*4, and with `mask` the additive mask micro_batch*seq*keys*e (T = micro_batch*seq; measured
    exactly on CPU by tests/unit/test_sdpa_attention.py). Unpacked rows at CP 1 run without a mask; packed rows and tripod's CP carry
    one. `keys`: the key length where it differs from the query length (context parallelism: seq / cp queries)."""
    t, keys = micro_batch * seq, seq if keys is None else keys
    kv = heads if kv_heads is None else kv_heads
    return 2 * t * heads * head_dim * elem + 2 * micro_batch * keys * kv * head_dim * elem + \
        micro_batch * heads * seq * 4 + (micro_batch * seq * keys * elem if mask else 0)


def _norm(tokens: int, width: int, e: int) -> int:
    return 2 * tokens * width * 4 + tokens * 4 + tokens * width * e


def _qk_layernorm(arch: ModelArch) -> bool:
    from tripod.parallel.families import get_family

    fields = get_family(arch.family).megatron_fields
    return arch.mla is None and bool(fields and fields(arch).get("qk_layernorm"))


def _attention(arch: ModelArch, lay: ActivationLayout, b: int, sq: int, seq: int, e: int, fused: bool) -> int:
    """One layer's attention: its core, its projections' inputs past the input norm, RoPE and the mask."""
    t, tk, a = b * sq, b * seq, arch.num_heads // lay.tp
    probs = b * a * sq * seq
    softmax = probs * 4 + (probs * e if e < 4 else 0)
    mla = arch.mla
    if mla is not None:
        dq, dv = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
        latents = _norm(t, mla.kv_lora_rank, e) + (_norm(t, mla.q_lora_rank, e) if mla.q_lora_rank else 0)
        core = (t * a * dq + tk * a * (dq + dv)) * e
        if lay.recompute != "selective":  # fused (a TE / SDPA kernel, not what runs for MLA): output, lse and mask
            core += (t * a * dv * e + b * a * sq * 4 + b * sq * seq * e) if fused else softmax
        return latents + core + t * a * dv * e + 4 * sq * mla.qk_rope_head_dim * e + sq * seq
    d, kv = arch.head_dim, max(arch.num_kv_heads // lay.tp, 1)
    if lay.recompute == "selective":
        core = (t * a * d + 2 * t * kv * d) * e
    elif fused:  # its context (SDPA's output) is saved, and so is the out-projection's input (a reshaped copy)
        core = fused_attention_saved_bytes(b, sq, a, d, e, keys=seq, kv_heads=kv) - t * a * d * e
    else:
        core = (t + 2 * tk) * a * d * e + softmax
    qk_norm = 0
    if _qk_layernorm(arch):  # per-head RMSNorm of q and k; in fp32 k's input is a view of the fused qkv output
        qk_norm = 2 * t * (a + kv) * d * 4 + t * (a + kv) * 4 + (t * (a + kv) * d * 4 if e == 4 else 0)
    return core + qk_norm + t * a * d * e + 4 * sq * d * e + sq * seq


def _moe_mlp(arch: ModelArch, lay: ActivationLayout, th: int, t: int, e: int) -> int:
    """One MoE layer's MLP past its input norm (allgather dispatcher, sequential experts)."""
    moe, h = arch.moe, arch.hidden_size
    etp, k, n = lay.etp or lay.tp, moe.topk, moe.num_experts
    rows = th * etp * k
    shared = moe.shared_expert_ffn_hidden_size
    # the router reads the norm's output in fp32: the norm's own 16-bit output is then saved only by a shared expert
    router_input = (th * h * 4 - (0 if shared else th * h * e)) if e < 4 else 0
    router = router_input + th * (12 * k + 4 * n)
    dispatch = th * etp * n * 5 + rows * 8
    experts = rows * (h * e + 6 * (moe.expert_ffn_hidden_size // etp) * e + 4)
    shared_mlp = 5 * t * (shared // lay.tp) * e if shared else 0
    return router + dispatch + experts + shared_mlp


def layer_bytes(arch: ModelArch, lay: ActivationLayout, layer: int, micro_batch: int, seq: int, e: int,
                fused: bool) -> int:
    """Saved bytes of global decoder layer `layer` for one micro-batch (`seq` tokens per row before CP)."""
    sq = -(-seq // lay.cp)
    t = micro_batch * sq
    th = -(-t // lay.tp) if lay.sequence_parallel and lay.tp > 1 else t
    moe = arch.moe is not None and arch.moe.layer_is_moe[layer]
    mlp = _moe_mlp(arch, lay, th, t, e) if moe else 5 * t * (arch.ffn_hidden_size // lay.tp) * e
    return 2 * _norm(th, arch.hidden_size, e) + _attention(arch, lay, micro_batch, sq, seq, e, fused) + mlp


def _stage_bytes(arch: ModelArch, lay: ActivationLayout, layers: list[int], micro_batch: int, seq: int, e: int,
                 fused: bool, first: bool, last: bool) -> tuple[int, int]:
    """(bytes one micro-batch keeps on this stage until its backward, the backward's recompute working set)."""
    t = micro_batch * -(-seq // lay.cp)
    th = -(-t // lay.tp) if lay.sequence_parallel and lay.tp > 1 else t
    per = [layer_bytes(arch, lay, i, micro_batch, seq, e, fused) for i in layers]
    ends = (t * 8 if first else 0) + (_norm(th, arch.hidden_size, e) + t * arch.hidden_size * e if last else 0)
    if lay.recompute != "full" or not per:
        return sum(per) + ends, 0
    n, held = lay.recompute_num_layers or 1, th * arch.hidden_size * e  # a recomputed group keeps its input
    if lay.recompute_method == "block":
        n = min(n, len(per))
        return n * held + sum(per[n:]) + ends, max(per[:n], default=0)
    groups = [sum(per[i:i + n]) for i in range(0, len(per), n)]
    return len(groups) * held + ends, max(groups)


def activation_bytes(arch: ModelArch, tp: int, pp: int, micro_batch: int, seq: int, dtype: torch.dtype, *,
                     recompute: str | None = None, value_head: bool = False, fused_attention: bool | None = None,
                     first: int | None = None, last: int | None = None, cp: int = 1, num_microbatches: int = 1,
                     layout: ActivationLayout | None = None) -> int:
    """Peak saved-activation bytes of a training pass of `num_microbatches` micro-batches (`micro_batch` rows x `seq`
    tokens each) on the rank that holds the most (module docstring). `fused_attention`: SDPA's fused kernels (the
    local spec's core attention of non-MLA layers on every device, parallel/sdpa_attention.py, or TE's) or, False,
    megatron's materialising attention; None: what build_gpt_model runs (fused unless the model uses MLA).
    `layout`: the full ActivationLayout (SP, EP / ETP, VPP, recompute method); without it, one from tp / pp / cp /
    first / last / recompute. `value_head` changes nothing here (the critic's head input is the LM head's)."""
    del value_head
    lay = layout or ActivationLayout(tp=tp, pp=pp, cp=cp, first=first, last=last, recompute=recompute)
    if arch.moe is not None and lay.tp > 1:  # megatron trains MoE with TP only under sequence parallelism
        lay = dataclasses.replace(lay, sequence_parallel=True)
    fused = arch.mla is None if fused_attention is None else fused_attention
    e = torch.empty((), dtype=dtype).element_size()
    vpp = lay.vpp if lay.vpp and lay.vpp > 1 and lay.pp > 1 else 1
    split = StageSplit(arch.num_layers, lay.pp, vpp, lay.first, lay.last)
    peak = 0.0
    for r in range(lay.pp):
        layers = split.stage_layers(r) if lay.pp > 1 else list(range(arch.num_layers))
        kept, working = _stage_bytes(arch, lay, layers, micro_batch, seq, e, fused, r == 0, r == lay.pp - 1)
        peak = max(peak, in_flight_microbatches(lay.pp, r, num_microbatches, vpp) * kept + working)
    return math.ceil(peak)


def training_microbatches(c, world_size: int, n_samples: int, seq: int) -> tuple[int, int]:
    """(rows of one micro-batch of the longest sequences, micro-batches of one optimizer step on a rank) of a model's
    PPO update (`c`: the actor's or the critic's config; engine/workers/ppo_workers.py's mini-batches of
    ppo_mini_batch_size * rollout.n rows split over DP)."""
    rows = -(-c.ppo_mini_batch_size * n_samples // c.megatron.data_parallel_size(world_size))
    micro = max(c.ppo_max_token_len_per_gpu // seq, 1) if c.use_dynamic_bsz else c.ppo_micro_batch_size_per_gpu
    return micro, max(-(-rows // micro), 1)


def activations_from_config(c, arch: ModelArch, world_size: int, n_samples: int, seq: int,
                            dtype: torch.dtype, fused_attention: bool | None = None) -> int:
    """`activation_bytes` of a trained model's PPO update from its config section (`c`: actor or critic)."""
    from tripod.parallel.precision import resolve_precision

    m = c.megatron
    prec = resolve_precision(m, m.data_parallel_size(world_size) * m.context_parallel_size, True, c.optim.optimizer)
    tp = m.tensor_model_parallel_size
    lay = ActivationLayout(tp=tp, pp=m.pipeline_model_parallel_size, cp=m.context_parallel_size,
                           ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size,
                           vpp=m.virtual_pipeline_model_parallel_size,
                           sequence_parallel=tp > 1 and (m.sequence_parallel or arch.moe is not None),
                           first=m.num_layers_in_first_pipeline_stage, last=m.num_layers_in_last_pipeline_stage,
                           recompute=prec.recompute_granularity, recompute_method=prec.recompute_method or "uniform",
                           recompute_num_layers=prec.recompute_num_layers)
    micro, count = training_microbatches(c, world_size, n_samples, seq)
    return activation_bytes(arch, lay.tp, lay.pp, micro, seq, dtype, num_microbatches=count, layout=lay,
                            fused_attention=fused_attention)
