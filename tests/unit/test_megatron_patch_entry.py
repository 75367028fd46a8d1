"""megatron patches are installed by tripod's entry points, not by importing tripod (parallel/megatron_patches).

In a fresh interpreter, importing every tripod module loads no megatron module, adds no import hook, no warning filter
and no torch override; megatron imported afterwards is megatron as shipped (eager `jit_fuser`, its TE/Apex warnings).
`apply_megatron_patches()` installs the process-wide patches once however often it is called, and `tripod plan`
(the CLI entry point) prints megatron's "Transformer Engine and Apex are not installed" (and the other warnings
known_warnings.py lists) at most once: never.
"""
import json
import os
import subprocess
import sys

from tests.helpers.common import REPO_ROOT
from tripod.parallel.megatron_patches.known_warnings import KNOWN

TE_WARNING = "Transformer Engine and Apex are not installed"

IMPORT_EVERYTHING = """
import importlib, json, pkgutil, sys, warnings
import torch
before = {"meta_path": [repr(f) for f in sys.meta_path], "filters": [repr(f) for f in warnings.filters],
          "current_device": repr(torch.cuda.current_device), "synchronize": repr(torch.cuda.synchronize),
          "compile": repr(torch.compile)}
import tripod
modules = [m.name for m in pkgutil.walk_packages(tripod.__path__, "tripod.") if not m.name.endswith("__main__")]
for name in modules:
    importlib.import_module(name)
after = {"meta_path": [repr(f) for f in sys.meta_path], "filters": [repr(f) for f in warnings.filters],
         "current_device": repr(torch.cuda.current_device), "synchronize": repr(torch.cuda.synchronize),
         "compile": repr(torch.compile)}
megatron_loaded = sorted(m for m in sys.modules if m.startswith("megatron"))
modes = torch.overrides._get_current_function_mode_stack()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    import megatron.core.optimizer, megatron.core.distributed
from megatron.core import jit
print(json.dumps({"modules": len(modules), "changed": {k: (before[k], after[k]) for k in before if before[k] != after[k]},
                  "megatron_loaded": megatron_loaded, "modes": [type(m).__name__ for m in modes],
                  "jit_fuser_is_torch_compile": jit.jit_fuser is torch.compile,
                  "te_warnings": sum("%s" in str(w.message) for w in caught)}))
""" % TE_WARNING

APPLY_TWICE = """
import json, sys, warnings
from tripod.parallel.megatron_patches import apply_megatron_patches
from tripod.parallel.megatron_patches.import_cost import _AfterImport
filters = len(warnings.filters)
apply_megatron_patches()
once = {"hooks": sum(isinstance(f, _AfterImport) for f in sys.meta_path), "filters": len(warnings.filters) - filters}
apply_megatron_patches()
twice = {"hooks": sum(isinstance(f, _AfterImport) for f in sys.meta_path), "filters": len(warnings.filters) - filters}
with warnings.catch_warnings(record=True) as caught:
    import megatron.core.optimizer, megatron.core.distributed
from megatron.core import jit
print(json.dumps({"once": once, "twice": twice, "jit_fuser": jit.jit_fuser.__name__,
                  "te_warnings": sum("%s" in str(w.message) for w in caught)}))
""" % TE_WARNING


def _fresh(code: str, **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "TRIPOD_DEBUG")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env={**env, **env_extra}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_tripod_patches_nothing():
    got = _fresh(IMPORT_EVERYTHING)
    assert got["modules"] > 100, got  # the walk reached the whole package
    assert got["changed"] == {} and got["modes"] == [], got  # no import hook, warning filter or torch override
    assert got["megatron_loaded"] == [], (  # the CLI starts, and patches, before megatron is imported
        f"importing tripod's modules imported {got['megatron_loaded'][:5]}: import megatron inside the function "
        "that uses it, as the rest of tripod does")
    # megatron imported after tripod is megatron as shipped: eager torch.compile, its warnings
    assert got["jit_fuser_is_torch_compile"] is True and got["te_warnings"] >= 1, got


def test_apply_megatron_patches_is_idempotent():
    got = _fresh(APPLY_TWICE)
    assert got["once"] == got["twice"] == {"hooks": 1, "filters": len(KNOWN)}, got
    assert got["jit_fuser"] == "lazy_compile" and got["te_warnings"] == 0, got


def test_tripod_plan_prints_the_te_warning_at_most_once(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "TRIPOD_DEBUG")}
    # trainer.device=cpu: the plan measures this process with megatron's optimizer and models imported
    proc = subprocess.run([sys.executable, "-m", "tripod", "plan", str(config), "trainer.n_gpus_per_node=2",
                           "trainer.device=cpu", "data.train_batch_size=4"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "peak RSS per rank" in proc.stdout, proc.stdout[-3000:]  # the part of the plan that imports megatron ran
    for message, _module, _why in KNOWN:
        assert proc.stderr.count(message) <= 1, proc.stderr[:3000]
