"""verl 0.9.1's own `core_algos` (installed in .venv as a reference, never a tripod dependency), imported for tests.

verl's package imports two modules its loss and estimator code never calls (`codetiming` for its profiler timers,
`orjson` for its JSON helpers) that this environment does not install; where they are missing they are stood in for
by empty modules while verl imports, and removed from sys.modules again afterwards, so nothing else sees them.
"""
from __future__ import annotations

import importlib
import sys
import types

import pytest

_STAND_INS = ("codetiming", "orjson")


def verl_core_algos():
    """(verl.trainer.ppo.core_algos, verl.workers.config) or a skip where verl is not installed."""
    pytest.importorskip("verl")
    added = []
    for name in _STAND_INS:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            stand_in = types.ModuleType(name)
            stand_in.Timer = type("Timer", (), {"__init__": lambda self, *a, **k: None})
            sys.modules[name] = stand_in
            added.append(name)
    try:
        core_algos = importlib.import_module("verl.trainer.ppo.core_algos")
        workers_config = importlib.import_module("verl.workers.config")
    finally:
        for name in added:
            sys.modules.pop(name, None)
    return core_algos, workers_config
