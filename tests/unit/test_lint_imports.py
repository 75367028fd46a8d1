"""scripts/lint_imports.py (`make lint`): which pyright diagnostics count as import problems. Every unresolved import
and unknown imported name fails, except the optional GPU / baseline modules it lists; pyright's complaints about
dynamic attributes of torch / megatron objects do not. (The full pyright run is `make lint`'s, not the suite's.)"""
import importlib.util

from tests.helpers.common import REPO_ROOT


def _lint_imports():
    spec = importlib.util.spec_from_file_location("lint_imports", REPO_ROOT / "scripts" / "lint_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _diag(rule: str, message: str, severity: str = "error") -> dict:
    return {"file": str(REPO_ROOT / "src" / "tripod" / "x.py"), "severity": severity, "message": message,
            "rule": rule, "range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 1}}}


def test_import_failures_count_and_dynamic_attributes_do_not():
    lint = _lint_imports()
    failing = [
        _diag("reportMissingImports", 'Import "tripod.parallel.cpu_compat" could not be resolved'),
        _diag("reportMissingImports", 'Import "megatron.core.nonexistent" could not be resolved'),
        _diag("reportAttributeAccessIssue", '"ParallelLayot" is unknown import symbol'),
        _diag("reportAttributeAccessIssue", '"ParallelLayot" is not a known attribute of module "tripod.parallel.layout"'),
        _diag("reportAttributeAccessIssue", '"helper" is not a known attribute of module "tests.helpers.common"'),
        {**_diag("", "Expected expression"), "rule": None},  # a syntax error has no rule
    ]
    passing = [
        _diag("reportMissingImports", 'Import "sglang.srt.utils" could not be resolved'),
        _diag("reportMissingImports", 'Import "transformer_engine" could not be resolved'),
        _diag("reportAttributeAccessIssue", 'Cannot assign to attribute "forward" for class "RotaryEmbedding"'),
        _diag("reportAttributeAccessIssue", '"_tripod_unfixed" is not a known attribute of module "megatron.core.x"'),
        _diag("reportMissingModuleSource", 'Import "yaml" could not be resolved from source', "warning"),
    ]
    assert lint.import_problems(failing) == failing
    assert lint.import_problems(passing) == []
