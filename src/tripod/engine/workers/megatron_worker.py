"""One Megatron model (actor, critic or reference) on its own parallel layout, and how the PPO step drives it.

A worker owns: the GPTModel shard of this rank (built from the HF checkpoint; one chunk per virtual pipeline stage),
its DDP wrappers and optimizer when it trains, and `run()`, which pushes micro-batches through megatron's pipeline
schedule with a loss function (parallel/pipeline.py, the one driver).
Everything megatron does for this model runs inside `layout.activate()` (see parallel/layout.py), so actor, critic
and reference can have different TP/PP/DP sizes in the same world.

Data flow: a rank holds the whole `PPOBatch`, takes its DP rank's rows, cuts them into micro-batches, and
`gather_rows()` brings per-row results back to every rank (broadcast from the last PP stage, all-gather over DP); or
it holds only its DP rank's rows (a sharded batch, engine/workers/row_shards.py) and `rows_of_stages()` keeps the
results there (broadcast from the last PP stage only).

Rows that share a prompt (GRPO's n samples) run it through the model once when `share_prompt_prefix` is on, and
`remove_padding` lays the rows out without padding, several to a model row (engine/workers/packing.py,
`packed_layout`); the heads read the outputs that predict each response token from any of these layouts.

Policy heads never materialise [tokens, vocab] logits: the output layer is bypassed (it returns the hidden state)
and `tripod.kernels.logprobs_from_hidden` computes log-probs / entropy of the sampled tokens straight from the hidden
state and the vocab-parallel LM-head weight. That bypass and the other per-model megatron patches live in
parallel/megatron_patches/gpt_model.py; the LR schedule in engine/workers/lr_schedule.py; the MoE router keys'
translation in engine/workers/moe_config.py.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from tripod.engine.config import OptimConfig
from tripod.engine.workers.batch import PPOBatch, split_rows
from tripod.engine.workers.lr_schedule import build_lr_scheduler
from tripod.engine.workers.moe_config import MOE_AUX_LOSS_NAMES
from tripod.engine.workers.moe_shapes import uniform_shapes, with_rows
from tripod.engine.workers.packing import pack_shared_prompts, pack_thd, pack_without_padding, pad_rows_to
from tripod.parallel.arch import ModelArch
from tripod.parallel.context_parallel import held_positions, local_slots, padded_length, split_for_cp, sum_over_cp
from tripod.parallel.megatron_patches.gpt_model import (
    bypass_output_layer,
    cast_floating_params,
    rope_with_slot_positions,
)
from tripod.parallel.precision import PrecisionSettings
from tripod.runtime.device import current_device, to_device, trim_host_heap


def _unwrap(model):
    while not hasattr(model, "rotary_pos_emb") and hasattr(model, "module"):
        model = model.module
    return model


class MegatronWorker:
    def __init__(self, name: str, arch: ModelArch, layout, hf_dir: str, *, value_head: bool = False,
                 trainable: bool = True, optim: OptimConfig | None = None, grad_clip: float = 1.0,
                 total_steps: int = 1, seed: int = 1234, precision: PrecisionSettings | None = None,
                 sequence_parallel: bool = False, virtual_pipeline_size: int | None = None,
                 config_overrides: dict | None = None, share_prompt_prefix: bool = True, use_te: str = "auto",
                 load_arch: ModelArch | None = None, remove_padding: bool = False, te_thd: bool = False,
                 routing_replay: bool = False, lora=None):
        """`optim`, `grad_clip` and `total_steps` (optimizer steps of the whole run, for the LR schedule) matter
        only when `trainable`. `config_overrides`: extra TransformerConfig fields (the MoE router's, from
        `moe_config_overrides`). `share_prompt_prefix`: run a prompt shared by several rows once per micro-batch
        (where the attention takes an arbitrary mask: megatron's local spec, i.e. without Transformer Engine);
        `remove_padding`: pack without padding, several rows (or prompt groups) to a model row (engine/workers/packing.py).
        `use_te`: `{key}.megatron.use_te` (auto | true | false; parallel/model.py's resolve_use_te).
        `load_arch`: the arch `hf_dir` is read as, where it differs from the built model's (a reward model built with
        a score head from a causal LM's weights: the head stays freshly initialised). `te_thd`: a Transformer Engine
        model packs its rows without padding in THD format (packing.pack_thd, model.packed_seq_params; no shared
        prompts there); off unless asked: that TE forward has not run yet (no GPU here). `routing_replay`: an MoE
        model's routers record and replay expert ids through megatron's RouterReplay (`self.routing`,
        parallel/router_replay.py). `lora`: a parallel.lora.LoraSettings (rank > 0: adapters, the base frozen)."""
        from tripod.parallel.convert import load_hf_weights
        from tripod.parallel.lora import apply_lora
        from tripod.parallel.lora.checkpoint import lora_metadata
        from tripod.parallel.model import build_model_chunks

        self.name, self.arch, self.layout = name, arch, layout
        self.value_head, self.trainable = value_head, trainable
        self.precision = precision or PrecisionSettings()
        self.device = current_device()  # runtime/device.py decides; megatron allocates on the current device
        # one GPTModel per virtual pipeline stage; `module` is the last one (it holds the output layer)
        if routing_replay and arch.moe is not None:
            config_overrides = {**(config_overrides or {}), "moe_enable_routing_replay": True}
        self.chunks = build_model_chunks(arch, layout, virtual_pipeline_size=virtual_pipeline_size,
                                         value_head=value_head, params_dtype=self.precision.param_dtype, seed=seed,
                                         sequence_parallel=sequence_parallel, use_te=use_te,
                                         use_cpu_initialization=self.device.type == "cpu",
                                         **self.precision.transformer_overrides(), **(config_overrides or {}))
        model = self.chunks[-1]
        with layout.activate():
            load_hf_weights(self.chunks, hf_dir, load_arch or arch, layout)
        for chunk in self.chunks:
            cast_floating_params(chunk, self.precision.param_dtype)
        if not value_head and layout.is_last_stage:
            bypass_output_layer(model, layout.tp_group)
        self.lora = apply_lora(self.chunks, arch, lora) if lora is not None and lora.rank > 0 else []  # frozen base
        self.checkpoint_metadata = lora_metadata(lora, hf_dir)  # the adapters' settings and base path (or {})
        self.module = model
        self.routing = None
        if routing_replay and arch.moe is not None:
            from tripod.parallel.router_replay import RoutingReplay

            self.routing = RoutingReplay(self.chunks, layout, arch.moe.num_experts, arch.moe.topk,
                                         sum(arch.moe.layer_is_moe), sequence_parallel)
        # a packed prompt counts once, not once per row: that would change what the router's load-balancing loss and
        # expert-bias update see (both are statistics over the micro-batch's tokens), so those runs do not pack
        router_stats = (config_overrides or {}).get("moe_router_load_balancing_type", "none") != "none" or \
            (config_overrides or {}).get("moe_router_bias_update_rate", 0.0) > 0
        self.thd = te_thd and model.tripod_use_te
        self.can_pack = (not model.tripod_use_te or self.thd) and not router_stats and \
            all(rope_with_slot_positions(c) for c in self.chunks)
        self.share_prompt_prefix, self.remove_padding = share_prompt_prefix and not self.thd, remove_padding
        self.model, self.optimizer, self.lr_scheduler = list(self.chunks), None, None
        if trainable:
            optim = optim or OptimConfig()
            self.model, self.optimizer = self._wrap_for_training(self.chunks, optim, grad_clip)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, optim, total_steps, f"{name}.optim")
        else:
            for chunk in self.chunks:
                for p in chunk.parameters():
                    p.requires_grad_(False)
        self._device = next(model.parameters()).device
        if self._device.type != self.device.type:
            raise RuntimeError(f"{name}: megatron built the model on {self._device}, the chosen device is "
                               f"{self.device} (runtime/device.py)")
        trim_host_heap(self.device)  # the HF load's transients

    def _move_params(self, device: torch.device) -> None:
        """Every parameter's data to `device` (pinned on the host when CUDA is there): the reward model's move
        between scorings (engine/workers/reward_model.py; the PPO phases' moves are runtime/offload.py's)."""
        for p in (p for chunk in self.chunks for p in chunk.parameters()):
            if p.device != device:
                p.data = p.data.to(device, non_blocking=True).pin_memory() if device.type == "cpu" and \
                    torch.cuda.is_available() else p.data.to(device, non_blocking=True)

    def _wrap_for_training(self, chunks, optim: OptimConfig, grad_clip: float):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from tripod.parallel.megatron_patches.cpu_adam import fuse_cpu_adam

        prec = self.precision
        if prec.use_distributed_optimizer:
            from tripod.parallel.megatron_patches.gloo_collectives import install_inplace_gloo_collectives
            install_inplace_gloo_collectives()  # gloo's reduce-scatter / all-gather would copy the whole buffer
        with self.layout.activate():
            ddp = [DistributedDataParallel(  # gradients reduced (and, for bf16 params, accumulated) in fp32
                config=chunk.config, module=chunk, pg_collection=self.layout.pg_collection,
                ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                         use_distributed_optimizer=prec.use_distributed_optimizer))
                for chunk in chunks]
            opt = get_megatron_optimizer(OptimizerConfig(
                optimizer=optim.optimizer, lr=optim.lr, min_lr=optim.min_lr_ratio * optim.lr,
                weight_decay=optim.weight_decay, adam_beta1=optim.betas[0], adam_beta2=optim.betas[1],
                adam_eps=optim.eps, clip_grad=grad_clip, **prec.optimizer_overrides()), ddp,
                use_gloo_process_groups=False, pg_collection=self.layout.pg_collection)
            fuse_cpu_adam(opt)  # megatron builds torch's slow per-tensor loop on CPU (megatron_patches/cpu_adam.py)
            for chunk in chunks:
                chunk.config.finalize_model_grads_func = finalize_model_grads
        return ddp, opt

    # ---- running micro-batches ----------------------------------------------------------------
    def moe_aux_loss(self, num_microbatches: int) -> float | None:
        """The load-balancing loss of the micro-batches just run (mean over MoE layers and micro-batches, averaged
        over DP), then clears megatron's tracker; None when the model has no such loss. Call on every rank of the
        layout (collectives).

        Reduced as megatron's reduce_aux_losses_tracker_across_ranks + track_moe_metrics do it: summed over PP (each
        stage fills its own layers), summed over the router's TP(xCP) group (each TP rank tracks its share of the
        tokens), averaged over DP (as SUM / dp: gloo has no AVG); per layer it is the loss before its coefficient."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        cfg = self.module.config
        name = MOE_AUX_LOSS_NAMES.get(getattr(cfg, "moe_router_load_balancing_type", "none"))
        tracker = get_moe_layer_wise_logging_tracker()
        if name is None or not cfg.num_moe_experts or not cfg.moe_aux_loss_coeff:
            tracker.clear()
            return None
        values = tracker[name]["values"] if name in tracker else torch.zeros(cfg.num_layers, device=self.device)
        values = values.to(self.device, torch.float32) / max(num_microbatches, 1)
        lay = self.layout
        for group, size in ((lay.pp_group, lay.pp), (lay.tp_group, lay.tp), (lay.dp_group, lay.dp)):
            if size > 1:
                dist.all_reduce(values, group=group)
        tracker.clear()
        moe_layers = sum(cfg.moe_layer_freq) if isinstance(cfg.moe_layer_freq, list) else cfg.num_layers
        return float(values.sum()) / max(moe_layers, 1) / lay.dp

    def dp_rows(self, n: int) -> slice:
        return split_rows(n, self.layout.dp)[self.layout.dp_rank]

    def run(self, microbatches: list[PPOBatch], loss_fn: Callable, forward_only: bool) -> list[dict]:
        """Forward (and backward) `microbatches` through the pipeline; `loss_fn(output, mb) -> (loss, dict)`.

        Returns the dicts from the last stage (one per micro-batch); [] on other stages.
        """
        from tripod.parallel.model import packed_seq_params
        from tripod.parallel.pipeline import run_pipeline, variable_shapes
        from tripod.parallel.sdpa_attention import causal_masks

        dev = self.device
        mbs = [PPOBatch(to_device(mb.tensors, dev), mb.meta) for mb in microbatches]
        packs = [self.packed_layout(mb) for mb in mbs]
        seqs = [p.seq if p is not None else mb["input_ids"].shape[1] for p, mb in zip(packs, mbs)]
        # Each micro-batch keeps its own [rows, seq] (a token-budget micro-batch is not padded back to the longest);
        # at PP > 1 megatron then exchanges each activation's shape first (its variable_seq_lengths). MoE's allgather
        # token dispatcher gathers over EP, across DP ranks whose micro-batches differ: there every micro-batch of a
        # call has one shape over the group (engine/workers/moe_shapes.py).
        uniform = bool(self.module.config.num_moe_experts)
        if uniform:
            packs, seqs, rows = uniform_shapes(mbs, packs, seqs, self.layout, dev)
        cp, sp_tp = self.layout.cp, self.layout.tp if self.module.config.sequence_parallel else 1
        if cp > 1:  # 2*cp chunks (parallel/context_parallel.py), each rank's part split over TP with SP
            seqs = [padded_length(seq, cp, sp_tp) for seq in seqs]
        elif sp_tp > 1:  # megatron splits the sequence evenly over TP
            seqs = [-(-seq // sp_tp) * sp_tp for seq in seqs]
        for i, (mb, p) in enumerate(zip(mbs, packs)):
            mbs[i] = pad_rows_to(mb, seqs[i]) if p is None else mb
            mbs[i].packed = p.padded_to(seqs[i]) if p is not None else None
            mbs[i].packed = with_rows(mbs[i], rows) if uniform else mbs[i].packed
        causal = causal_masks(self.model, seqs, dev)  # None: is_causal, no [s, s] mask (parallel/sdpa_attention.py)

        def forward_step(mb, model):
            packed = mb.packed
            ids = packed.input_ids if packed is not None else mb["input_ids"]
            thd = packed_seq_params(packed, getattr(_unwrap(model), "tripod_use_te", False))  # TE: THD, no mask
            rope = getattr(_unwrap(model), "rotary_pos_emb", None)
            if rope is not None and hasattr(rope, "tripod_positions"):
                rope.tripod_positions = packed.positions if packed is not None and thd is None else None
            if self.routing is not None:  # this micro-batch's expert ids, in the order the routers see its tokens
                self.routing.before(model, mb, *ids.shape, local_slots(ids.shape[1], cp, self.layout.cp_rank)
                                    if cp > 1 and thd is None else None)
            if thd is not None:  # TE's THD format, no mask (a TE model at CP > 1 runs rows unpacked)
                pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0).expand_as(ids)
                out = model(input_ids=ids, position_ids=pos, attention_mask=None, packed_seq_params=thd)
                if self.routing is not None:
                    self.routing.after(model)
                return out, lambda output: loss_fn(output, mb)
            mask = packed.mask if packed is not None else causal[ids.shape[1]]
            if cp > 1:  # this rank's slots; RoPE takes their global positions
                slots = packed.positions if packed is not None else torch.arange(ids.shape[1], device=dev)
                ids, slots, mask = split_for_cp(ids, slots, mask, cp, self.layout.cp_rank)
                if rope is not None and hasattr(rope, "tripod_positions"):  # TE's CP: megatron's RoPE slices itself
                    rope.tripod_positions = slots
            pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0).expand_as(ids)
            out = model(input_ids=ids, position_ids=pos, attention_mask=mask)
            if self.routing is not None:
                self.routing.after(model)
            return out, lambda output: loss_fn(output, mb)

        if not forward_only:
            trim_host_heap(dev)  # earlier stages' garbage, before this pass's activations
            from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

            get_moe_layer_wise_logging_tracker().clear()  # moe_aux_loss() then reads this run's routers only
            with self.layout.activate():
                for chunk in self.model:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
        set_training(self.model, not forward_only)
        shapes = {(mb.packed.input_ids.shape[0] if mb.packed is not None else mb.size, seq) for mb, seq in zip(mbs, seqs)}
        rows, seq = max(shapes)
        with variable_shapes(self.model, self.layout.pp > 1 and len(shapes) > 1):
            return run_pipeline(self.model, self.layout, mbs, forward_step, forward_only=forward_only,
                                seq_length=seq, micro_batch_size=rows)

    def packed_layout(self, mb: PPOBatch):
        """The packed layout of micro-batch `mb` (engine/workers/packing.py), or None to run its rows as they are."""
        if not self.can_pack:
            return None
        if self.thd:
            return pack_thd(mb)
        if self.remove_padding:
            return pack_without_padding(mb, self.share_prompt_prefix)
        return pack_shared_prompts(mb) if self.share_prompt_prefix else None

    def step(self) -> float:
        """Optimizer step after `run(..., forward_only=False)`, then one LR-scheduler step; returns the grad norm."""
        self.last_lr = self.lr
        with self.layout.activate():
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError(f"{self.name} optimizer step was skipped (non-finite gradients)")
        self.lr_scheduler.step(1)
        return float(grad_norm)

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return float(self.optimizer.param_groups[0]["lr"])

    # ---- heads ---------------------------------------------------------------------------------
    def response_outputs(self, output: torch.Tensor, mb: PPOBatch,
                         only: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows of the model output [b, s, ...] that predict the response tokens (packed or not), and which
        [N, R] positions they are: ([N, R, ...] every position, None), or with `only` (an [N, R] bool mask) or context
        parallelism ([K, ...], their [N, R] mask): the K positions of `only` (all without it) that this CP rank holds
        (its output has its own slots only). `_per_token` makes full [N, R] tensors of what is computed from them."""
        seq = (mb.packed.input_ids if mb.packed is not None else mb["input_ids"]).shape[1]
        flat = output.reshape(output.shape[0] * output.shape[1], *output.shape[2:])
        if mb.packed is not None:
            index = mb.packed.gather.to(output.device)
        else:
            rows = torch.arange(mb.size, device=output.device)[:, None]
            index = rows * seq + mb.response_positions().to(output.device)
        picked = None if only is None else only.to(output.device)
        if self.layout.cp > 1:
            held, index = held_positions(index, seq, self.layout.cp, self.layout.cp_rank)
            picked = held if picked is None else held & picked
        if picked is None:
            return flat[index], None
        return flat[index[picked]], picked

    def _per_token(self, values: torch.Tensor, picked: torch.Tensor | None) -> torch.Tensor:
        """[N, R] per-token results: as they are when computed at every position, else the [K] results scattered
        into zeros at `picked`; with CP summed over the CP group (context_parallel.sum_over_cp: the gradient
        reaches each rank's own tokens)."""
        if picked is None:
            return values
        full = values.new_zeros(picked.shape).index_put((picked,), values)
        return sum_over_cp(full, self.layout.cp_group) if self.layout.cp > 1 else full

    def token_logprobs(self, output: torch.Tensor, mb: PPOBatch, temperature: float,
                       with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) [N, R] of the response tokens from the last stage's hidden states [b, s, h].

        The LM head runs at the real response tokens only (`response_mask` > 0; every position of a batch without
        one): log-prob and entropy are 0 at padding, which every consumer masks out anyway. Every TP rank picks
        the same positions (one mask), as the vocab-parallel head's collectives need."""
        from tripod.kernels import logprobs_from_hidden

        real = mb.tensors.get("response_mask")
        hidden, picked = self.response_outputs(output, mb, None if real is None else real > 0)
        responses = mb["responses"]
        labels = responses if picked is None else responses[picked.to(responses.device)].to(hidden.device)
        m = self.module  # the weight GPTModel's output layer would use (tied: the embedding, or its last-stage copy)
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight
        logp, ent = logprobs_from_hidden(hidden, weight, labels, temperature=temperature,
                                         tp_group=self.layout.tp_group if self.layout.tp > 1 else None,
                                         with_entropy=with_entropy, vocab_size=self.arch.vocab_size,
                                         reduce_hidden_grad=not m.config.sequence_parallel)
        return self._per_token(logp, picked), None if ent is None else self._per_token(ent, picked)

    def token_values(self, output: torch.Tensor, mb: PPOBatch) -> torch.Tensor:
        """Critic values [b, R] at the positions that predict each response token."""
        values, held = self.response_outputs(output, mb)
        return self._per_token(values.squeeze(-1).float(), held)

    # ---- moving per-row results ------------------------------------------------------------------
    def gather_rows(self, local: torch.Tensor | None, shape_tail: tuple[int, ...], n_rows: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This DP rank's rows (on the last stage) -> all N rows on every rank of the layout."""
        lay = self.layout
        rows = n_rows // lay.dp
        if local is None:
            local = torch.empty((rows, *shape_tail), dtype=dtype, device=self.device)
        local = local.to(self.device, dtype).contiguous()
        if lay.pp > 1:
            dist.broadcast(local, src=lay.group_ranks("pp")[-1], group=lay.pp_group)
        if lay.dp == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(lay.dp)]
        dist.all_gather(parts, local, group=lay.dp_group)
        return torch.cat(parts, 0)

    def rows_of_stages(self, local: torch.Tensor | None, shape_tail: tuple[int, ...], n_rows: int) -> torch.Tensor:
        """This rank's `n_rows` results (computed on the last stage) on every stage of its pipeline: a sharded batch's
        rows (engine/workers/row_shards.py), which stay on their DP rank."""
        local = (torch.empty((n_rows, *shape_tail), device=self.device) if local is None
                 else local.to(self.device, torch.float32).contiguous())
        if self.layout.pp > 1:
            dist.broadcast(local, src=self.layout.group_ranks("pp")[-1], group=self.layout.pp_group)
        return local

    def sum_over_dp(self, values: dict[str, float]) -> dict[str, float]:
        """Sum scalar metrics over the DP group (after bringing them from the last stage)."""
        lay = self.layout
        if lay.pp > 1:  # only the last stage has them (other stages pass {})
            box = [values]
            dist.broadcast_object_list(box, src=lay.group_ranks("pp")[-1], group=lay.pp_group)
            values = box[0]
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        if lay.dp > 1:
            dist.all_reduce(t, group=lay.dp_group)
        return dict(zip(keys, t.tolist()))


def set_training(chunks: list[torch.nn.Module], training: bool) -> None:
    """Train mode (dropout: LoRA's `lora.dropout`, megatron's hidden / attention dropout) only in passes whose
    gradients train; the passes without gradients (old log-probs, reference, values, a teacher) run in eval mode, as
    verl's compute_log_prob / compute_values do and as the rollout's merged weights (no dropout) generate: a dropout
    there would make the old log-probs a noisy sample the rollout never drew from."""
    for chunk in chunks:
        chunk.train(training)
