"""tripod installs under one namespace: `tripod.engine`, `tripod.parallel`, `tripod.kernels` (src layout),
so nothing named `engine`, `parallel` or `kernels` lands at the top of site-packages, and Hugging Face's hub
package `kernels` (which transformers probes for) can sit next to tripod without either shadowing the other."""
import os
import subprocess
import sys

import pytest

from tests.helpers.common import REPO_ROOT

PROBE = """
import importlib.util, json, sys
import tripod, tripod.engine.cli, tripod.parallel.layout
import tripod.kernels as tk
import torch
adv, ret = tk.gae(torch.ones(1, 3), torch.zeros(1, 3), torch.ones(1, 3), gamma=1.0, lam=1.0)
top = {name: (importlib.util.find_spec(name).origin if importlib.util.find_spec(name) else None)
       for name in ("engine", "parallel", "kernels")}
hf = None
if top["kernels"]:
    import kernels
    hf = {"file": kernels.__file__, "get_kernel": hasattr(kernels, "get_kernel")}
print(json.dumps({"top": top, "hf": hf, "gae": adv.tolist(), "tripod": tripod.__file__}))
"""


def _probe(tmp_path, extra_path=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path:
        env["PYTHONPATH"] = str(extra_path)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_only_tripod_at_the_top(tmp_path):
    got = _probe(tmp_path)  # outside the checkout: what an installed tripod exposes
    assert got["top"] == {"engine": None, "parallel": None, "kernels": None}, got["top"]
    assert got["gae"] == [[3.0, 2.0, 1.0]]


def test_hugging_face_kernels_beside_tripod(tmp_path):
    target = tmp_path / "hf_kernels"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          "kernels"], capture_output=True, text=True, timeout=300)
    if pip.returncode != 0:
        pytest.skip(f"Hugging Face's kernels package could not be installed here: {pip.stderr.strip()[-300:]}")
    got = _probe(tmp_path, target)
    assert got["hf"]["file"].startswith(str(target)) and got["hf"]["get_kernel"], got  # HF's package, untouched
    assert got["gae"] == [[3.0, 2.0, 1.0]] and got["tripod"].startswith(str(REPO_ROOT)), got  # tripod's ops too
