"""Per-rank memory of a PPO run, predicted from the architecture, the layouts and the precision settings.

For each model (actor, critic, reference, and the reward model when reward_model.enable) on its layout, the bytes one rank holds (the largest PP stage; with
uneven stages, num_layers_in_first/last_pipeline_stage, the stage sizes are megatron's: parallel/stages.py):

    params       numel(this rank's TP shard of its stage) * bytes(param_dtype)
    grads        numel * 4                megatron DDP's contiguous grad buffer, reduced in fp32
    main_params  numel * 4 / DP' if param_dtype is 16-bit, else 0   (fp32 main weights; fp32 params are their own)
    optim        numel * 8 / DP'          Adam exp_avg + exp_avg_sq in fp32
    (DP' = DP with the distributed optimizer, else 1; the frozen reference and reward model have params only, on
    the host between their uses if offloaded; the reward model's output layer is its [1, hidden] score head)

MoE models: a rank holds its TP slice of the dense tensors (attention, norms, router, shared experts, dense-MLP
layers: / TP) and num_experts / EP experts of each MoE layer of its stage, each cut over expert TP (/ ETP); the
distributed optimizer shards the expert part over expert-DP (EDP = TP*DP / (EP*ETP)) instead of DP.

LoRA (`model.lora.rank > 0`, parallel/lora/memory.py): params = the frozen base + the adapters; grads, main_params and
optim are the adapters' (and a critic's value head's) only; no reference model (the actor, adapters off, serves it);
the rollout sync's merge (`lora_merged`: made lazily as the transport packs each bucket, so one adapted weight's delta
plus one bucket's merged chunk, parallel/lora/merge.py), and a generation shard that is never aliased.

and for the rollout: the generation shard (its rollout-TP slice of the whole model in the rollout dtype, every expert
included; nothing when rollout TP == actor TP, PP == 1, EP == 1 and the dtypes agree: the engine then reads the
actor's parameters) and what the rollout engine that runs holds (`rollout_engine_bytes`): the embedded engine's KV
cache of one generate call (2 * layers * kv_heads/tg * head_dim * sequences * (prompt + response) * bytes; MLA caches
the latent instead: layers * (kv_lora_rank + qk_rope_head_dim) per token, replicated over rollout TP), SGLang's and
vLLM's reservation of their fraction of the device on CUDA, vLLM's weights copy and KV cache on CPU.
The trained models' activations at the peak of their update (the micro-batches megatron's pipeline schedule keeps in
flight): parallel/activation_plan.py.
`scripts/bench_memory.py` measures the same quantities on live objects; `tripod plan` prints this table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tripod.parallel.activation_plan import (  # noqa: F401  (the plan's activations live there)
    ActivationLayout,
    activation_bytes,
    activations_from_config,
    fused_attention_saved_bytes,
)
from tripod.parallel.arch import ModelArch
from tripod.parallel.convert.common import padded_vocab_size
from tripod.parallel.families.spec import local_shape as split_local_shape
from tripod.parallel.hybrid_engine.plan import actor_param_specs, local_shape


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def stage_numel(arch: ModelArch, tp: int, pp: int, *, value_head: bool = False, ep: int = 1,
                etp: int | None = None, first: int | None = None, last: int | None = None) -> list[int]:
    """Parameters of one rank on each PP stage (embedding, layers, final norm, LM head or value head, its experts);
    `first` / `last`: uneven stages (num_layers_in_first/last_pipeline_stage)."""
    return [d + e for d, e in stage_numel_split(arch, tp, pp, value_head=value_head, ep=ep, etp=etp, first=first,
                                                last=last)]


def stage_numel_split(arch: ModelArch, tp: int, pp: int, *, value_head: bool = False, ep: int = 1,
                      etp: int | None = None, first: int | None = None,
                      last: int | None = None) -> list[tuple[int, int]]:
    """(dense, routed-expert) parameters of one rank on each PP stage."""
    per_stage, experts = [0] * pp, [0] * pp
    for spec in actor_param_specs(arch, tp, pp, first=first, last=last):
        if spec.expert is not None:  # every expert has the same shape: this rank's 1/ep of them, cut etp ways
            experts[spec.stage] += _prod(split_local_shape(spec.rule, spec.global_shape, etp or tp))
        else:
            per_stage[spec.stage] += _prod(local_shape(spec, tp))
    h, v = arch.hidden_size, padded_vocab_size(arch.vocab_size, tp)
    if value_head and not arch.score_head:  # (a *ForSequenceClassification's rows end in its [1, hidden] score head)
        if not arch.tie_word_embeddings:
            per_stage[-1] -= (v // tp) * h  # the critic's output layer is the value head, not an LM head
        per_stage[-1] += h + 1
    elif arch.tie_word_embeddings and pp > 1:
        per_stage[-1] += (v // tp) * h  # megatron keeps a copy of the tied embedding on the last stage
    if any(x % ep for x in experts):
        raise ValueError(f"expert_model_parallel_size={ep} must divide the number of experts")
    return [(d, x // ep) for d, x in zip(per_stage, experts)]


@dataclass
class ModelMemory:
    name: str
    tp: int
    pp: int
    dp: int
    param_dtype: torch.dtype
    trainable: bool
    distributed_optimizer: bool = False
    offloaded: bool = False  # reference params kept in host memory between uses
    value_head: bool = False
    ep: int = 1
    etp: int | None = None  # None: tp
    recompute: str | None = None  # megatron recompute_granularity (activations)
    first: int | None = None  # uneven stages: layers on the first / last PP stage (None: even)
    last: int | None = None
    cp: int = 1  # context_parallel_size: CP ranks hold the same weights, the distributed optimizer shards over DP x CP
    lora: tuple[int, tuple[str, ...], tuple[str, ...]] | None = None  # (rank, target_modules, exclude_modules)
    numel: int = 0
    expert_numel: int = 0  # of which routed experts
    adapter_numel: int = 0  # LoRA: this rank's adapter parameters (parallel/lora/memory.py), in params
    merged_numel: int = 0  # LoRA: this rank's adapted base weights, which the rollout sync merges
    merged_largest: int = 0  # LoRA: the largest of them (what the lazy merge holds follows from it)
    rows: dict[str, int] = field(default_factory=dict)

    @property
    def edp(self) -> int:
        return self.tp * self.dp // (self.ep * (self.etp or self.tp))

    def compute(self, arch: ModelArch) -> "ModelMemory":
        split = stage_numel_split(arch, self.tp, self.pp, value_head=self.value_head, ep=self.ep, etp=self.etp,
                                  first=self.first, last=self.last)
        stage = max(range(self.pp), key=lambda i: sum(split[i]))
        dense, self.expert_numel = split[stage]
        self.numel = dense + self.expert_numel
        pbytes = torch.empty((), dtype=self.param_dtype).element_size()
        expert = self.expert_numel  # trained: the whole stage, or with LoRA its adapters (+ value head)
        if self.lora:  # frozen base; adapters (and a critic's value head) are the trained parameters
            from tripod.parallel.lora.memory import lora_stage_numel, value_head_numel

            rank, targets, exclude = self.lora
            lora = lora_stage_numel(arch, rank, targets, exclude, tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp,
                                    first=self.first, last=self.last, key=f"{'actor_rollout_ref' if self.name == 'actor' else self.name}.model.lora")[stage]
            self.adapter_numel, self.merged_numel = lora.adapters + lora.expert_adapters, lora.merged
            self.merged_largest = lora.largest
            head = value_head_numel(arch) if self.value_head and stage == self.pp - 1 else 0
            dense, expert = lora.adapters + head, lora.expert_adapters
        self.rows = {"params": (self.numel + self.adapter_numel) * pbytes}
        if self.trainable:
            self.rows.update(self.optimizer_rows(dense, expert, pbytes))
        return self

    def optimizer_rows(self, dense: int, expert: int, pbytes: int) -> dict[str, int]:
        """grads, main_params and optim of `dense` + `expert` trained elements (what the grad buffer and the
        optimizer hold) with parameters of `pbytes` bytes: the distributed optimizer shards dense state over DP x CP,
        expert state over expert-DP."""
        numel = dense + expert
        sharded = dense // (self.dp * self.cp) + expert // self.edp if self.distributed_optimizer else numel
        return {"grads": numel * 4, "main_params": sharded * 4 if pbytes < 4 else 0, "optim": sharded * 8}

    @property
    def layout(self) -> str:
        experts = f"EP{self.ep}ETP{self.etp or self.tp}" if self.ep > 1 or self.etp not in (None, self.tp) else ""
        stages = f"(first {self.first}, last {self.last})" if self.first or self.last else ""
        cp = f"xCP{self.cp}" if self.cp > 1 else ""
        return f"TP{self.tp}{cp}xPP{self.pp}xDP{self.dp}{experts}{stages}"

    @property
    def total(self) -> int:
        return sum(self.rows.values())


@dataclass
class MemoryPlan:
    models: list[ModelMemory]
    generation_shard: int  # 0 when it aliases the actor's parameters (see generation_shard_aliased)
    kv_cache: int  # the rollout engine's: `rollout_engine_bytes`
    generation_shard_aliased: bool = False
    activations: dict[str, int] = field(default_factory=dict)  # per trainable model: its update's peak saved bytes
    runtime: int = 0  # the process itself (Python, torch, megatron, transformers), measured: runtime_rss()
    kv_label: str = "KV cache"  # what kv_cache is (the embedded engine's KV cache, SGLang's / vLLM's reservation)
    kv_resident: bool = False  # held for the whole run (vLLM on CPU), not only while generating
    lora_merged: int = 0  # LoRA: the most the rollout sync's lazy merge holds at once (bytes; merge_peak_bytes)
    reference_on_actor: bool = False  # LoRA: no reference model, the actor with adapters off serves the ref pass

    def device_total(self) -> int:
        """Bytes on the compute device at the rollout peak (offloaded params excluded)."""
        return sum(m.total for m in self.models if not m.offloaded) + self.generation_shard + self.kv_cache + \
            self.lora_merged

    def host_peak(self) -> int:
        """CPU runs: the process's peak RSS. Every model's tensors live in host memory for the whole step; on top of
        them either the rollout (generation shard + the engine's KV cache) or a training pass's peak activations
        (vLLM's weights copy and KV cache on CPU stay for the whole run)."""
        rollout = self.generation_shard + self.lora_merged + (0 if self.kv_resident else self.kv_cache)
        resident = self.kv_cache if self.kv_resident else 0
        return self.runtime + sum(m.total for m in self.models) + resident + max([rollout, *self.activations.values()])

    def checkpoint_bytes(self) -> tuple[int, int]:
        """(synchronous, asynchronous) bytes a checkpoint save adds to a rank that writes (engine/checkpoints/): a
        synchronous save writes from the live tensors and gathers the distributed optimizer's state one chunk of
        OPTIMIZER_CHUNK_ELEMENTS fp32 at a time (x 2: the chunk and this rank's part of it, at most); an asynchronous
        one stages the parameters and the optimizer's state it writes (fp32 main weights + two Adam moments: 1.5 x
        optim)."""
        from tripod.parallel.checkpoint import OPTIMIZER_CHUNK_ELEMENTS

        trainable = [m for m in self.models if m.trainable]
        staged = sum(m.rows["params"] + m.rows.get("optim", 0) * 3 // 2 for m in trainable)
        return (2 * OPTIMIZER_CHUNK_ELEMENTS * 4 if any(m.distributed_optimizer for m in trainable) else 0), staged

    def describe(self) -> str:
        mib = 1 << 20
        lines = ["model        layout             dtype  distopt   params_MiB  grads_MiB  main_MiB  optim_MiB  total_MiB"]
        for m in self.models:
            r = m.rows
            lines.append(f"{m.name:<12} {m.layout:<18} {str(m.param_dtype)[6:]:<6} "
                         f"{str(m.distributed_optimizer).lower():<7} {r['params'] / mib:>11.1f} "
                         f"{r.get('grads', 0) / mib:>10.1f} {r.get('main_params', 0) / mib:>9.1f} "
                         f"{r.get('optim', 0) / mib:>10.1f} {m.total / mib:>10.1f}"
                         + ("  (host: offloaded)" if m.offloaded else ""))
        for m in self.models:
            if m.lora:
                lines.append(f"{m.name} LoRA rank {m.lora[0]} on {', '.join(m.lora[1])}: base frozen (params only), "
                             f"{m.adapter_numel / 1e6:.2f} M adapter parameters on this rank (in params) with grads, "
                             "main weights and optimizer state" + (" (and the value head's)" if m.value_head else ""))
        if self.reference_on_actor:
            lines.append("reference: the actor with its adapters off (LoRA: no reference model built)")
        if self.lora_merged:
            lines.append(f"the rollout sync's LoRA merge (W + scale * B @ A, merged as the transport packs each "
                         f"bucket: one adapted weight's delta + one bucket's chunk): {self.lora_merged / mib:.1f} MiB")
        alias = " (views of the actor's parameters)" if self.generation_shard_aliased else ""
        lines.append(f"generation shard {self.generation_shard / mib:.1f} MiB{alias}, "
                     f"{self.kv_label} {self.kv_cache / mib:.1f} MiB")
        lines.append(f"per rank on the compute device at the rollout peak: {self.device_total() / mib:.1f} MiB")
        if self.activations:
            lines.append("activations at the update's peak (the micro-batches in flight, longest sequences): " + ", ".join(
                f"{name} {b / mib:.1f} MiB" for name, b in self.activations.items()))
        sync, staged = self.checkpoint_bytes()
        if staged:
            lines.append(f"a checkpoint save adds per rank on the host: {sync / mib:.1f} MiB synchronous (the optimizer "
                         f"state streamed a chunk at a time), {staged / mib:.1f} MiB with trainer.async_save (a staged "
                         "copy of what the rank writes, held until written)")
        if self.runtime:
            lines.append(f"on CPU, peak RSS per rank: {self.host_peak() / mib:.0f} MiB (process {self.runtime / mib:.0f}"
                         f" MiB + models + the larger of rollout and the update's activations)")
        return "\n".join(lines)


def runtime_rss() -> int:
    """This process's resident bytes once the modules every rank imports are loaded: what a rank holds before its
    first tensor (interpreter, torch, megatron-core, transformers); measured, as it depends on the installation."""
    import megatron.core.models.gpt  # noqa: F401
    import transformers  # noqa: F401

    from tripod.runtime.memory import rss_bytes
    return rss_bytes()


def kv_cache_bytes(arch: ModelArch, rollout_tp: int, sequences: int, seq_len: int, dtype: torch.dtype) -> int:
    """The embedded engine's KV cache of one generate call on one rank (rollout/tp_decoder.py, moe_decoder.py)."""
    es = torch.empty((), dtype=dtype).element_size()
    mla = getattr(arch, "mla", None)
    if mla is not None:  # the latent and the RoPE key, replicated over rollout TP
        return arch.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * sequences * seq_len * es
    return 2 * arch.num_layers * (arch.num_kv_heads // rollout_tp) * arch.head_dim * sequences * seq_len * es


def rollout_engine_bytes(cfg, arch: ModelArch, sequences: int, dtype: torch.dtype, device: str,
                         gpu_memory_gb: float | None) -> tuple[int, str, bool]:
    """(bytes, what they are, held for the whole run) of the rollout engine that runs, on one rank: the embedded
    engine's KV cache of one generate call (`kv_cache_bytes`); SGLang and vLLM on CUDA reserve their memory fraction
    (rollout.gpu_memory_utilization / mem_fraction_static, or engine_kwargs' own) of the device (`gpu_memory_gb`,
    80 GiB when None) for their weights and KV pool while they generate (released during training: memory saver /
    sleep mode); vLLM with engine_kwargs.kv_cache_memory_bytes, and vLLM on CPU (1 GiB unless engine_kwargs say
    otherwise), hold their weights copy and that KV cache, on CPU for the whole run (its CPU worker cannot sleep)."""
    r = cfg.actor_rollout_ref.rollout
    kw, name = r.engine_kwargs, r.name
    if name == "vllm" and (device == "cpu" or "kv_cache_memory_bytes" in kw):
        kv = int(kw.get("kv_cache_memory_bytes", 1 << 30))
        return (generation_shard_bytes(arch, r.tensor_model_parallel_size, dtype) + kv,
                f"vLLM weights copy + KV cache {kv / (1 << 20):.0f} MiB (kv_cache_memory_bytes)", device == "cpu")
    if name in ("sglang", "vllm") and device == "cuda":
        key = "mem_fraction_static" if name == "sglang" else "gpu_memory_utilization"
        fraction = float(kw.get(key, r.mem_fraction_static))
        gb = 80.0 if gpu_memory_gb is None else gpu_memory_gb
        label = "SGLang" if name == "sglang" else "vLLM"
        return (int(fraction * gb * (1 << 30)), f"{label} reservation ({key} {fraction:g} x {gb:g} GiB: its weights "
                "and KV pool)", False)
    return (kv_cache_bytes(arch, r.tensor_model_parallel_size, sequences,
                           cfg.data.max_prompt_length + r.response_length, dtype), "KV cache", False)


def generation_shard_bytes(arch: ModelArch, rollout_tp: int, dtype: torch.dtype) -> int:
    es = torch.empty((), dtype=dtype).element_size()
    return sum(_prod(local_shape(s, rollout_tp)) for s in actor_param_specs(arch, rollout_tp, 1)) * es


def plan_from_config(cfg, world_size: int, arch: ModelArch, critic_arch: ModelArch | None = None,
                     reward_arch: ModelArch | None = None, gpu_memory_gb: float | None = None,
                     bucket_bytes: int = 64 << 20, teacher_arch: ModelArch | None = None) -> MemoryPlan:
    """The memory plan of a (resolved) `TripodConfig` on `world_size` ranks (`critic_arch` / `reward_arch`: the
    critic's and the reward model's checkpoints where they differ from the actor's; `gpu_memory_gb`: the device
    memory SGLang's / vLLM's fraction is of, 80 GiB when None; `bucket_bytes`: the hybrid engine's bucket)."""
    from tripod.parallel.lora.merge import merge_peak_bytes
    from tripod.parallel.precision import resolve_precision, rollout_dtype

    arc = cfg.actor_rollout_ref
    device = "cuda" if cfg.trainer.device == "cuda" else "cpu"

    def model(name, m, trainable, value_head=False, offloaded=False, optimizer="adam", own_arch=None, lora=None):
        tp, pp, dp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.data_parallel_size(world_size)
        prec = resolve_precision(m, dp * m.context_parallel_size, trainable, optimizer)  # shards over DP x CP
        return ModelMemory(name, tp, pp, dp, prec.param_dtype, trainable, prec.use_distributed_optimizer,
                           offloaded, value_head, m.expert_model_parallel_size, m.expert_tensor_parallel_size,
                           recompute=prec.recompute_granularity, first=m.num_layers_in_first_pipeline_stage,
                           last=m.num_layers_in_last_pipeline_stage,
                           cp=m.context_parallel_size, lora=lora_of(lora)).compute(own_arch or arch)

    seq = cfg.data.max_prompt_length + arc.rollout.response_length
    models = [model("actor", arc.actor.megatron, True, optimizer=arc.actor.optim.optimizer, lora=arc.model.lora)]
    if cfg.uses_critic:
        models.append(model("critic", cfg.critic.megatron, True, value_head=True, optimizer=cfg.critic.optim.optimizer,
                            own_arch=critic_arch, lora=cfg.critic.model.lora))
    if cfg.uses_reference and not arc.model.lora.rank:  # with LoRA the actor, adapters off, is the reference
        ref_offload = arc.ref.offload or arc.ref.megatron.param_offload  # placement by phase: memory_phases.py
        models.append(model("reference", arc.ref.megatron, False, offloaded=ref_offload and device == "cuda"))
    distill = getattr(cfg, "distillation", None)  # on-policy distillation's frozen teacher: own layout
    if distill is not None and distill.enabled:
        models.append(model("teacher", distill.teacher()[1].megatron, False, own_arch=teacher_arch))
    rm = cfg.reward_model
    if rm.enable:  # its own between-scorings offload (engine/workers/reward_model.py)
        models.append(model("reward_model", rm.megatron, False, value_head=True, own_arch=reward_arch,
                            offloaded=(rm.offload or rm.megatron.param_offload) and device == "cuda"))
    r = arc.rollout
    gdt = rollout_dtype(r.dtype, device)
    replicas = world_size // r.tensor_model_parallel_size
    sequences = -(-cfg.data.gen_batch_size * r.n // replicas)  # one generate call: a generation batch (dynamic sampling)
    actor = models[0]
    # parallel/hybrid_engine/engine.py: same TP, no PP, same dtype -> the engine reads the parameters themselves
    aliased = not actor.lora and actor.pp == 1 and actor.tp == r.tensor_model_parallel_size and \
        actor.param_dtype == gdt and (actor.expert_numel == 0 or (actor.ep == 1 and actor.etp in (None, actor.tp)))
    activations = {m.name: activations_from_config(c, critic_arch if m.value_head and critic_arch else arch,
                                                   world_size, r.n, seq, m.param_dtype)
                   for m, c in zip(models, (arc.actor, cfg.critic)) if m.trainable}
    engine, engine_label, engine_resident = rollout_engine_bytes(cfg, arch, sequences, gdt, device, gpu_memory_gb)
    return MemoryPlan(models, 0 if aliased else generation_shard_bytes(arch, r.tensor_model_parallel_size, gdt),
                      engine, aliased, activations=activations, runtime=runtime_rss() if device == "cpu" else 0,
                      kv_label=engine_label, kv_resident=engine_resident,
                      lora_merged=merge_peak_bytes(actor.merged_largest, actor.param_dtype, bucket_bytes)
                      if actor.lora and arc.model.lora.merge else 0,  # merge=false: vLLM serves the adapters
                      reference_on_actor=cfg.uses_reference and bool(arc.model.lora.rank))


def lora_of(lora) -> tuple[int, tuple[str, ...], tuple[str, ...]] | None:
    """ModelMemory.lora of one `model.lora` section; None where LoRA is off."""
    return (lora.rank, tuple(lora.target_modules), tuple(lora.exclude_modules)) if lora is not None and lora.rank > 0 \
        else None


@dataclass
class RolloutRankMemory:
    """A rollout rank of its own (rollout.nnodes, engine/async_rollout/): its generation shard (kept between batches),
    the rollout engine's memory (`rollout_engine_bytes`: the embedded engine's KV cache of one generate call, or
    SGLang's / vLLM's reservation), the reused bucket buffer of the weight receive, the process."""
    ranks: int
    generation_shard: int
    kv_cache: int
    bucket: int
    runtime: int = 0
    kv_label: str = "KV cache"

    def total(self) -> int:
        return self.generation_shard + self.kv_cache + self.bucket + self.runtime

    def describe(self, staged: int) -> str:
        mib = 1 << 20
        return (f"rollout ranks ({self.ranks}, rollout.nnodes x rollout.n_gpus_per_node): generation shard "
                f"{self.generation_shard / mib:.1f} MiB + {self.kv_label} {self.kv_cache / mib:.1f} MiB + weight-receive "
                f"bucket {self.bucket / mib:.1f} MiB" + (f" + process {self.runtime / mib:.0f} MiB" if self.runtime
                                                         else "") + f" = {self.total() / mib:.1f} MiB per rank\n"
                f"trainer ranks: the plan above (its rollout engine only validates), plus {staged / mib:.1f} MiB of "
                "staged weights on the ranks that send them (the first rollout-TP group: one generation shard per "
                "push the rollout has not taken yet, at most the schedule's capacity)")


def rollout_ranks_plan(cfg, arch: ModelArch, bucket_bytes: int = 64 << 20,
                       gpu_memory_gb: float | None = None) -> RolloutRankMemory:
    """The memory of each of a config's own rollout ranks (`cfg.rollout`), see RolloutRankMemory (`gpu_memory_gb`:
    the device memory SGLang's / vLLM's fraction is of, 80 GiB when None)."""
    from tripod.parallel.precision import rollout_dtype

    r, device = cfg.actor_rollout_ref.rollout, "cuda" if cfg.trainer.device == "cuda" else "cpu"
    gdt = rollout_dtype(r.dtype, device)
    ranks = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    sequences = -(-cfg.data.gen_batch_size * r.n // max(ranks // r.tensor_model_parallel_size, 1))
    shard = generation_shard_bytes(arch, r.tensor_model_parallel_size, gdt)
    engine, label, _ = rollout_engine_bytes(cfg, arch, sequences, gdt, device, gpu_memory_gb)
    return RolloutRankMemory(ranks, shard, engine, min(bucket_bytes, shard), runtime_rss() if device == "cpu" else 0,
                             label)
