"""Import resolution as an editor sees it: pyright over src/, tests/ and scripts/ (pyproject.toml [tool.pyright]),
failing on every import that does not resolve and every imported name a module does not define.

    python scripts/lint_imports.py          # `make lint` runs it after `ruff check`

pyright runs with `typeCheckingMode = "off"` plus two rules: reportMissingImports and reportAttributeAccessIssue.
The second also fires on dynamic attributes of torch / megatron / transformers objects (monkey-patched forwards,
optimizer internals), which are not import problems, so only its two import forms count here:
`"X" is unknown import symbol` (from M import X) and `"X" is not a known attribute of module "tripod..."`.
Modules that only GPU machines or the TRL baseline venv install are listed in OPTIONAL_MODULES with where they
come from; an unresolved import of anything else fails.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# top-level module -> where it is installed (absent from the CPU venv that `make lint` checks against)
OPTIONAL_MODULES = {
    "sglang": "GPU rollout engine, installed by hand on GPU machines (docs/rollout.md)",
    "vllm": "vLLM rollout engine: .venv-vllm (make vllm-venv) on CPU, installed by hand on GPU machines",
    "transformer_engine": "optional on GPU machines; tripod falls back to megatron's local spec",
    "trl": "the bench's TRL baseline, installed in .venv-trl on first use",
    "datasets": "the bench's TRL baseline (.venv-trl)",
}
_MISSING_IMPORT = re.compile(r'Import "([\w.]+)" could not be resolved')
_IMPORT_SYMBOL = re.compile(r'"[\w.]+" is unknown import symbol')
_FIRST_PARTY_ATTRIBUTE = re.compile(r'is not a known attribute of module "(tripod|tests)(\.[\w.]+)?"')


def import_problems(diagnostics: list[dict]) -> list[dict]:
    """The diagnostics (pyright --outputjson entries) that are import-resolution failures."""
    out = []
    for d in diagnostics:
        rule, message = d.get("rule", ""), d.get("message", "")
        if rule == "reportMissingImports":
            m = _MISSING_IMPORT.search(message)
            if m is None or m.group(1).split(".")[0] not in OPTIONAL_MODULES:
                out.append(d)
        elif rule == "reportAttributeAccessIssue":
            if _IMPORT_SYMBOL.search(message) or _FIRST_PARTY_ATTRIBUTE.search(message):
                out.append(d)
        elif d.get("severity") == "error":  # syntax errors and anything pyright reports without a rule
            out.append(d)
    return out


def main() -> int:
    cmd = [sys.executable, "-m", "pyright", "--outputjson", "--pythonpath", sys.executable]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        print(f"pyright did not produce a report (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}",
              file=sys.stderr)
        return 2
    problems = import_problems(report.get("generalDiagnostics", []))
    for d in problems:
        start = d["range"]["start"]
        path = Path(d["file"]).relative_to(REPO) if Path(d["file"]).is_relative_to(REPO) else d["file"]
        print(f"{path}:{start['line'] + 1}:{start['character'] + 1}: {d['message']} ({d.get('rule', 'error')})")
    summary = report.get("summary", {})
    print(f"pyright {report.get('version', '?')}: {summary.get('filesAnalyzed', '?')} files, "
          f"{len(problems)} import problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
