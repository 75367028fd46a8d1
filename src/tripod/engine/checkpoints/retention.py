"""Checkpoint retention (`trainer.max_actor_ckpt_to_keep`, `trainer.max_critic_ckpt_to_keep`, verl's keys).

A `global_step_<k>` directory holds one part per trained model: `<model>/` and `<model>_optim/` (actor, critic).
Each key keeps its model's part in the newest K checkpoints that still hold it and deletes it from the older ones;
null keeps every one. A checkpoint that lost a part cannot be resumed; the directory goes once it holds no part
(equal keys: whole checkpoints beyond the newest K go; unequal: the larger key's parts stay for `tripod export`).

`prune` runs on rank 0 only after a new checkpoint is complete and its step logged (CheckpointManager.retain). It
never touches the newest complete checkpoint that is not REJECTED (what `trainer.resume=auto` loads) nor the newest
GOOD one (the divergence guard's rollback target). REJECTED checkpoints and directories that were never complete (no
COMPLETE or PRUNED marker) are not counted and not touched.

Crash safety: a checkpoint first loses its COMPLETE marker, renamed PRUNED in one atomic step, so from then on
neither `resume=auto`, the guard, nor `trainer.resume=<dir>` takes it; each part is then renamed `<part>.deleting`
and deleted, and an emptied directory is renamed `deleting_global_step_<k>` and deleted. A run killed at any point
leaves every other checkpoint as it was; `finish_interrupted` (at the next start) removes what the kill left.
"""
from __future__ import annotations

import os
import shutil
from typing import Iterable, Optional

from tripod.engine.checkpoints.manager import COMPLETE, GOOD, REJECTED, STEP_DIR

PRUNED = "PRUNED"  # replaces COMPLETE in a checkpoint whose parts are being (or were) deleted
DELETING = ".deleting"  # suffix of a part being deleted
DELETING_DIR = "deleting_"  # prefix of a checkpoint directory being deleted


def parts_to_delete(held: dict[int, set[str]], keep: dict[str, Optional[int]],
                    protected: Iterable[int] = ()) -> dict[int, set[str]]:
    """The retention rule: {step: models whose part that checkpoint still holds}, {model: K or None (keep all)} ->
    {step: models whose part to delete}: every part older than its model's newest K, except in `protected` steps."""
    protected, out = set(protected), {}
    for model, k in keep.items():
        if k is None:
            continue
        holding = sorted(step for step, models in held.items() if model in models)
        for step in holding[:max(len(holding) - k, 0)]:
            if step not in protected:
                out.setdefault(step, set()).add(model)
    return out


def _remove_tree(path: str) -> None:
    shutil.rmtree(path)


def _has(path: str, name: str) -> bool:
    return os.path.exists(os.path.join(path, name))


def _checkpoints(root: str, models: Iterable[str]) -> dict[int, tuple[str, set[str]]]:
    """{step: (directory, models whose part it holds)} of the complete or pruned, not rejected, checkpoints."""
    out = {}
    for name in os.listdir(root) if os.path.isdir(root) else []:
        path, m = os.path.join(root, name), STEP_DIR.match(name)
        if m and (_has(path, COMPLETE) or _has(path, PRUNED)) and not _has(path, REJECTED):
            out[int(m.group(1))] = path, {model for model in models if os.path.isdir(os.path.join(path, model))}
    return out


def _delete_directory(path: str) -> None:
    doomed = os.path.join(os.path.dirname(path), DELETING_DIR + os.path.basename(path))
    os.replace(path, doomed)
    _remove_tree(doomed)


def finish_interrupted(root: str) -> None:
    """Remove what a run killed while pruning left: `deleting_*` directories, `*.deleting` parts of PRUNED
    checkpoints. Rank 0, before the run reads its checkpoints."""
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(DELETING_DIR) and STEP_DIR.match(name[len(DELETING_DIR):]):
            _remove_tree(path)
        elif STEP_DIR.match(name) and _has(path, PRUNED):
            for part in sorted(os.listdir(path)):
                if part.endswith(DELETING):
                    _remove_tree(os.path.join(path, part))


def prune(root: str, keep: dict[str, Optional[int]]) -> list[str]:
    """Delete the parts `parts_to_delete` names under `root` (the checkpoints directory), crash-safely (module
    docstring). Rank 0. Returns what it deleted."""
    if all(k is None for k in keep.values()):
        return []
    finish_interrupted(root)
    found = _checkpoints(root, keep)
    complete = [s for s, (path, _) in found.items() if _has(path, COMPLETE)]
    protected = {max(complete, default=None), max((s for s in complete if _has(found[s][0], GOOD)), default=None)}
    deleted = []
    for step, models in sorted(parts_to_delete({s: held for s, (_, held) in found.items()}, keep, protected).items()):
        path, held = found[step]
        if _has(path, COMPLETE):
            os.replace(os.path.join(path, COMPLETE), os.path.join(path, PRUNED))
        for model in sorted(models):
            for part in (model, f"{model}_optim"):
                if _has(path, part):
                    os.replace(os.path.join(path, part), os.path.join(path, part + DELETING))
                    _remove_tree(os.path.join(path, part + DELETING))
                    deleted.append(os.path.join(path, part))
        if not held - models:
            _delete_directory(path)
            deleted.append(path)
    for step, (path, held) in found.items():  # emptied by a run killed before it removed the directory
        if not held and _has(path, PRUNED):
            _delete_directory(path)
            deleted.append(path)
    return deleted
