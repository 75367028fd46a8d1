"""Every megatron `parallel_state` global that tripod writes, in one place: what `ParallelLayout.activate()` points at
a layout's process groups, what it clears, and what it leaves alone (with the reason).

megatron-core keeps its process groups in private module globals of `megatron.core.parallel_state`, set once by
`initialize_model_parallel`. tripod never calls that: each model has its own groups (parallel/layout.py), and
`pointed_at(parallel_state_values(...))` swaps them in for the duration of a `with layout.activate():` block and
restores the previous values on exit. The names below are that patch:

  GROUPS         the group globals and the layout's group kind each one holds
  RANK_LISTS     the global-rank lists and the kind whose ranks they hold
  CLEARED        cached sizes / ranks (`_MPU_*`, virtual pipeline) that override the groups when set: None inside
  CREATED_ONCE   per-process state that the block creates when missing and does not swap
  LEFT_ALONE     globals of megatron features tripod does not run, and why each stays untouched

Canary: tests/unit/test_parallel_state_groups.py fails when megatron's parallel_state has a global none of these
lists name (a new group that a layout would silently leave pointing at another model's groups, or unset), and when a
listed name is gone from megatron (a `setattr` on a renamed global would write a dead attribute and nothing reads it).

The rule for "a global of megatron's state" (`megatron_state_globals`) is read from parallel_state.py's source, not
from naming conventions: every name that starts with one underscore (not a dunder) and that the module binds at top
level by assignment or declares `global` inside a function. It covers `_*_GROUP*`, `_*_GLOBAL_RANKS*`, `_MPU_*` and
names outside those conventions (`_HYBRID_DP_CP_GROUPS`, `_global_process_group_list`), and excludes the module's
private functions, classes and imports (bound by def / class / import, never by assignment).
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
from typing import Any, Iterator, Mapping

GROUPS: dict[str, str] = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_MODEL_PARALLEL_GROUP": "mp",
    "_EMBEDDING_GROUP": "embd",
    "_POSITION_EMBEDDING_GROUP": "pos_embd",
    "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_GLOO": "dp_gloo",  # real gloo groups (parallel/layout.py's _build_gloo_groups)
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": "dp_cp",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp_gloo",
    # one distributed-optimizer instance: the partial (intra-instance) groups are the whole dp x cp group
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp_gloo",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "dp_cp",
    "_CONTEXT_PARALLEL_GROUP": "cp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "expt_tp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "_EXPERT_DATA_PARALLEL_GROUP": "expt_dp",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expt_dp_gloo",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "expt_dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expt_dp_gloo",
}

RANK_LISTS: dict[str, str] = {
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
    "_EMBEDDING_GLOBAL_RANKS": "embd",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp_cp",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
}

CLEARED: tuple[str, ...] = (
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK",
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
    "_MPU_DATA_PARALLEL_WORLD_SIZE", "_MPU_DATA_PARALLEL_RANK",
    "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE", "_MPU_EXPERT_MODEL_PARALLEL_RANK",
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE", "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
    # tripod's pipeline driver passes the model chunks to megatron's schedules, which set the virtual rank themselves
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
)

CREATED_ONCE: dict[str, str] = {
    "_GLOBAL_MEMORY_BUFFER": "megatron's scratch buffer (sequence-parallel gathers), not a group: created by "
                             "megatron's own `_set_global_memory_buffer` when missing and shared by every layout",
}

LEFT_ALONE: dict[str, str] = {
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "only with num_distributed_optimizer_instances > 1; tripod runs one "
                                                 "instance per model (layout.py's intra_dist_opt group)",
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": "hierarchical (a2a+p2p) context parallelism of TE's attention; tripod's "
                                             "context parallelism is its own (parallel/context_parallel.py)",
    "_HYBRID_DP_CP_GROUPS": "hybrid data/context-parallel groups of megatron's dynamic CP scheduling, not run by tripod",
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER": "inference layers' NVLS symmetric-memory buffer (CUDA inference engine "
                                       "only); tripod's rollout engines do not use megatron's inference layers",
    "_global_process_group_list": "every group megatron's create_group made, for update_pg_timeout; tripod makes "
                                  "its groups with torch.distributed.new_group and never calls it",
}


def listed_names() -> set[str]:
    """Every parallel_state global this module names, whatever it does with it."""
    return set(GROUPS) | set(RANK_LISTS) | set(CLEARED) | set(CREATED_ONCE) | set(LEFT_ALONE)


def parallel_state_values(groups: Mapping[str, Any], group_ranks: Mapping[str, list[int]]) -> dict[str, Any]:
    """The value of every swapped global for a layout with these `groups` / `group_ranks` (kind -> group / global
    ranks; a kind this rank has no group of, e.g. embd off the first and last stages, gives None)."""
    values: dict[str, Any] = {name: groups.get(kind) for name, kind in GROUPS.items()}
    values.update({name: group_ranks.get(kind) for name, kind in RANK_LISTS.items()})
    values.update(dict.fromkeys(CLEARED))
    return values


@contextlib.contextmanager
def pointed_at(values: Mapping[str, Any]) -> Iterator[None]:
    """Set megatron's parallel_state globals to `values` for the block; restore the previous ones on exit (nests)."""
    from megatron.core import parallel_state as ps

    unknown = sorted(set(values) - set(GROUPS) - set(RANK_LISTS) - set(CLEARED))
    if unknown:
        raise KeyError(f"not a swapped parallel_state global of parallel/megatron_patches/parallel_state_groups.py: "
                       f"{unknown}")
    saved = {name: getattr(ps, name) for name in values}
    if ps._GLOBAL_MEMORY_BUFFER is None:
        ps._set_global_memory_buffer()
    for name, value in values.items():
        setattr(ps, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ps, name, value)


def parallel_state_source() -> str:
    """Path of the installed megatron's parallel_state.py (found without importing megatron)."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("megatron-core is not installed (pip install -r requirements.txt)")
    return os.path.join(list(spec.submodule_search_locations)[0], "core", "parallel_state.py")


def megatron_state_globals(source: str | None = None) -> set[str]:
    """The state globals of parallel_state.py's `source` text (default: the installed file), by the module
    docstring's rule."""
    if source is None:
        with open(parallel_state_source()) as f:
            source = f.read()
    tree = ast.parse(source)
    names: set[str] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    names.update(name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def unlisted_globals(source: str | None = None) -> list[str]:
    """megatron state globals that none of this module's lists name: each needs a decision (set or left alone)."""
    return sorted(megatron_state_globals(source) - listed_names())


def vanished_globals(source: str | None = None) -> list[str]:
    """Names this module lists that megatron's parallel_state no longer has."""
    return sorted(listed_names() - megatron_state_globals(source))
