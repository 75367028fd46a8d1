"""What a worker is built from: its `ParallelLayout` and keyword arguments, read from one `{key}.megatron` config
section. Shared by the PPO trainer (actor, critic, reference, reward model) and `tripod train-rm`."""
from __future__ import annotations

from tripod.engine.workers.lora_options import lora_settings, reference_pass  # noqa: F401 (reference_pass re-exported)
from tripod.engine.workers.moe_config import moe_config_overrides
from tripod.parallel.layout import ParallelLayout
from tripod.parallel.precision import resolve_precision


def layout_of(m, name: str, arch) -> ParallelLayout:
    """The parallel layout a `megatron` config section describes, for the model called `name`. Context parallelism
    is the PPO actor's, critic's and reference's (engine/workers/megatron_worker.py); the reward model refuses it."""
    if name == "reward_model" and m.context_parallel_size > 1:
        raise ValueError(f"reward_model context_parallel_size={m.context_parallel_size}: the reward model does not "
                         "run context parallel; set its megatron.context_parallel_size to 1")
    return ParallelLayout(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                          cp=m.context_parallel_size,
                          ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size, name=name, arch=arch,
                          first_stage_layers=m.num_layers_in_first_pipeline_stage,
                          last_stage_layers=m.num_layers_in_last_pipeline_stage)


def model_options(m, layout: ParallelLayout, key: str, arch, trainable: bool = True, optimizer: str = "adam",
                  lora=None) -> dict:
    """Worker keyword arguments from the `{key}.megatron` config section: precision, sequence parallel, virtual
    stages, the MoE router's load balancing; `lora`: the model's `model.lora` section (its adapters, if rank > 0)."""
    extra = {"lora": lora_settings(lora, key.split(".")[0] + ".model.lora", m.seed)} if lora is not None else {}
    return dict(**extra, sequence_parallel=m.sequence_parallel, virtual_pipeline_size=m.virtual_pipeline_model_parallel_size,
                precision=resolve_precision(m, layout.dp * layout.cp, trainable, optimizer), use_te=m.use_te,
                config_overrides=moe_config_overrides(m, arch, key))
