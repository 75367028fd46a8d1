"""tripod installs under one namespace: `tripod.engine`, `tripod.parallel`, `tripod.runtime`, `tripod.kernels` (src
layout), so nothing named `engine`, `parallel`, `runtime` or `kernels` lands at the top of site-packages, and Hugging
Face's hub package `kernels` (which transformers probes for) can sit next to tripod without either shadowing the
other."""
import os
import subprocess
import sys

import pytest

from tests.helpers.common import REPO_ROOT

PROBE = """
import importlib.util, json, sys
import tripod, tripod.engine.cli, tripod.parallel.layout, tripod.runtime.device
import tripod.kernels as tk
import torch
adv, ret = tk.gae(torch.ones(1, 3), torch.zeros(1, 3), torch.ones(1, 3), gamma=1.0, lam=1.0)
top = {name: (importlib.util.find_spec(name).origin if importlib.util.find_spec(name) else None)
       for name in ("engine", "parallel", "runtime", "kernels")}
hf = None
if top["kernels"]:
    import kernels
    hf = {"file": kernels.__file__, "get_kernel": hasattr(kernels, "get_kernel")}
print(json.dumps({"top": top, "hf": hf, "gae": adv.tolist(), "tripod": tripod.__file__}))
"""


def _probe(cwd, extra_path=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path:
        env["PYTHONPATH"] = str(extra_path)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_only_tripod_at_the_top(tmp_path):
    got = _probe(tmp_path)  # outside the checkout: what an installed tripod exposes
    ours = [str(REPO_ROOT / "src"), *(str(REPO_ROOT / name) for name in got["top"])]
    theirs = {name: origin for name, origin in got["top"].items()
              if origin and not any(os.path.realpath(origin).startswith(p + os.sep) for p in ours)}
    assert got["top"] == {"engine": None, "parallel": None, "runtime": None, "kernels": None, **theirs}, got["top"]  # HF's kernels: ok
    assert "kernels" not in theirs or got["hf"]["get_kernel"], got  # (transformers >= 5.25 installs it)
    assert got["gae"] == [[3.0, 2.0, 1.0]]


def test_hugging_face_kernels_beside_tripod(tmp_path):
    target = tmp_path / "hf_kernels"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          "kernels"], capture_output=True, text=True, timeout=300)
    if pip.returncode != 0:
        pytest.skip(f"Hugging Face's kernels package could not be installed here: {pip.stderr.strip()[-300:]}")
    for cwd in (tmp_path, REPO_ROOT):  # the checkout's root too: `python -m`, pytest and `pip install -e .` start there
        got = _probe(cwd, target)
        assert got["hf"]["file"].startswith(str(target)) and got["hf"]["get_kernel"], (cwd, got)  # HF's, untouched
        assert got["gae"] == [[3.0, 2.0, 1.0]] and got["tripod"].startswith(str(REPO_ROOT)), got  # tripod's ops too


def test_root_kernels_folder_links_every_kernel_and_is_no_package():
    """The root kernels/ shows src/tripod/kernels file by file; an __init__.py there (or a symlink to the package)
    would shadow Hugging Face's `kernels` for every Python started in the checkout (transformers >= 5.25 imports it)."""
    root, package = REPO_ROOT / "kernels", REPO_ROOT / "src" / "tripod" / "kernels"
    assert not root.is_symlink() and not (root / "__init__.py").exists()
    want = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    have = {p.name for p in root.glob("*.py")}
    assert have == want, f"kernels/ links {sorted(have)}, src/tripod/kernels has {sorted(want)}"
    assert all((root / name).resolve() == (package / name).resolve() for name in want)
