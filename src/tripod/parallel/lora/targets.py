"""Which megatron linears of a model family take LoRA adapters, and how `target_modules` names map onto them.

The family table (parallel/families/) is the only source: every per-layer row whose megatron name ends in
`linear_*.weight` is a linear that can carry an adapter. Its HF names give the adapter's parts: a fused megatron
linear (`linear_qkv` = q_proj + k_proj + v_proj, `linear_fc1` = gate_proj + up_proj) gets one adapter per HF module,
as peft puts on the HF model, so adapters move between tripod and peft unchanged.

`target_modules` takes megatron names (verl's default: linear_qkv, linear_proj, linear_fc1, linear_fc2; MLA's
linear_q_proj, linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj), HF names (q_proj,
gate_proj, ...: only those parts of a fused linear) and `all-linear` (every linear of the decoder layers; never the
embedding or the output layer, as in peft). `exclude_modules` removes names the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tripod.parallel.families.spec import Fuse, Split

if TYPE_CHECKING:
    from tripod.parallel.arch import ModelArch

ALL_LINEAR = "all-linear"
VERL_DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class LinearTarget:
    """One kind of linear in the family's layers. `path`: its module path under a decoder layer (experts carry
    `{e}`); `parts`: the HF module names fused into it (suffix after the HF layer prefix, `{e}` for experts), in the
    order megatron lays their rows out; `fuse` / `split`: the table's fusion and TP split of its weight."""

    path: str
    parts: tuple[str, ...]
    fuse: Fuse
    split: Split
    per_expert: bool
    shape: tuple[int, int]  # the fused weight's full [out, in]
    kv_rows: int = 0  # rows of k (and of v) in a grouped QKV
    groups: int = 1  # KV groups of a grouped QKV

    def rows(self) -> tuple[int, ...]:
        """Each part's full output rows (HF's out_features), in `parts` order."""
        out = self.shape[0]
        if self.fuse == Fuse.QKV_GROUPED:
            return (out - 2 * self.kv_rows, self.kv_rows, self.kv_rows)
        return tuple(out // len(self.parts) for _ in self.parts)

    @property
    def name(self) -> str:
        """megatron's short name (`linear_qkv`)."""
        return self.path.rsplit(".", 1)[-1]

    @property
    def row_parallel(self) -> bool:
        return self.split == Split.COL

    def part_short(self, part: str) -> str:
        """HF's short module name of `part` (`self_attn.q_proj` -> `q_proj`)."""
        return part.rsplit(".", 1)[-1]


def family_linears(arch: "ModelArch") -> dict[str, LinearTarget]:
    """Every linear of the family's decoder layers that can carry an adapter, by module path."""
    from tripod.parallel.families import get_family

    out: dict[str, LinearTarget] = {}
    for w in get_family(arch.family).weights(arch):
        if not (w.per_layer and w.megatron.endswith(".weight")):
            continue
        path = w.megatron[: -len(".weight")]
        if not path.rsplit(".", 1)[-1].startswith("linear_"):
            continue
        parts = tuple(h[: -len(".weight")] for h in w.hf)
        shape = tuple(w.shape(arch))
        kv = arch.num_kv_heads * arch.head_dim if w.fuse == Fuse.QKV_GROUPED else 0
        out[path] = LinearTarget(path, parts, w.fuse, w.tp, w.per_expert, shape, kv, arch.num_kv_heads)
    return out


def _names(linears: dict[str, LinearTarget]) -> tuple[set[str], set[str]]:
    megatron = {t.name for t in linears.values()}
    hf = {t.part_short(p) for t in linears.values() for p in t.parts}
    return megatron, hf


def resolve_targets(arch: "ModelArch", target_modules: list[str] | tuple[str, ...],
                    exclude_modules: list[str] | tuple[str, ...] = (), key: str = "model.lora"
                    ) -> dict[str, tuple[str, ...]]:
    """{module path: the HF parts that get an adapter} for `target_modules` minus `exclude_modules`.

    Raises ValueError (one line naming the key) for a name the family does not have, or when nothing is left."""
    linears = family_linears(arch)
    megatron, hf = _names(linears)

    def parts_of(names, which: str) -> dict[str, set[str]]:
        chosen: dict[str, set[str]] = {}
        for name in names:
            if name == ALL_LINEAR:
                for path, t in linears.items():
                    chosen.setdefault(path, set()).update(t.parts)
                continue
            if name not in megatron and name not in hf:
                raise ValueError(f"{key}.{which}: {name!r} is not a linear of {arch.family}; use {ALL_LINEAR!r}, "
                                 f"megatron names {sorted(megatron)} or HF names {sorted(hf)}")
            for path, t in linears.items():
                hit = t.parts if t.name == name else tuple(p for p in t.parts if t.part_short(p) == name)
                if hit:
                    chosen.setdefault(path, set()).update(hit)
        return chosen

    chosen = parts_of(target_modules, "target_modules")
    for path, parts in parts_of(exclude_modules, "exclude_modules").items():
        if path in chosen:
            chosen[path] -= parts
    result = {p: tuple(x for x in linears[p].parts if x in s) for p, s in chosen.items() if s}
    if not result:
        raise ValueError(f"{key}.target_modules={list(target_modules)} minus exclude_modules="
                         f"{list(exclude_modules)} leaves no linear of {arch.family}; name at least one")
    return result
