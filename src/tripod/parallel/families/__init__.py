"""The model-family registry: HF `model_type` -> `FamilySpec` (see spec.py for what a family holds).

Adding a family is one new module that builds a `FamilySpec` and calls `register_family(SPEC)`, plus an
import line at the bottom of this file (docs/extending.md walks through one).
"""
from __future__ import annotations

from tripod.parallel.families.spec import (
    EMBEDDING,
    FINAL_NORM,
    LAYER_PREFIX,
    OUTPUT_LAYER,
    FamilySpec,
    Fuse,
    Layers,
    Split,
    Weight,
)

_BY_NAME: dict[str, FamilySpec] = {}
_BY_MODEL_TYPE: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec) -> FamilySpec:
    """Make `spec` serve its HF model types. Re-registering the same name replaces it (tests)."""
    unregister_family(spec.name)
    taken = sorted(t for t in spec.hf_model_types if t in _BY_MODEL_TYPE)
    if taken:
        raise ValueError(f"family {spec.name!r}: HF model_type(s) {taken} already served by "
                         f"{sorted({_BY_MODEL_TYPE[t].name for t in taken})}")
    _BY_NAME[spec.name] = spec
    for t in spec.hf_model_types:
        _BY_MODEL_TYPE[t] = spec
    return spec


def unregister_family(name: str) -> None:
    spec = _BY_NAME.pop(name, None)
    if spec is not None:
        for t in spec.hf_model_types:
            _BY_MODEL_TYPE.pop(t, None)


def get_family(name: str) -> FamilySpec:
    """The registered family called `name` (`ModelArch.family`)."""
    if name not in _BY_NAME:
        raise ValueError(f"model family {name!r} is not registered; registered: {sorted(_BY_NAME)} "
                         "(add parallel/families/<family>.py and register it)")
    return _BY_NAME[name]


def family_for_model_type(model_type: str | None) -> FamilySpec | None:
    return _BY_MODEL_TYPE.get(model_type)  # type: ignore[arg-type]


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


__all__ = ["FamilySpec", "Weight", "Split", "Fuse", "Layers", "register_family", "unregister_family", "get_family",
           "family_for_model_type", "supported_model_types", "EMBEDDING", "FINAL_NORM", "OUTPUT_LAYER",
           "LAYER_PREFIX"]

# the built-in families (each module registers itself)
from tripod.parallel.families import (  # noqa: E402,F401
    deepseek,
    glm4_moe,
    llama,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
