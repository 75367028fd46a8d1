"""parallel/megatron_patches/import_cost.py: importing megatron-core after tripod's entry-point patches leaves torch's
compiler stack unloaded (measured: ~3 s of CPU less per process), and what was deferred still runs as before on first use."""
import json
import subprocess
import sys

import torch

from tests.helpers.common import REPO_ROOT

PROBE = """
import json, sys
from tripod.parallel.megatron_patches import apply_megatron_patches
apply_megatron_patches()  # what every entry point does first
import megatron.core
from megatron.core import jit
from megatron.core.fusions import fused_bias_geglu
loaded = lambda prefix: sorted(m for m in sys.modules if m.startswith(prefix))
print(json.dumps({"inductor": loaded("torch._inductor"), "dynamo": loaded("torch._dynamo"),
                  "jit_fuser": jit.jit_fuser.__name__,
                  "geglu_deferred": hasattr(fused_bias_geglu.geglu, "__wrapped_eagerly__")}))
"""


def test_megatron_import_leaves_the_compiler_for_later():
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    at_import = json.loads(proc.stdout.strip().splitlines()[-1])
    assert at_import == {"inductor": [], "dynamo": [], "jit_fuser": "lazy_compile", "geglu_deferred": True}, at_import


def test_a_deferred_fusion_compiles_once_on_first_call_and_computes_the_same(monkeypatch):
    from tripod.parallel.megatron_patches.import_cost import lazy_compile

    compiled = []

    def recording_compile(fn, **options):  # stands in for inductor's minutes of C++ compilation on CPU
        compiled.append((fn, options))
        return lambda *a, **k: fn(*a, **k) + 0.0

    def bias_gelu(bias, y):
        x = bias + y
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    deferred = lazy_compile(bias_gelu)
    with_options = lazy_compile(dynamic=True)(bias_gelu)
    assert deferred.__name__ == "bias_gelu" and compiled == []
    monkeypatch.setattr(torch, "compile", recording_compile)
    g = torch.Generator().manual_seed(5)
    bias, y = torch.randn(7, generator=g), torch.randn(3, 7, generator=g)
    for _ in range(3):
        assert torch.equal(deferred(bias, y), bias_gelu(bias, y))
    assert with_options(bias, y).shape == (3, 7)
    assert compiled == [(bias_gelu, {}), (bias_gelu, {"dynamic": True})]  # once each, with its options
