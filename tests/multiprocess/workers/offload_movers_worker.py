"""torchrun worker (1 rank): runtime/offload.py's movers executed through its OffloadManager over two PPO steps, with
every offload kind on, next to a twin worker that never offloads.

argv: HF_DIR. Device: $TRIPOD_DEVICE (cpu unless set; scripts/gpu_check.py runs it with cuda, on NCCL).

The stand-in for the device side on CPU: the worker's own tensors are the "device" (their storages, in host memory);
the movers' host copies are separate host allocations (HostStash pins them only when the storage is on CUDA), so
the same code runs on both and what it does is observable on CPU:
  released      after each phase, every storage of a kind the manager put on the host has 0 bytes
                (`untyped_storage().nbytes()`), and every storage of a kind on the device has its bytes back;
                the kinds are enumerated here, independently of the movers (model parameters; DDP grad buffers and
                their main_grad views; the optimizer's main weights that are not model storages, and Adam's state)
  bit for bit   a kind's bytes when it comes back equal its bytes when it left (params and optimizer states);
                gradients come back zeroed (megatron's reload_from_cpu: every update zeroes them first)
  scribble      after each phase that released storages, blocks of the released sizes are allocated, filled with
                0xFF and freed, so a reload that does not copy reads 0xFF, not the old bytes the allocator kept
  twin          log-probs, parameters and optimizer states equal the twin's bit for bit after each update; on CUDA
                within twice the update's own run-to-run difference (a second twin; 0 when it is deterministic)
  plan          the bytes released per kind equal the memory plan's (parallel/memory_phases.py kind_bytes of
                parallel/memory_plan.py ModelMemory), up to megatron's padding with the distributed optimizer
Cases: the actor in bf16 / fp32, with and without the distributed optimizer (param_offload without it moves each
parameter's own storage), and the frozen reference. Prints one `OFFLOAD <json>` line per case, then one `DISTOPT <json>` line per
dtype: the largest difference between the parameters after two updates with and without the distributed optimizer.

TRIPOD_TEST_OFFLOAD_CASES=<case,...> runs only those cases. TRIPOD_TEST_OFFLOAD_PLANT=<bug> plants one bug in the
movers, to show the checks fail:
  optim_skips_main   the optimizer offload leaves the fp32 main weights on the device
  grads_kept         the grads offload does nothing
  reload_no_copy     the reload reallocates each storage without copying the host bytes back
  ddp_params_only    a trained model's params offload moves megatron's DDP param buffers only (the movers before
                     param_offload worked without the distributed optimizer: nothing moved then)
  adam_step_reset    the optimizer reload also resets Adam's step counters (0-dim, not a moved kind: only the twin
                     comparison after the next update sees it)
"""
import json
import math
import os
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker
from tests.helpers.ppo_setup import random_ppo_batch

FINAL: dict[str, list[torch.Tensor]] = {}  # each case's parameters after its two updates (the distributed optimizer check)
PHASES = ["rollout", "old_log_prob", "ref", "values", "update_critic", "update_actor", "checkpoint"]


def plant(bug: str) -> None:
    from tripod.runtime import offload

    if bug == "optim_skips_main":
        original = offload.optimizer_state_tensors

        def states_only(optimizer):
            mains = {id(t) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                     for group in getattr(opt, "shard_fp32_from_float16_groups", None) or
                     getattr(opt, "fp32_from_float16_groups", None) or [] for t in group}
            return [t for t in original(optimizer) if id(t) not in mains]
        offload.optimizer_state_tensors = states_only
    elif bug == "grads_kept":
        offload._move_grads = lambda worker, to: None
    elif bug == "reload_no_copy":
        def reload(self):
            for t, host in self.held:
                t.untyped_storage().resize_(host.numel())
            self.held.clear()
        offload.HostStash.reload = reload
    elif bug == "ddp_params_only":
        every = offload.model_parameters
        offload.model_parameters = lambda worker: [p for b in offload._ddp_buffers(worker) if b.param_data is not None
                                                   for p in b.params] if worker.trainable else every(worker)
    elif bug == "adam_step_reset":
        movers = offload.worker_movers

        def resetting(worker):
            out = movers(worker)
            if "optim" in out:
                move = out["optim"]

                def optim(to):
                    move(to)
                    for opt in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
                        for state in opt.optimizer.state.values():
                            if "step" in state and to == offload.DEVICE:
                                state["step"].zero_() if torch.is_tensor(state["step"]) else state.update(step=0)
                out["optim"] = optim
            return out
        offload.worker_movers = resetting
    else:
        raise ValueError(f"unknown TRIPOD_TEST_OFFLOAD_PLANT={bug!r}")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


class Kinds:
    """The tensors of each kind of one worker, found here (not through runtime/offload.py's lists). Built while
    everything is on the device: the main weights are the optimizer's params that are not model storages."""

    def __init__(self, worker):
        self.worker = worker
        self.params = [p for chunk in worker.chunks for p in chunk.parameters()]
        if not worker.trainable:
            return
        model = {p.untyped_storage().data_ptr() for p in self.params}
        self.main = [p for opt in self.optimizers() for g in opt.optimizer.param_groups for p in g["params"]
                     if p.untyped_storage().data_ptr() not in model]
        buffers = [b for chunk in worker.model for b in chunk.buffers + chunk.expert_parallel_buffers]
        self.grads = [b.grad_data for b in buffers] + [p.main_grad for p in self.params if hasattr(p, "main_grad")]

    def optimizers(self) -> list:
        opt = self.worker.optimizer
        return getattr(opt, "chained_optimizers", [opt])

    def of(self, kind: str) -> list[torch.Tensor]:
        if kind == "params":
            return self.params
        if kind == "grads":
            return self.grads
        states = [v for opt in self.optimizers() for s in opt.optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        return self.main + states

    def kinds(self) -> tuple[str, ...]:
        return ("params", "grads", "optim") if self.worker.trainable else ("params",)


def storage_sizes(tensors: list[torch.Tensor]) -> list[int]:
    """Bytes of each distinct non-empty storage under `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return list(seen.values())


def scribble(sizes: list[int], device: torch.device) -> None:
    junk = [torch.full((n,), 0xFF, dtype=torch.uint8, device=device) for n in sizes]
    del junk


def compare(name: str, mine: list[torch.Tensor], twin: list[torch.Tensor], noise: list[torch.Tensor] | None) -> float:
    """Max |mine - twin| over the tensors: bit for bit without `noise` (CPU); with it (CUDA, a second twin), at most
    twice the twins' own max difference (0 when the update is deterministic)."""
    assert len(mine) == len(twin), (name, len(mine), len(twin))
    if noise is None:
        for i, (a, b) in enumerate(zip(mine, twin)):
            assert torch.equal(bits(a), bits(b)), f"{name}[{i}] differs from the twin that never offloaded"
        return 0.0
    diffs = [(a.double() - b.double()).abs().max().item() for a, b in zip(mine, twin) if a.numel()]
    noises = [(a.double() - b.double()).abs().max().item() for a, b in zip(noise, twin) if a.numel()]
    assert all(math.isfinite(d) for d in diffs + noises), f"{name}: a non-finite difference {diffs} / {noises}"
    worst, bound = max(diffs, default=0.0), 2 * max(noises, default=0.0)
    assert worst <= bound, f"{name}: max |offloaded - twin| {worst} beyond twice the twins' own difference {bound}"
    return worst


def run_case(name, hf_dir, arch, layout, batch, dtype, dist_opt, trainable, cuda) -> dict:
    from tripod.engine.config import ActorConfig, OptimConfig
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.memory_phases import kind_bytes
    from tripod.parallel.memory_plan import ModelMemory
    from tripod.parallel.precision import PrecisionSettings
    from tripod.runtime.offload import DEVICE, HOST, OffloadFlags, OffloadManager, worker_movers

    def build():
        torch.manual_seed(0)
        return PolicyWorker(name, arch, layout, hf_dir, trainable=trainable, grad_clip=1e9,
                            optim=OptimConfig(lr=1e-3, weight_decay=0.0),
                            precision=PrecisionSettings(param_dtype=dtype, use_distributed_optimizer=dist_opt))

    worker, twin = build(), build()
    twin2 = build() if cuda else None  # the update's own run-to-run difference on CUDA
    kinds, twin_kinds = Kinds(worker), Kinds(twin)
    twin2_kinds = Kinds(twin2) if cuda else None
    flags = OffloadFlags(params=True, grads=trainable, optim=trainable)
    left: dict[str, list[torch.Tensor]] = {}  # a kind's bytes when it last left the device
    released = {k: 0 for k in kinds.kinds()}
    stats = {"phases": 0, "released_checks": 0, "reload_checks": 0, "twin_max_diff": 0.0}
    acfg = ActorConfig(ppo_mini_batch_size=batch.size // 2, ppo_micro_batch_size_per_gpu=2, clip_ratio_low=0.2,
                       clip_ratio_high=0.2)

    model = "actor" if trainable else "reference"  # the name the phase table (USES) knows
    managed: list = []

    def enter(phase):
        """Enter `phase` (idle: build the manager, which sends every kind to the host), then check every kind."""
        was = dict(managed[0].where[model]) if managed else {k: DEVICE for k in kinds.kinds()}
        before = {k: [bits(t) for t in kinds.of(k)] for k in kinds.kinds() if was[k] == DEVICE}
        sizes = {k: storage_sizes(kinds.of(k)) for k in before}
        if managed:
            managed[0].enter(phase)
        else:
            managed.append(OffloadManager({model: flags}, {model: worker_movers(worker)}, execute=True))
        stats["phases"] += 1
        freed: list[int] = []
        for k in kinds.kinds():
            now, tensors = managed[0].where[model][k], kinds.of(k)
            if now == HOST:
                assert all(t.untyped_storage().nbytes() == 0 for t in tensors), \
                    f"{name} {phase}: {k} on the host, but a device storage still holds bytes"
                stats["released_checks"] += 1
                if was[k] == DEVICE:
                    left[k], released[k] = before[k], max(released[k], sum(sizes[k]))
                    freed += sizes[k]
            else:
                assert all(t.untyped_storage().nbytes() > 0 for t in tensors if t.numel()), \
                    f"{name} {phase}: {k} on the device, but a storage is empty"
                if was[k] == HOST:
                    if k == "grads":
                        assert all(not t.any() for t in tensors), f"{name} {phase}: grads came back non-zero"
                    else:  # the same tensors (Adam's state exists once the first update made it)
                        back = [bits(t) for t in tensors]
                        assert len(back) == len(left[k]) and all(torch.equal(a, b) for a, b in zip(back, left[k])), \
                            f"{name} {phase}: {k} did not come back bit for bit"
                    stats["reload_checks"] += 1
        scribble(freed, worker.device)

    def against_twin(what, kinds_list):
        for k in kinds_list:
            noise = twin2_kinds.of(k) if cuda else None
            stats["twin_max_diff"] = max(stats["twin_max_diff"], compare(f"{name}.{k} ({what})", kinds.of(k),
                                                                        twin_kinds.of(k), noise))

    enter("idle")
    twins = [twin] + ([twin2] if cuda else [])
    for step in range(2):
        for phase in (PHASES if trainable else ["ref", "values"]):
            enter(phase)
            if phase == ("old_log_prob" if trainable else "ref"):
                logp, _ = worker.compute_log_probs(batch, 2, 1.0)
                ref = [t.compute_log_probs(batch, 2, 1.0)[0] for t in twins]
                compare(f"{name} log-probs", [logp], ref[:1], ref[1:] or None)
                batch["old_log_probs"] = ref[0]
            if phase == "update_actor":
                for w in [worker] + twins:
                    w.update(batch, acfg, 1.0, 1)
                against_twin(f"step {step + 1}", ("params", "optim"))
            if phase == "checkpoint":
                against_twin(f"step {step + 1} save", ("params", "optim"))
    plan = kind_bytes(ModelMemory(name, 1, 1, 1, dtype, trainable, dist_opt).compute(arch))
    pad = padding(kinds) if dist_opt else 0
    bound = {"params": pad * torch.empty((), dtype=dtype).element_size(), "grads": pad * 4, "optim": 0}
    for k, n in released.items():
        assert 0 < plan[k] <= n <= plan[k] + bound[k], \
            f"{name}: {k} released {n} bytes, the memory plan says {plan[k]} (+ at most {bound[k]} of padding)"
    FINAL[name] = [t.detach().double().cpu() for t in twin_kinds.of("params")]  # the twin: never offloaded
    return {"case": name, "released": released, "plan": {k: plan[k] for k in released},
            "padding": {k: bound[k] for k in released}, **stats}


def padding(kinds: Kinds) -> int:
    """Elements megatron adds to the param and grad buffers with the distributed optimizer (one rank, so no
    sharding; tests/multiprocess/test_precision.py): each tensor starts at a multiple of 64 elements, each bucket
    ends at a multiple of 128. The optimizer states follow the parameters exactly."""
    buckets = sum(len(b.buckets) for chunk in kinds.worker.model for b in chunk.buffers)
    return 64 * len(kinds.params) + 128 * buckets


def main() -> None:
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout
    from tripod.runtime.device import current_device

    if os.environ.get("TRIPOD_TEST_OFFLOAD_PLANT"):
        plant(os.environ["TRIPOD_TEST_OFFLOAD_PLANT"])
    hf_dir = sys.argv[1]
    cuda = torch.cuda.is_available() and os.environ.get("TRIPOD_DEVICE") == "cuda"
    if cuda:
        torch.use_deterministic_algorithms(True, warn_only=True)
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(tp=1, pp=1, name="model", arch=arch)
    n = 8
    batch, _, _, _ = random_ppo_batch(arch.vocab_size, n)
    batch = batch.to(current_device())  # as the trainer hands it to the workers
    cases = [("actor_bf16_distopt", torch.bfloat16, True, True), ("actor_fp32_distopt", torch.float32, True, True),
             ("actor_bf16_plain", torch.bfloat16, False, True), ("actor_fp32_plain", torch.float32, False, True),
             ("reference", torch.float32, False, False)]
    only = os.environ.get("TRIPOD_TEST_OFFLOAD_CASES")
    for name, dtype, dist_opt, trainable in cases:
        if only and name not in only.split(","):
            continue
        out = run_case(name, hf_dir, arch, layout, batch.select(slice(0, n)), dtype,
                       dist_opt, trainable, cuda)
        if dist.get_rank() == 0:
            print("OFFLOAD " + json.dumps({"device": "cuda" if cuda else "cpu", **out}), flush=True)
    for dtype in ("bf16", "fp32"):  # the distributed optimizer against megatron's plain one: the same updates
        on, off = FINAL.get(f"actor_{dtype}_distopt"), FINAL.get(f"actor_{dtype}_plain")
        if on and off and dist.get_rank() == 0:
            diff = max((a - b).abs().max().item() for a, b in zip(on, off))
            print("DISTOPT " + json.dumps({"dtype": dtype, "params": len(on), "max_abs_diff": diff,
                                           "max_abs": max(t.abs().max().item() for t in off)}), flush=True)


def run_on_cuda(fn) -> None:
    from tripod.runtime.device import process_group_backend, select_device

    device = select_device("cuda")
    dist.init_process_group(backend=process_group_backend(device))
    fn()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_on_cuda(main) if os.environ.get("TRIPOD_DEVICE") == "cuda" else dist_worker(main)
