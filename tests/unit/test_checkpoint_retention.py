"""Checkpoint retention (trainer.max_actor_ckpt_to_keep / max_critic_ckpt_to_keep; engine/checkpoints/retention.py):
the rule in closed form, the deletions on a directory tree (markers the resume and the divergence guard read), a
deletion killed half-way, and the manager deleting only once the new checkpoint is complete. The kill of a real run
mid-deletion and its exact resume: tests/multiprocess/test_trainer.py."""
from __future__ import annotations

import os

import pytest

from tripod.engine.checkpoints import retention
from tripod.engine.checkpoints.manager import (
    COMPLETE,
    GOOD,
    REJECTED,
    CheckpointManager,
    checkpoint_steps,
    latest_complete,
)
from tripod.engine.checkpoints.retention import PRUNED, finish_interrupted, parts_to_delete, prune

PARTS = ("actor", "actor_optim", "critic", "critic_optim")


def _checkpoint(root: str, step: int, *markers: str, parts=PARTS) -> str:
    path = os.path.join(root, f"global_step_{step}")
    for part in parts:
        os.makedirs(os.path.join(path, part))
        with open(os.path.join(path, part, "shard.distcp"), "w") as f:
            f.write("x" * 100)
    for name in markers:
        open(os.path.join(path, name), "w").close()
    return path


def _tree(root: str) -> dict[str, list[str]]:
    return {name: sorted(os.listdir(os.path.join(root, name))) for name in sorted(os.listdir(root))}


def test_rule_keeps_each_models_newest_k():
    held = {s: {"actor", "critic"} for s in (1, 2, 3, 4)}
    assert parts_to_delete(held, {"actor": 1, "critic": 1}) == {1: {"actor", "critic"}, 2: {"actor", "critic"},
                                                                  3: {"actor", "critic"}}
    assert parts_to_delete(held, {"actor": 3, "critic": 1}) == {1: {"actor", "critic"}, 2: {"critic"},
                                                                  3: {"critic"}}
    assert parts_to_delete(held, {"actor": None, "critic": None}) == {}
    assert parts_to_delete(held, {"actor": 9, "critic": None}) == {}
    assert parts_to_delete(held, {"actor": 1, "critic": 1}, protected={2}) == {1: {"actor", "critic"},
                                                                                3: {"actor", "critic"}}
    # a checkpoint that already lost its critic counts only towards the actor's K
    held = {1: {"actor"}, 2: {"actor"}, 3: {"actor", "critic"}, 4: {"actor", "critic"}}
    assert parts_to_delete(held, {"actor": 3, "critic": 1}) == {1: {"actor"}, 3: {"critic"}}


def test_prune_keeps_k_and_what_resume_and_the_guard_need(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3, 4):
        _checkpoint(root, step, COMPLETE, GOOD)
    os.makedirs(os.path.join(root, "global_step_99", "actor"))  # never complete (no marker): not tripod's to count
    prune(root, {"actor": 2, "critic": 1})
    assert [s for s, _ in checkpoint_steps(root)] == [4]  # global_step_3 kept its actor only: not resumable
    assert _tree(root) == {"global_step_3": sorted([PRUNED, GOOD, "actor", "actor_optim"]),
                           "global_step_4": sorted([COMPLETE, GOOD, *PARTS]), "global_step_99": ["actor"]}
    prune(root, {"actor": 1, "critic": 1})
    assert sorted(os.listdir(root)) == ["global_step_4", "global_step_99"]

    # the newest complete checkpoint is rejected: resume=auto takes global_step_5, the guard the GOOD global_step_4
    _checkpoint(root, 5, COMPLETE)
    _checkpoint(root, 6, COMPLETE, GOOD, REJECTED)
    prune(root, {"actor": 1, "critic": 1})
    assert latest_complete(root).endswith("global_step_5")
    assert sorted(os.listdir(root)) == ["global_step_4", "global_step_5", "global_step_6", "global_step_99"]
    _checkpoint(root, 7, COMPLETE, GOOD)
    prune(root, {"actor": 1, "critic": 1})
    assert sorted(os.listdir(root)) == ["global_step_6", "global_step_7", "global_step_99"]


class _Killed(BaseException):
    pass


def test_a_deletion_killed_half_way_leaves_the_newest_complete_checkpoint(tmp_path, monkeypatch):
    root = str(tmp_path)
    for step in (1, 2, 3):
        _checkpoint(root, step, COMPLETE, GOOD)
    calls = []

    def killed_on_second(path):
        calls.append(path)
        if len(calls) == 2:
            raise _Killed
        original(path)
    original = retention._remove_tree
    monkeypatch.setattr(retention, "_remove_tree", killed_on_second)
    with pytest.raises(_Killed):
        prune(root, {"actor": 1, "critic": 1})
    # resume=auto and the guard see only whole checkpoints; trainer.resume=<the half-deleted one> is refused
    assert [s for s, _ in checkpoint_steps(root)] == [2, 3] and latest_complete(root).endswith("global_step_3")
    half = os.path.join(root, "global_step_1")
    assert sorted(os.listdir(half)) == sorted([PRUNED, GOOD, "actor_optim.deleting", "critic", "critic_optim"])
    monkeypatch.setattr(retention, "_remove_tree", original)
    finish_interrupted(root)  # at the next start
    assert sorted(os.listdir(half)) == sorted([PRUNED, GOOD, "critic", "critic_optim"])
    prune(root, {"actor": 1, "critic": 1})  # the next complete checkpoint finishes the job
    assert sorted(os.listdir(root)) == ["global_step_3"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_manager_deletes_only_once_the_new_checkpoint_is_complete(tmp_path, world_of_one, monkeypatch, asynchronous):
    root = str(tmp_path / "checkpoints")
    manager = CheckpointManager(root, arch=None, tokenizer_dir="", keep={"actor": 1, "critic": 1})
    # the model parts a save of real workers writes (these fakes have none): added before the manager prunes
    manager.on_complete.append(lambda path: [os.makedirs(os.path.join(path, p)) for p in PARTS])
    newest_complete = []  # at each deletion (only global_step_2's completion deletes anything)

    def remove(path):
        newest_complete.append(os.path.exists(os.path.join(root, "global_step_2", COMPLETE)))
        original(path)
    original = retention._remove_tree
    monkeypatch.setattr(retention, "_remove_tree", remove)
    for step in (1, 2):
        manager.save(step, {"rng": {}, "step": step, "world_size": 1}, {}, asynchronous=asynchronous)
        while manager.in_flight is not None:  # an asynchronous save becomes complete in a poll after a step
            manager.poll()
        manager.retain()  # (the trainer: once the step is logged)
    assert sorted(os.listdir(root)) == ["global_step_2"], "global_step_1 was not deleted after global_step_2"
    assert all(newest_complete), "an old checkpoint was deleted before the new one was complete"
