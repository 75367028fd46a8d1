"""Canary for parallel/megatron_patches/parallel_state_groups.py: every state global of megatron's parallel_state is
either swapped by `ParallelLayout.activate()` or listed as left alone with its reason, and every listed name still
exists in megatron. A megatron upgrade that adds a group (which a layout would leave pointing at nothing, or at another
model's groups) fails here, naming the global and the file to decide it in."""
import threading

from tripod.parallel.megatron_patches import parallel_state_groups as psg

FILE = "parallel/megatron_patches/parallel_state_groups.py"


def test_every_megatron_parallel_state_global_is_listed():
    unlisted = psg.unlisted_globals()
    assert not unlisted, (f"megatron's parallel_state ({psg.parallel_state_source()}) has state globals tripod "
                          f"neither sets nor leaves alone: {unlisted}. Read what reads each, then add it to GROUPS / "
                          f"RANK_LISTS (with the layout kind) or CLEARED, or to LEFT_ALONE with the reason, in {FILE}")


def test_every_listed_global_is_still_megatrons():
    vanished = psg.vanished_globals()
    assert not vanished, (f"{FILE} lists globals megatron's parallel_state no longer has (renamed or removed: a "
                          f"setattr would write a dead attribute): {vanished}")


def test_each_global_has_one_decision():
    lists = [set(psg.GROUPS), set(psg.RANK_LISTS), set(psg.CLEARED), set(psg.CREATED_ONCE), set(psg.LEFT_ALONE)]
    assert sum(map(len, lists)) == len(psg.listed_names()) == len(psg.megatron_state_globals()), lists
    assert len(psg.CLEARED) == len(set(psg.CLEARED))
    assert all(reason.strip() for reason in [*psg.LEFT_ALONE.values(), *psg.CREATED_ONCE.values()])


def test_the_rule_sees_new_state_and_skips_code():
    """The canary's rule on a planted parallel_state.py: megatron's file plus a new group at module level, a global
    that only a function creates, and private code (a function, a class, an import) that is not state."""
    with open(psg.parallel_state_source()) as f:
        source = f.read()
    planted = source + ("\n_NEW_PARALLEL_GROUP = None\n_NEW_GROUP_RANKS: list = []\nimport os as _os\n"
                        "class _Helper:\n    pass\ndef _set_late():\n    global _LATE_CREATED_GROUP\n"
                        "    _LATE_CREATED_GROUP = object()\n")
    assert psg.unlisted_globals(planted) == ["_LATE_CREATED_GROUP", "_NEW_GROUP_RANKS", "_NEW_PARALLEL_GROUP"]
    assert psg.unlisted_globals(source) == []


def test_activation_writes_the_listed_globals_and_restores_every_global():
    from megatron.core import parallel_state as ps

    kinds = set(psg.GROUPS.values()) | set(psg.RANK_LISTS.values())
    groups = {kind: object() for kind in kinds - {"embd"}}  # embd missing: a rank off the first and last stages
    ranks = {kind: [7, len(kind)] for kind in kinds}
    names = sorted(psg.megatron_state_globals())
    before = {name: getattr(ps, name) for name in names}
    with psg.pointed_at(psg.parallel_state_values(groups, ranks)):
        inside = {name: getattr(ps, name) for name in names}
        assert ps.get_tensor_model_parallel_group() is groups["tp"]  # what megatron's getters read
        assert ps.get_data_parallel_group(with_context_parallel=True) is groups["dp_cp"]
        with psg.pointed_at(psg.parallel_state_values({}, {})):  # nested: an inner layout, then back
            assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
        assert ps.get_tensor_model_parallel_group() is groups["tp"]
    after = {name: getattr(ps, name) for name in names}
    for name, kind in psg.GROUPS.items():
        assert inside[name] is groups.get(kind), name
    for name, kind in psg.RANK_LISTS.items():
        assert inside[name] is ranks[kind], name
    assert all(inside[name] is None for name in psg.CLEARED)
    assert all(inside[name] is before[name] for name in psg.LEFT_ALONE)
    assert inside["_GLOBAL_MEMORY_BUFFER"] is not None  # created when missing, then kept
    changed = [n for n in names if after[n] is not before[n] and n not in psg.CREATED_ONCE]
    assert changed == [], changed


def test_only_listed_globals_can_be_pointed_at():
    import pytest

    with pytest.raises(KeyError, match="_NOT_A_MEGATRON_GROUP"):
        with psg.pointed_at({"_NOT_A_MEGATRON_GROUP": threading.Lock()}):
            pass
