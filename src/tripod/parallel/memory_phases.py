"""The memory plan phase by phase: where each byte of a PPO step lives (device or host) in each phase, with the
offload keys (runtime/offload.py's `placement`, the table the trainer's moves follow), each phase's device peak, and
the verdict against the device memory (`tripod plan --gpu-memory-gb`).

Per phase, on one rank (the largest PP stage of each model, parallel/memory_plan.py):
    device = the kinds `placement` keeps on the device (params; grads; optim = Adam moments + fp32 main weights)
             + the phase's own working set: rollout = generation shard + the rollout engine's KV cache (SGLang's /
             vLLM's reservation on CUDA); update_actor / update_critic = the update's peak saved activations
             (parallel/activation_plan.py: the micro-batches in flight); the log-prob phases run forward-only (no saved activations;
             their transient logits chunks are not counted); checkpoint = the save after a step (params and
             optimizer states of the trained models on the device, gradients where grad_offload leaves them)
    host   = the params and optimizer states on the host in that phase (pinned host memory on CUDA): the bytes
             runtime/offload.py's movers release, with or without the distributed optimizer
             (tests/multiprocess/test_offload_movers.py measures them per kind); offloaded gradient buffers are freed,
             not copied, so they count nowhere; with optimizer_cpu_offload a model's optimizer states are there in
             every phase (megatron's HybridDeviceOptimizer updates on the host).
Not counted: the CUDA context, NCCL buffers and the allocator's fragmentation (a few GiB on a real GPU).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tripod.parallel.memory_plan import MemoryPlan, ModelMemory
from tripod.runtime.offload import DEVICE, KINDS, USES, OffloadFlags, placement

GIB = 1 << 30
MIB = 1 << 20
STEP_PHASES = ("rollout", "reward", "old_log_prob", "ref", "values", "update_critic", "update_actor", "checkpoint")


def kind_bytes(m: ModelMemory) -> dict[str, int]:
    r = m.rows
    return {"params": r["params"], "grads": r.get("grads", 0), "optim": r.get("main_params", 0) + r.get("optim", 0)}


@dataclass
class PhaseMemory:
    phase: str
    device: int = 0
    host: int = 0
    parts: dict[str, int] = field(default_factory=dict)  # what is on the device: "actor.params", "KV cache", ...


def phase_memory(plan: MemoryPlan, offload: dict[str, OffloadFlags],
                 cpu_optimizer: frozenset[str] = frozenset()) -> list[PhaseMemory]:
    """Device and host bytes of each phase the run has (a critic-free run has no values / update_critic phase).
    `cpu_optimizer`: models whose optimizer states never leave the host (optimizer_cpu_offload: megatron's
    HybridDeviceOptimizer runs the update there)."""
    names = {m.name for m in plan.models} | ({"reference"} if plan.reference_on_actor else set())
    out = []
    for phase in STEP_PHASES:
        if not set(USES[phase]) & names:  # a critic-free run has no values / update_critic (its save: the actor's)
            continue
        pm = PhaseMemory(phase)
        for m in plan.models:
            flags = offload.get(m.name, OffloadFlags(params=m.offloaded))
            where = placement(phase, m.name, flags)
            for kind, size in kind_bytes(m).items():
                if not size:
                    continue
                if where[kind] == DEVICE and not (kind == "optim" and m.name in cpu_optimizer):
                    pm.device += size
                    pm.parts[f"{m.name}.{kind}"] = size
                elif kind != "grads":  # offloaded gradient buffers are freed, not copied: they come back zeroed
                    pm.host += size
        work = {"rollout": {"generation shard": plan.generation_shard, "LoRA merge": plan.lora_merged,
                            plan.kv_label.split(" (")[0]: plan.kv_cache},
                "update_actor": {"activations": plan.activations.get("actor", 0)},
                "update_critic": {"activations": plan.activations.get("critic", 0)}}.get(phase, {})
        for name, size in work.items():
            if size:
                pm.device += size
                pm.parts[name] = size
        out.append(pm)
    return out


def describe_phases(plan: MemoryPlan, offload: dict[str, OffloadFlags], gpu_memory_gb: float | None,
                    cpu_optimizer: frozenset[str] = frozenset()) -> str:
    """The per-phase table and, with `gpu_memory_gb` (GiB), whether each phase's device peak fits."""
    phases = phase_memory(plan, offload, cpu_optimizer)
    on = [f"{n}: " + "+".join(k for k in KINDS if f[k]) for n, f in offload.items() if f.any()]
    on += [f"{n}: optimizer_cpu_offload" for n in sorted(cpu_optimizer)]
    lines = ["where the bytes live, per phase (offload: " + (", ".join(on) if on else "none") + "; MiB per rank)",
             "phase          device_MiB    host_MiB  on the device"]
    for pm in phases:
        parts = ", ".join(f"{k} {v / MIB:.0f}" for k, v in pm.parts.items())
        lines.append(f"{pm.phase:<13} {pm.device / MIB:>11.1f} {pm.host / MIB:>11.1f}  {parts}")
    if gpu_memory_gb:
        cap = gpu_memory_gb * GIB
        peak = max(phases, key=lambda p: p.device)
        verdict = "fits" if peak.device <= cap else "does NOT fit"
        lines.append(f"verdict vs {gpu_memory_gb:g} GiB per device: {verdict}; peak {peak.device / GIB:.1f} GiB in "
                     f"{peak.phase} ({(cap - peak.device) / GIB:+.1f} GiB headroom; CUDA context and NCCL buffers "
                     "not counted)")
        over = [f"{p.phase} {(p.device - cap) / GIB:.1f} GiB over" for p in phases if p.device > cap]
        if over:
            lines.append("  over the device memory: " + ", ".join(over))
    return "\n".join(lines)
