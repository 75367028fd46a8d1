"""Every change tripod makes to megatron-core 0.16.1's behaviour, in one room: what each patch fixes, on which
device, and the canary test (under tests/multiprocess/) that fails when the patch breaks (or, for upstream bugs,
once megatron fixes them and the patch can go).

patch (module: name)             fixes                                              device       canary
-------------------------------  -------------------------------------------------  -----------  ----------------
cpu_compat: rng_tracker,         the CUDA RNG tracker; recompute's CUDA RNG save /  CPU          test_cpu_compat.py
  recompute_rng                    restore
cpu_compat: current_device,      torch.cuda.current_device() / synchronize()        CPU          test_cpu_compat.py
  synchronize                      hard-codes
cpu_compat: cuda_device_arg,     device="cuda", Tensor.cuda(), asserts on           CPU          test_cpu_compat.py
  tensor_type                      'torch.cuda.*Tensor' types
cpu_compat: sp_torch_norm        the local-spec norm refuses sequence parallel      CPU          test_cpu_compat.py,
                                                                                                 test_sp_vpp.py
cpu_compat: moe_te_gemm,         upstream bugs: MoE NameError, MLA isinstance       without TE   test_megatron_no_te.py
  mla_have_te, mla_core_attn       TypeError, MLA core-attention kwargs TypeError                  (fails once fixed)
cpu_compat: mla_rope_key_grad    MLA's k_pos_emb gradient is a TP partial sum       without TE   test_megatron_no_te.py,
                                   (wrong gradients with TP > 1)                                 test_moe_training.py
gloo_collectives: in-place       gloo's reduce-scatter / all-gather copy the whole  gloo groups  test_precision.py
  reduce-scatter / all-gather      DDP bucket (1.5x / 1x its size in temporaries)   (CPU runs)   (dist. opt.)
gpt_model: bypass_output_layer   GPTModel returns hidden states: the fused log-     all          test_layouts.py,
                                   prob kernel applies the LM head (no logits)                   test_sp_vpp.py
gpt_model:                       RoPE position per sequence slot, for shared-       without TE   test_packing.py
  rope_with_slot_positions         prompt packing
gpt_model: cast_floating_params  the local-spec RMSNorm builds fp32 weights         without TE   test_precision.py (bf16
                                   whatever params_dtype is                                        against fp32)
import_cost: jit_fuser, wandb    megatron's import-time torch.compile of its        all          unit/test_import_
                                   fusions and `import wandb`: seconds per process,                cost.py
                                   deferred to their first use
checkpoint_save: plan_save       megatron's writer clones every view (the dist.     all          test_checkpoint_
                                   optimizer's params), forks writers (copies of                 save.py
                                   the rank) and spawns a results Manager (seconds
                                   per rank): the rank writes from the tensors
cpu_adam: fuse_cpu_adam          megatron builds torch's AdamW unfused: on CPU a   CPU          test_cpu_adam.py
                                   Python loop of ~10 kernels per tensor (several
                                   times slower than torch's fused CPU kernel)
parallel_state_groups:           megatron keeps one set of process groups in       all          unit/test_parallel_
  pointed_at                       parallel_state globals: ParallelLayout.activate()                state_groups.py
                                   swaps in each model's (the names it sets, clears
                                   and leaves alone are listed there)
known_warnings:                  megatron's "Transformer Engine and Apex are not   all          unit/test_megatron_
  quiet_known_warnings             installed", four times per command                             patch_entry.py

Where they are installed: the process-wide ones by `apply_megatron_patches()` (below), which the entry points call
first: the CLI's `main` (engine/cli), each rank of a world (engine/launch.py's `_run_in_world`, with the rank's device)
and the tests' worker bootstrap (tests/helpers/common.py's `dist_worker`, tests/conftest.py). `import tripod` patches
nothing (canary: tests/unit/test_megatron_patch_entry.py). The rest where they act: `apply_no_te_fixes()` also by the
MoE / MLA layer specs on GPU machines without TE; `install_inplace_gloo_collectives()` by a worker that uses the
distributed optimizer; the gpt_model patches by engine/workers/megatron_worker.py on each model it builds; `plan_save`
by every dist-checkpoint save (parallel/checkpoint.py, the optimizer's in engine/checkpoints/optimizer_state.py);
`fuse_cpu_adam` by engine/workers/megatron_worker.py on each optimizer it builds; `pointed_at` by
`ParallelLayout.activate()`.

`transformer_engine_installed()` is the one answer to "does megatron see Transformer Engine" (it imports TE the way
megatron's own modules do); parallel/model.py builds TE layer specs only when it is True and CUDA is present.
"""
from __future__ import annotations

from typing import Any


def transformer_engine_installed() -> bool:
    """True when `transformer_engine` imports: megatron then takes its TE paths (and the no-TE fixes stay off)."""
    try:
        import transformer_engine  # noqa: F401  # pyright: ignore[reportMissingImports]
    except ImportError:
        return False
    return True


def apply_megatron_patches(device: Any = None) -> None:
    """Install tripod's process-wide megatron patches (idempotent): the entry points call it before anything imports
    megatron, and `import tripod` never does.

    Always: `defer_megatron_import_cost()` (import_cost; a no-op once megatron.core.jit is imported) and
    `quiet_known_warnings()` (known_warnings). With a CPU `device` ("cpu" or a torch.device), also `apply_cpu_compat`
    (cpu_compat), forced: a CPU run chosen by trainer.device=cpu on a machine that has GPUs.
    """
    from tripod.parallel.megatron_patches.import_cost import defer_megatron_import_cost
    from tripod.parallel.megatron_patches.known_warnings import quiet_known_warnings

    defer_megatron_import_cost()
    quiet_known_warnings()
    if device is not None and str(getattr(device, "type", device)).split(":")[0] == "cpu":
        from tripod.parallel.megatron_patches.cpu_compat import apply_cpu_compat

        apply_cpu_compat(force=True)
