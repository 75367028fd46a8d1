"""One Megatron model (actor, critic or reference) on its own parallel layout, and how the PPO step drives it.

A worker owns: the GPTModel shard of this rank (built from the HF checkpoint), its DDP wrapper and optimizer when it
trains, and `run()`, which pushes micro-batches through megatron's pipeline schedule with a loss function.
Everything megatron does for this model runs inside `layout.activate()` (see parallel/layout.py), so actor, critic
and reference can have different TP/PP/DP sizes in the same world.

Data flow: every rank holds the whole `PPOBatch`; a worker takes its DP rank's rows, cuts them into micro-batches,
and `gather_rows()` brings per-row results back to every rank (broadcast from the last PP stage, all-gather over DP).

Policy heads never materialise [tokens, vocab] logits: the output layer is bypassed (it returns the hidden state)
and `kernels.logprobs_from_hidden` computes log-probs / entropy of the sampled tokens straight from the hidden state
and the vocab-parallel LM-head weight.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from engine.workers.batch import PPOBatch, split_rows
from parallel.arch import ModelArch


@dataclass
class OptimSettings:
    optimizer: str = "adam"  # megatron-core's OptimizerConfig.optimizer: adam | sgd
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0


def _bypass_output_layer(model) -> None:
    """Make GPTModel return hidden states [b, s, h] (the LM head is applied by the fused log-prob kernel)."""
    def forward(hidden, weight=None, runtime_gather_output=None):
        return hidden, None

    model.output_layer.forward = forward


class MegatronWorker:
    def __init__(self, name: str, arch: ModelArch, layout, hf_dir: str, *, value_head: bool = False,
                 trainable: bool = True, optim: OptimSettings | None = None, seed: int = 1234,
                 params_dtype: torch.dtype = torch.float32, offload: bool = False):
        from parallel.convert import load_hf_weights
        from parallel.model import build_gpt_model

        self.name, self.arch, self.layout = name, arch, layout
        self.value_head, self.trainable = value_head, trainable
        model = build_gpt_model(arch, layout, value_head=value_head, params_dtype=params_dtype, seed=seed)
        with layout.activate():
            load_hf_weights(model, hf_dir, arch, layout)
        if not value_head and layout.is_last_stage:
            _bypass_output_layer(model)
        self.module = model
        self.model, self.optimizer = model, None
        if trainable:
            self.model, self.optimizer = self._wrap_for_training(model, optim or OptimSettings())
        else:
            for p in model.parameters():
                p.requires_grad_(False)
        self.offload = offload and not trainable
        self._device = next(model.parameters()).device
        if self.offload:
            self._move_params(torch.device("cpu"))

    def _move_params(self, device: torch.device) -> None:
        for p in self.module.parameters():
            if p.device != device:
                p.data = p.data.to(device, non_blocking=True).pin_memory() if device.type == "cpu" and \
                    torch.cuda.is_available() else p.data.to(device, non_blocking=True)

    @contextlib.contextmanager
    def resident(self):
        """Parameters on the compute device for the block (a no-op unless the worker offloads them)."""
        if self.offload:
            self._move_params(self._device)
        try:
            yield
        finally:
            if self.offload:
                self._move_params(torch.device("cpu"))

    def _wrap_for_training(self, model, optim: OptimSettings):
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        with self.layout.activate():
            ddp = DistributedDataParallel(
                config=model.config, module=model, pg_collection=self.layout.pg_collection,
                ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                         use_distributed_optimizer=False))
            opt = get_megatron_optimizer(OptimizerConfig(
                optimizer=optim.optimizer, lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
                adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.grad_clip,
                params_dtype=model.config.params_dtype, bf16=model.config.bf16), [ddp],
                use_gloo_process_groups=False, pg_collection=self.layout.pg_collection)
            model.config.finalize_model_grads_func = finalize_model_grads
        return ddp, opt

    # ---- running micro-batches ----------------------------------------------------------------
    def dp_rows(self, n: int) -> slice:
        return split_rows(n, self.layout.dp)[self.layout.dp_rank]

    def run(self, microbatches: list[PPOBatch], loss_fn: Callable, forward_only: bool) -> list[dict]:
        """Forward (and backward) `microbatches` through the pipeline; `loss_fn(output, mb) -> (loss, dict)`.

        Returns the dicts from the last stage (one per micro-batch); [] on other stages.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        seq = max(mb["input_ids"].shape[1] for mb in microbatches)
        mbs = [_pad_to(mb, seq) for mb in microbatches]
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]  # right padding: causal is enough

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            ids = mb["input_ids"]
            pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
            out = model(input_ids=ids, position_ids=pos, attention_mask=mask)
            return out, lambda output: loss_fn(output, mb)

        with self.layout.activate():
            if not forward_only:
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
            kwargs = dict(pg_collection=self.layout.pg_collection)
            if self.layout.pp > 1:
                kwargs["p2p_communicator"] = self.layout.p2p_communicator(self.module.config)
            with torch.set_grad_enabled(not forward_only):
                out = get_forward_backward_func(pp_size=self.layout.pp)(
                    forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.model],
                    num_microbatches=len(mbs), seq_length=seq, micro_batch_size=mbs[0]["input_ids"].shape[0],
                    forward_only=forward_only, **kwargs)
        return out if self.layout.is_last_stage else []

    def step(self) -> float:
        """Optimizer step after `run(..., forward_only=False)`; returns the global grad norm."""
        with self.layout.activate():
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError(f"{self.name} optimizer step was skipped (non-finite gradients)")
        return float(grad_norm)

    # ---- heads ---------------------------------------------------------------------------------
    def token_logprobs(self, output: torch.Tensor, mb: PPOBatch, temperature: float,
                       with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of the response tokens from the last stage's hidden states [b, s, h]."""
        from kernels import logprobs_from_hidden

        pos = mb.response_positions()
        hidden = output.gather(1, pos[..., None].expand(-1, -1, output.shape[-1]))
        m = self.module  # the weight GPTModel's output layer would use (tied: the embedding, or its last-stage copy)
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight
        return logprobs_from_hidden(hidden, weight, mb["responses"], temperature=temperature,
                                    tp_group=self.layout.tp_group if self.layout.tp > 1 else None,
                                    with_entropy=with_entropy, vocab_size=self.arch.vocab_size)

    def token_values(self, output: torch.Tensor, mb: PPOBatch) -> torch.Tensor:
        """Critic values [b, R] at the positions that predict each response token."""
        values = output.squeeze(-1).float()
        return values.gather(1, mb.response_positions())

    # ---- moving per-row results ------------------------------------------------------------------
    def gather_rows(self, local: torch.Tensor | None, shape_tail: tuple[int, ...], n_rows: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This DP rank's rows (on the last stage) -> all N rows on every rank of the layout."""
        lay = self.layout
        rows = n_rows // lay.dp
        if local is None:
            local = torch.empty((rows, *shape_tail), dtype=dtype)
        local = local.to(dtype).contiguous()
        if lay.pp > 1:
            dist.broadcast(local, src=lay.group_ranks("pp")[-1], group=lay.pp_group)
        if lay.dp == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(lay.dp)]
        dist.all_gather(parts, local, group=lay.dp_group)
        return torch.cat(parts, 0)

    def sum_over_dp(self, values: dict[str, float]) -> dict[str, float]:
        """Sum scalar metrics over the DP group (after bringing them from the last stage)."""
        lay = self.layout
        if lay.pp > 1:  # only the last stage has them (other stages pass {})
            box = [values]
            dist.broadcast_object_list(box, src=lay.group_ranks("pp")[-1], group=lay.pp_group)
            values = box[0]
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        if lay.dp > 1:
            dist.all_reduce(t, group=lay.dp_group)
        return dict(zip(keys, t.tolist()))


def _pad_to(mb: PPOBatch, seq: int) -> PPOBatch:
    ids = mb["input_ids"]
    if ids.shape[1] == seq:
        return mb
    out = dict(mb.tensors)
    out["input_ids"] = torch.nn.functional.pad(ids, (0, seq - ids.shape[1]))
    out["attention_mask"] = torch.nn.functional.pad(mb["attention_mask"], (0, seq - ids.shape[1]))
    return PPOBatch(out, mb.meta)
