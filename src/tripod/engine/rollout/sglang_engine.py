"""The SGLang rollout backend: an offline `sglang.Engine` per rollout TP group, fed from the shard.

Layout: the TP group's first rank launches one `sglang.Engine(tp_size=tg, ...)`, which spawns its own
scheduler processes on that group's tg GPUs (GPU ids base_gpu_id .. base_gpu_id + tg - 1; by default
the first rank's LOCAL_RANK). Extra `sglang.Engine` options: actor_rollout_ref.rollout.engine_kwargs.
Every PPO step (driven by engine/rollout/weight_sync.py's WeightSync):
  resume_memory()  -> engine.resume_memory_occupation()         (needs enable_memory_saver=True)
  load_weights(s)  -> bucket by bucket (engine/rollout/weight_sync.py): the bucket's slices are
                      all-gathered over the rollout TP group and merged (FamilySpec.merge) to full HF tensors on every
                      rank (at most one bucket of full tensors per rank), flattened per dtype, and
                      each rank's flat tensor goes to the SGLang TP worker on its own GPU
                      (update_weights_from_tensor, load_format="flattened_bucket", as slime does);
                      then the prefix cache is flushed (the old weights' KV entries are stale).
  generate(...)    -> first rank calls engine.generate(input_ids=..., return_logprob=True); the
                      RolloutOutput is broadcast to the other ranks of the group.
  release_memory() -> engine.release_memory_occupation() (weights + KV cache) for the training phase.
sglang is imported lazily; it needs a CUDA torch, so on CPU `make_rollout_engine("sglang", ...)` raises
a clear ImportError. How this file is checked on a GPU: docs/rollout.md.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
import torch.distributed as dist

from tripod.engine.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    tp_size_and_rank,
    validate_rollout_tp,
)
from tripod.parallel.arch import ModelArch

SGLANG_FIX = ("install it on a CUDA machine (`pip install \"sglang[all]\" torch_memory_saver`, see docs/rollout.md) "
              "or set actor_rollout_ref.rollout.name=embedded")


def require_sglang() -> None:
    """Raise ImportError (naming rollout.name and the fix) unless sglang can be imported."""
    if importlib.util.find_spec("sglang") is None:
        raise ImportError(f"rollout.name='sglang' but the `sglang` package is not installed; {SGLANG_FIX}")
    if not torch.cuda.is_available():
        raise ImportError(f"rollout.name='sglang' needs CUDA GPUs, and this torch sees none; {SGLANG_FIX}")


def sglang_sampling_params(params: SamplingParams, arch: ModelArch, row: int) -> dict[str, Any]:
    """SGLang's sampling_params dict for one request (row = its index, to give n samples distinct seeds)."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "stop_token_ids": sorted(params.stop_ids(arch)),
        "ignore_eos": params.ignore_eos,
    }
    if params.seed is not None and not params.greedy:
        out["sampling_seed"] = params.seed + row
    return out


def output_from_sglang(results: list[dict[str, Any]], num_prompts: int, n: int, pad_token_id: int) -> RolloutOutput:
    """Pack SGLang's per-request result dicts (prompt-major order) into a RolloutOutput."""
    token_rows, logprob_rows, reasons = [], [], []
    for i, res in enumerate(results):
        meta = res["meta_info"]
        ids = [int(t) for t in res["output_ids"]]
        logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"sglang request {i}: {len(ids)} output_ids but {len(logprobs)} output_token_logprobs")
        kind = (meta.get("finish_reason") or {}).get("type")
        if kind not in ("stop", "length"):
            raise RuntimeError(f"sglang request {i} finished with {meta.get('finish_reason')!r} (aborted?)")
        token_rows.append(ids)
        logprob_rows.append(logprobs)
        reasons.append(FINISH_STOP if kind == "stop" else FINISH_LENGTH)
    width = max(1, max(map(len, token_rows)))
    response_ids = torch.full((len(results), width), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros(len(results), width, dtype=torch.float32)
    for row, (ids, lps) in enumerate(zip(token_rows, logprob_rows)):
        response_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        log_probs[row, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return RolloutOutput(prompt_index=torch.arange(num_prompts).repeat_interleave(n), response_ids=response_ids,
                         response_lengths=torch.tensor([len(t) for t in token_rows], dtype=torch.long),
                         log_probs=log_probs, finish_reasons=reasons, pad_token_id=pad_token_id)


class SGLangRolloutEngine(RolloutEngine):
    """`model_path`: the HF checkpoint directory (config + initial weights) SGLang starts from."""

    def __init__(self, arch: ModelArch, tp_group: Any = None, *, model_path: str,
                 mem_fraction_static: float = 0.5, dtype: str = "bfloat16", base_gpu_id: int | None = None,
                 update_bucket_bytes: int = 512 << 20, pad_token_id: int | None = None, **engine_kwargs: Any) -> None:
        super().__init__(arch, tp_group)
        require_sglang()
        self.tp_size, self.tp_rank = tp_size_and_rank(tp_group)
        validate_rollout_tp(arch, self.tp_size)
        self.update_bucket_bytes = update_bucket_bytes
        self.pad_token_id = pad_token_id if pad_token_id is not None else int(arch.hf_config.get("pad_token_id") or 0)
        self.engine = None
        if self.tp_rank == 0:
            import sglang

            if base_gpu_id is None:  # this group's first GPU on the node: the first rank's LOCAL_RANK
                base_gpu_id = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
            options = dict(model_path=model_path, skip_tokenizer_init=True, tp_size=self.tp_size,
                           mem_fraction_static=mem_fraction_static, enable_memory_saver=True, dtype=dtype,
                           base_gpu_id=base_gpu_id)
            options.update(engine_kwargs)  # actor_rollout_ref.rollout.engine_kwargs wins
            self.engine = sglang.Engine(**options)
        self._barrier()

    def _barrier(self) -> None:
        if self.tp_size > 1:
            dist.barrier(group=self.tp_group)

    # ---- weights --------------------------------------------------------------------------------
    def load_weights(self, generation_shard: dict[str, torch.Tensor]) -> None:
        """Push the generation shard bucket by bucket (engine/rollout/weight_sync.py): full HF tensors of one bucket
        on every rank of the group (all-gather over rollout TP), flattened per dtype; each rank's flattened bucket
        goes to the SGLang TP worker on its own GPU as a CUDA IPC handle, gathered to the first rank, which issues
        one `update_weights_from_tensor(load_format="flattened_bucket")` per dtype."""
        from tripod.engine.rollout.weight_sync import flatten_by_dtype, gather_bucket_full, hf_buckets
        from tripod.parallel.convert import canonical_names

        names = canonical_names(self.arch)
        missing, extra = sorted(set(names) - set(generation_shard)), sorted(set(generation_shard) - set(names))
        if missing or extra:
            raise KeyError(f"generation shard does not match the model: missing {missing[:6]}, unexpected {extra[:6]}")
        for bucket in hf_buckets(self.arch, generation_shard, self.tp_size, self.update_bucket_bytes):
            named = gather_bucket_full(self.arch, bucket, generation_shard, self.tp_group, self.tp_size)
            for dtype, (flat, meta) in sorted(flatten_by_dtype(named).items(), key=lambda kv: str(kv[0])):
                self._push_flat(flat, meta)
            del named
        if self.engine is not None:
            self.engine.flush_cache()  # cached prefixes were computed with the old weights
        self._barrier()

    def _push_flat(self, flat: torch.Tensor, meta: list[dict]) -> None:
        from sglang.srt.utils import MultiprocessingSerializer

        bucket = _sglang_flattened_bucket(flat, meta)
        payload = MultiprocessingSerializer.serialize(
            {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}, output_str=True)
        payloads: list[Any] = [None] * self.tp_size if self.tp_rank == 0 else None
        if self.tp_size > 1:
            dist.gather_object(payload, payloads, group=self.tp_group, group_dst=0)
        else:
            payloads = [payload]
        if self.engine is not None:
            self.engine.update_weights_from_tensor(named_tensors=payloads, load_format="flattened_bucket",
                                                   flush_cache=False)
        self._barrier()  # the IPC handles must outlive the receiver's copy

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        result: list[Any] = [None]
        if self.tp_rank == 0:
            requests = [list(p) for p in prompts for _ in range(params.n)]
            sampling = [sglang_sampling_params(params, self.arch, row) for row in range(len(requests))]
            results = self.engine.generate(input_ids=requests, sampling_params=sampling, return_logprob=True)
            result[0] = output_from_sglang(results, len(prompts), params.n, self.pad_token_id)
        if self.tp_size > 1:
            dist.broadcast_object_list(result, group=self.tp_group, group_src=0)
        return result[0]

    # ---- memory ---------------------------------------------------------------------------------
    def release_memory(self) -> None:
        if self.engine is not None:
            self.engine.release_memory_occupation()
        self._barrier()

    def resume_memory(self) -> None:
        if self.engine is not None:
            self.engine.resume_memory_occupation()
        self._barrier()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _sglang_flattened_bucket(flat: torch.Tensor, meta: list[dict]):
    """SGLang's FlattenedTensorBucket over our flat tensor (its module moved between SGLang releases)."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
    except ImportError:  # older SGLang
        from sglang.srt.model_executor.model_runner import FlattenedTensorBucket, FlattenedTensorMetadata
    metadata = [FlattenedTensorMetadata(name=m["name"], shape=torch.Size(m["shape"]), dtype=m["dtype"],
                                        start_idx=m["start_idx"], end_idx=m["end_idx"], numel=m["numel"])
                for m in meta]
    return FlattenedTensorBucket(flattened_tensor=flat, metadata=metadata)
