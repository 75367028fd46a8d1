"""Which training -> rollout layout pairs the hybrid engine can reshard (`validate_layouts`): every problem as one line
naming the config key and the fix, raised as one `ReshardPlanError` before any model is built or weight moves
(preflight calls it; `build_reshard_plan` calls it first)."""
from __future__ import annotations

from tripod.parallel.arch import ModelArch
from tripod.parallel.families import get_family
from tripod.parallel.families.spec import padded_vocab_size
from tripod.parallel.hybrid_engine import regroup
from tripod.parallel.hybrid_engine.experts import check_expert_sizes
from tripod.parallel.hybrid_engine.plan import ParamSpec, ReshardPlanError
from tripod.parallel.stages import StageSplit


def validate_layouts(arch: ModelArch, tp: int, pp: int, dp: int, rollout_tp: int, world_size: int | None = None,
                     expert_specs: list[ParamSpec] = (), ep: int = 1, etp: int | None = None, *,
                     first: int | None = None, last: int | None = None, vpp: int = 1) -> None:
    """Refuse unsupported pairs with a message naming the config key and the fix."""
    problems = []
    if expert_specs:
        etp = etp or tp
        n = 1 + max(s.expert for s in expert_specs)
        if n % ep or (tp * dp) % (ep * etp):
            problems.append(f"actor expert_model_parallel_size={ep} must divide the {n} experts and "
                            f"expert_model_parallel_size*expert_tensor_parallel_size={ep}*{etp} must divide TP*DP="
                            f"{tp}*{dp}")
        problems += check_expert_sizes(sorted({(s.global_shape, s.rule) for s in expert_specs}), etp, rollout_tp)
    elif ep != 1:
        problems.append(f"actor expert_model_parallel_size={ep}: the model has no experts; use 1")
    if world_size is not None and tp * pp * dp != world_size:
        problems.append(f"actor TP*PP*DP = {tp}*{pp}*{dp} = {tp * pp * dp} != world size {world_size}")
    if arch.num_heads % tp or arch.num_kv_heads % tp:
        problems.append(f"actor tensor_model_parallel_size={tp} must divide num_attention_heads={arch.num_heads} "
                        f"and num_key_value_heads={arch.num_kv_heads}")
    if not (first or last) and arch.num_layers % pp:
        problems.append(f"actor pipeline_model_parallel_size={pp} must divide num_hidden_layers={arch.num_layers} "
                        "(or set num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage)")
    else:
        problems += [f"actor {p}" for p in StageSplit(arch.num_layers, pp, vpp, first, last).problems()]
    if arch.num_heads % rollout_tp or arch.num_kv_heads % rollout_tp:
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp} must divide "
                        f"num_attention_heads={arch.num_heads} and num_key_value_heads={arch.num_kv_heads}")
    world = tp * pp * dp
    if rollout_tp < 1 or world % rollout_tp:
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp} must divide the world "
                        f"size TP*PP*DP={world} (rollout DP = world / rollout TP; rollout PP is 1). "
                        f"Use one of {[x for x in range(1, world + 1) if world % x == 0]}")
    elif tp % rollout_tp:  # point-to-point regrouping: every dense split dimension must cut rollout_tp ways
        fam = get_family(arch.family)
        vocab_rows = padded_vocab_size(arch.vocab_size, tp)
        problems += regroup.split_problems(arch, [ParamSpec(n, fam.padded_shape(arch, n, vocab_rows), 0, row.tp)
                                                  for n, row in fam.rows(arch).items()
                                                  if not getattr(row, "per_expert", False)], rollout_tp)
    if problems:
        raise ReshardPlanError("cannot reshard actor -> rollout:\n  - " + "\n  - ".join(problems))
