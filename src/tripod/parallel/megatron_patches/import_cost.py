"""What importing megatron-core costs every process, deferred to first use.

`import megatron.core` (0.16.1) spends most of its time where a training rank may never go: `megatron.core.jit.
jit_fuser` is `torch.compile`, applied as a decorator to the fusion functions at import time (fused_bias_geglu,
fused_bias_swiglu, ...), and each decoration builds a dynamo/inductor wrapper, which imports torch._dynamo and
torch._inductor: seconds of CPU per process (bench/RESULTS.md), paid even where the fusions are switched off, by
every rank of every run.

`defer_megatron_import_cost()` (called by `apply_megatron_patches()` at tripod's entry points, before they import
megatron) makes megatron's `jit_fuser` a decorator that calls `torch.compile` on a function the first time the function
is called: the same compiled code, later. A process that imported megatron before that keeps the eager behaviour.
Canary: tests/unit/test_import_cost.py (a fresh interpreter's `import megatron.core` leaves torch._inductor and
torch._dynamo unloaded, and a deferred fusion compiles once on its first call and computes the same values).

Left as it is: megatron's `import wandb` (for a HAVE_WANDB flag). importlib's LazyLoader cannot defer it:
torch's op registration walks sys.modules with `inspect.getmodule`, whose `hasattr(module, "__file__")` loads it.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from typing import Any, Callable

JIT_MODULE = "megatron.core.jit"


def lazy_compile(fn: Callable | None = None, **options: Any) -> Callable:
    """`torch.compile`'s decorator forms (`@jit_fuser`, `@jit_fuser(**options)`), compiling on the first call."""
    if fn is None:
        return lambda f: lazy_compile(f, **options)
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def first_call_compiles(*args, **kwargs):
        if not compiled:
            import torch
            compiled.append(torch.compile(fn, **options))
        return compiled[0](*args, **kwargs)

    first_call_compiles.__wrapped_eagerly__ = fn  # type: ignore[attr-defined]
    return first_call_compiles


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` right after `name` executes, before any importer reads its attributes."""

    def __init__(self, name: str, patch: Callable[[Any], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and so that the lookup below finds the real spec
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_then_patch(module):
            exec_module(module)
            patch(module)
        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def _defer_jit_fuser(jit_module) -> None:
    import torch
    if jit_module.jit_fuser is torch.compile:  # not when megatron chose torch.jit.script or its no-op
        jit_module.jit_fuser = lazy_compile


def defer_megatron_import_cost() -> None:
    """Installs the deferral; a no-op where megatron.core.jit is already imported."""
    if JIT_MODULE not in sys.modules and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(JIT_MODULE, _defer_jit_fuser))
