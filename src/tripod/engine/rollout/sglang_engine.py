"""The SGLang rollout backend: an offline `sglang.Engine` per rollout TP group, fed from the shard.

Written against SGLang 0.5.5 (`pip install "sglang[all]==0.5.5"`: `sglang.srt.weight_sync.tensor_bucket`,
`sglang.srt.utils.patch_torch`, `sglang.srt.constants.GPU_MEMORY_TYPE_*`, `resume_memory_occupation(tags=...)`);
older module paths are tried where they moved. Checked on a GPU by docs/gpu_check.md / docs/rollout.md.

Layout: the TP group's first rank launches one `sglang.Engine(tp_size=tg, ...)`, which spawns its own scheduler
processes on that group's GPUs: `base_gpu_id` = the first rank's LOCAL_RANK and `gpu_id_step` = the stride of the
group's local ranks (rollout TP groups are strided when micro-DP > 1: ranks 0, 2 -> GPUs 0, 2, never 0, 1). Each
engine gets its own `port` / `nccl_port` (SGLANG_BASE_PORT + 100 * engine index), so engines starting together on
one node do not race for a random port. Extra `sglang.Engine` options: actor_rollout_ref.rollout.engine_kwargs.

Control messages (the generated batch, the push's IPC handles, barriers) travel on a gloo group over the TP group's
ranks, so the other ranks wait on the CPU while the first rank generates: no NCCL kernel spins beside SGLang's
workers, and no NCCL watchdog fires during a long generation.

Every PPO step (driven by engine/rollout/weight_sync.py's WeightSync), in slime's memory order:
  resume_memory()  -> torch.cuda.empty_cache(); engine.resume_memory_occupation(tags=[weights])
  load_weights(s)  -> bucket by bucket (engine/rollout/sglang_buckets.py) full HF tensors, flattened per dtype, each
                      rank's flat tensor to the SGLang TP worker on its own GPU (update_weights_from_tensor,
                      load_format="flattened_bucket", serialised after SGLang's torch-reduction patch); the prefix
                      cache is flushed; then resume_memory_occupation(tags=[kv_cache, cuda_graph]) and
                      torch.cuda.ipc_collect() (the IPC handles' memory goes back to the pool)
  generate(...)    -> first rank calls engine.generate(input_ids=..., return_logprob=True; with R3 also
                      return_routed_experts=True, the engine started with enable_return_routed_experts); the
                      RolloutOutput is broadcast to the other ranks of the group (gloo).
  release_memory() -> engine.release_memory_occupation() (weights + KV cache + CUDA graphs) for training.
SGLang sets NCCL_CUMEM_ENABLE / NCCL_NVLS_ENABLE in the process that creates the engine; `sglang_process_env` gives
the same values to every rank before its process group starts (engine/cli/train.py), so all ranks agree.
sglang is imported lazily; it needs a CUDA torch, so on CPU `make_rollout_engine("sglang", ...)` raises a clear
ImportError.
"""
from __future__ import annotations

import importlib.util
import os
import socket
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

SGLANG_RELEASE = "0.5.5"
SGLANG_FIX = (f"install it on a CUDA machine (`pip install \"sglang[all]=={SGLANG_RELEASE}\" torch_memory_saver`, see "
              "docs/rollout.md) or set actor_rollout_ref.rollout.name=embedded")
SGLANG_BASE_PORT = int(os.environ.get("SGLANG_BASE_PORT", "31000"))
PORTS_PER_ENGINE = 100


def require_sglang() -> None:
    """Raise ImportError (naming rollout.name and the fix) unless sglang can be imported."""
    if importlib.util.find_spec("sglang") is None:
        raise ImportError(f"rollout.name='sglang' but the `sglang` package is not installed; {SGLANG_FIX}")
    if not torch.cuda.is_available():
        raise ImportError(f"rollout.name='sglang' needs CUDA GPUs, and this torch sees none; {SGLANG_FIX}")


def sglang_process_env(engine_kwargs: dict[str, Any] | None = None) -> dict[str, str]:
    """The NCCL variables SGLang's Engine writes into the process that creates it (its _set_envs_and_config), for
    the given engine options: set them on EVERY rank before the process group starts, so the ranks that create an
    engine and those that do not run NCCL alike."""
    kw = engine_kwargs or {}
    symm = bool(kw.get("enable_symm_mem", False))
    return {"NCCL_CUMEM_ENABLE": str(int(symm)), "NCCL_NVLS_ENABLE": str(int(bool(kw.get("enable_nccl_nvls")) or symm))}


def engine_placement(members: list[tuple[str, int]], engine_index: int) -> dict[str, int]:
    """sglang.Engine placement options for one rollout TP group from its members' (host, LOCAL_RANK) in group order:
    base_gpu_id, gpu_id_step (the stride of the local ranks), port and nccl_port (disjoint per engine)."""
    hosts = {h for h, _ in members}
    if len(hosts) != 1:
        raise ValueError(f"a rollout TP group spans hosts {sorted(hosts)}; SGLang's engine runs on one node: make "
                         "actor_rollout_ref.rollout.tensor_model_parallel_size fit in trainer.n_gpus_per_node")
    gpus = [g for _, g in members]
    step = gpus[1] - gpus[0] if len(gpus) > 1 else 1
    if step < 1 or gpus != [gpus[0] + i * step for i in range(len(gpus))]:
        raise ValueError(f"rollout TP group on GPUs {gpus}: SGLang places its workers at base_gpu_id + i * gpu_id_step; "
                         "these local ranks are not evenly strided")
    port = SGLANG_BASE_PORT + PORTS_PER_ENGINE * engine_index
    return dict(base_gpu_id=gpus[0], gpu_id_step=step, port=port, nccl_port=port + PORTS_PER_ENGINE // 2)


def sglang_sampling_params(params: SamplingParams, arch: ModelArch, row: int,
                           row_seeds: list[int] | None = None) -> dict[str, Any]:
    """SGLang's sampling_params dict for one request (row = its index, to give n samples distinct seeds; `row_seeds`:
    each row's own seed instead, RolloutEngine.generate). SGLang keeps the
    token that ends a sequence (stop id or the one completing a stop string) in output_ids, as the other backends do;
    its ignore_eos skips stop_token_ids as well, so that combination is refused."""
    if params.ignore_eos and params.stop_token_ids:
        raise ValueError(f"SamplingParams(ignore_eos=True, stop_token_ids={list(params.stop_token_ids)}): SGLang's "
                         "ignore_eos also ignores stop_token_ids; list the ids to stop at without ignore_eos")
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "stop_token_ids": sorted(params.stop_ids(arch)),
        "ignore_eos": params.ignore_eos,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if row_seeds is not None and not params.greedy:
        out["sampling_seed"] = row_seeds[row]
    elif params.seed is not None and not params.greedy:
        out["sampling_seed"] = params.seed + row
    return out


def output_from_sglang(results: list[dict[str, Any]], num_prompts: int, n: int, pad_token_id: int,
                       requests: list[list[int]] | None = None, arch: ModelArch | None = None) -> RolloutOutput:
    """Pack SGLang's per-request result dicts (prompt-major order) into a RolloutOutput; with `requests` (each
    request's prompt ids) the routed experts of each row too (meta_info["routed_experts"]: routing_record.from_sglang)."""
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
    out = RolloutOutput.from_rows(token_rows, logprob_rows, reasons, num_prompts, n, pad_token_id)
    if requests is not None:
        from tripod.engine.rollout.routing_record import from_sglang

        out.routed_experts = [from_sglang(res["meta_info"]["routed_experts"], len(p) + len(ids), arch.moe)
                              for res, p, ids in zip(results, requests, token_rows)]
    return out


def _control_group(tp_group: Any) -> tuple[Any, int]:
    """(a gloo group over `tp_group`'s ranks, the index of this rank's engine). Every rank of the world calls this
    together: the rollout TP groups are exchanged and each gets its gloo twin, created in the same order everywhere."""
    if not dist.is_initialized():
        return None, 0
    mine = dist.get_process_group_ranks(tp_group) if tp_group is not None else [dist.get_rank()]
    groups: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(groups, mine)
    distinct = sorted({tuple(g) for g in groups})
    index = distinct.index(tuple(mine))
    if len(mine) == 1:
        return None, index
    control, _ = dist.new_subgroups_by_enumeration([list(g) for g in distinct], backend="gloo")
    return control, index


class SGLangRolloutEngine(RolloutEngine):
    """`model_path`: the HF checkpoint directory (config + initial weights) SGLang starts from; `tokenizer`: the
    directory SGLang loads its tokenizer from, needed for stop strings (None: SGLang skips it)."""

    def __init__(self, arch: ModelArch, tp_group: Any = None, *, model_path: str,
                 mem_fraction_static: float = 0.5, dtype: str = "bfloat16",
                 update_bucket_bytes: int = 512 << 20, pad_token_id: int | None = None, tokenizer: str | None = None,
                 **engine_kwargs: Any) -> None:
        super().__init__(arch, tp_group)
        self.tokenizer = tokenizer  # a tokenizer directory: SGLang loads it to decode responses for stop strings
        require_sglang()
        self.tp_size, self.tp_rank = tp_size_and_rank(tp_group)
        validate_rollout_tp(arch, self.tp_size)
        self.update_bucket_bytes = update_bucket_bytes
        self.pad_token_id = pad_token_id if pad_token_id is not None else int(arch.hf_config.get("pad_token_id") or 0)
        self.control_group, engine_index = _control_group(tp_group)
        gpu = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else torch.cuda.current_device()
        local = (socket.gethostname(), gpu)
        members: list[Any] = [None] * self.tp_size
        if self.tp_size > 1:
            dist.all_gather_object(members, local, group=self.control_group)
        else:
            members = [local]
        placement = engine_placement(members, engine_index)
        self.engine = None
        self._kv_resumed = False
        # R3: SGLang records each token's experts (server arg) and returns them per request (routing_record.from_sglang)
        self.record_routing = bool(engine_kwargs.get("enable_return_routed_experts", False))
        if self.tp_rank == 0:
            import sglang

            options = dict(model_path=model_path, skip_tokenizer_init=tokenizer is None, tp_size=self.tp_size,
                           mem_fraction_static=mem_fraction_static, enable_memory_saver=True, dtype=dtype, **placement)
            if tokenizer is not None:
                options["tokenizer_path"] = tokenizer
            options.update(engine_kwargs)  # actor_rollout_ref.rollout.engine_kwargs wins
            self.engine = sglang.Engine(**options)
        self._barrier()

    def _barrier(self) -> None:
        if self.tp_size > 1:
            dist.barrier(group=self.control_group)

    # ---- weights --------------------------------------------------------------------------------
    def load_weights(self, generation_shard: dict[str, torch.Tensor]) -> None:
        """Push the generation shard bucket by bucket (engine/rollout/sglang_buckets.py), then bring back the KV
        cache and CUDA graphs (after the weights: the push's transients are gone by then)."""
        from tripod.engine.rollout.sglang_buckets import flatten_by_dtype, gather_bucket_full, hf_buckets
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
        self._resume_kv_cache()
        self._barrier()

    def _push_flat(self, flat: torch.Tensor, meta: list[dict]) -> None:
        from sglang.srt.utils import MultiprocessingSerializer

        _patch_torch_reductions()  # CUDA IPC handles name the device by UUID: right whatever CUDA_VISIBLE_DEVICES
        bucket = _sglang_flattened_bucket(flat, meta)
        payload = MultiprocessingSerializer.serialize(
            {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}, output_str=True)
        payloads: list[Any] = [None] * self.tp_size if self.tp_rank == 0 else None
        if self.tp_size > 1:
            dist.gather_object(payload, payloads, group=self.control_group, group_dst=0)
        else:
            payloads = [payload]
        if self.engine is not None:
            self.engine.update_weights_from_tensor(named_tensors=payloads, load_format="flattened_bucket",
                                                   flush_cache=False)
        self._barrier()  # the IPC handles must outlive the receiver's copy

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 row_seeds: list[int] | None = None) -> RolloutOutput:
        if params.stop and self.tokenizer is None:
            raise ValueError(f"actor_rollout_ref.rollout.stop={list(params.stop)}: stop strings need the tokenizer, and "
                             "this SGLang engine was built without one; pass tokenizer=<its directory> to the engine")
        self._resume_kv_cache()  # a generate without load_weights still needs its KV cache
        result: list[Any] = [None]
        if self.tp_rank == 0:
            requests = [list(p) for p in prompts for _ in range(params.n)]
            sampling = [sglang_sampling_params(params, self.arch, row, row_seeds) for row in range(len(requests))]
            routed = dict(return_routed_experts=True) if self.record_routing else {}
            results = self.engine.generate(input_ids=requests, sampling_params=sampling, return_logprob=True,
                                           **routed)
            result[0] = output_from_sglang(results, len(prompts), params.n, self.pad_token_id,
                                           requests if self.record_routing else None, self.arch)
        if self.tp_size > 1:  # the other ranks wait here, on gloo, for the whole generation
            dist.broadcast_object_list(result, group=self.control_group, group_src=0)
        return result[0]

    # ---- memory ---------------------------------------------------------------------------------
    def release_memory(self) -> None:
        if self.engine is not None:
            self.engine.release_memory_occupation()
        self._kv_resumed = False
        self._barrier()

    def resume_memory(self) -> None:
        """Only the weights come back here; the KV cache and CUDA graphs follow the push (`load_weights`)."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # training's cached blocks go back before SGLang maps its weights
        if self.engine is not None:
            self.engine.resume_memory_occupation(tags=[_memory_tags()[0]])
        self._barrier()

    def _resume_kv_cache(self) -> None:
        if self._kv_resumed:
            return
        if self.engine is not None:
            self.engine.resume_memory_occupation(tags=_memory_tags()[1])
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # free the pushed buckets' IPC-shared memory
        self._kv_resumed = True

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _memory_tags() -> tuple[str, list[str]]:
    """(the weights' tag, the tags resumed after the push: KV cache and, where SGLang has it, CUDA graphs)."""
    from sglang.srt import constants

    after = [constants.GPU_MEMORY_TYPE_KV_CACHE]
    if hasattr(constants, "GPU_MEMORY_TYPE_CUDA_GRAPH"):
        after.append(constants.GPU_MEMORY_TYPE_CUDA_GRAPH)
    return constants.GPU_MEMORY_TYPE_WEIGHTS, after


def _patch_torch_reductions() -> None:
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:  # SGLang < 0.5
        from sglang.srt.patch_torch import monkey_patch_torch_reductions
    monkey_patch_torch_reductions()


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
