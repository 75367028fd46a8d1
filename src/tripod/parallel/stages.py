"""Which pipeline stage (and virtual chunk) holds which decoder layer: even splits and megatron's uneven ones.

`megatron.num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage` (megatron's names, null =
even) give the first / last PP stage their own layer count; the remaining layers split evenly over the middle
stages. E.g. 7 layers at PP3 as 2/3/2, or DeepSeek-V3's 61 layers at PP16 as 1 + 14*4 + 4.

The arithmetic is megatron's own (`get_transformer_layer_offset` / `get_num_layers_to_build`, called on a duck-typed
config with `pp_rank` given, so no process group is needed): the model build, the converter's global layer names,
the reshard plan, the memory plan and checkpoints all read the same split. `problems()` states what megatron's
TransformerConfig would refuse, one line per problem naming the key and the fix, before any model is built.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

FIRST_KEY = "num_layers_in_first_pipeline_stage"
LAST_KEY = "num_layers_in_last_pipeline_stage"


@dataclass(frozen=True)
class StageSplit:
    """The decoder layers of a `num_layers`-layer model over `pp` stages x `vpp` virtual chunks (1 = none);
    `first` / `last`: megatron's num_layers_in_first/last_pipeline_stage (None = even)."""

    num_layers: int
    pp: int = 1
    vpp: int = 1
    first: Optional[int] = None
    last: Optional[int] = None

    @property
    def uneven(self) -> bool:
        return self.first is not None or self.last is not None

    def config_fields(self) -> dict[str, Any]:
        """The TransformerConfig fields of this split (empty when even)."""
        if not self.uneven:
            return {}
        return {FIRST_KEY: self.first, LAST_KEY: self.last}

    # ---- validation -------------------------------------------------------------------------------
    def problems(self, prefix: str = "") -> list[str]:
        """What megatron refuses about this split, one line each naming the key (`prefix` + name) and the fix."""
        L, pp, vpp, first, last = self.num_layers, self.pp, self.vpp, self.first, self.last
        f_key, l_key, pp_key = prefix + FIRST_KEY, prefix + LAST_KEY, prefix + "pipeline_model_parallel_size"
        if not self.uneven:
            if L % pp:
                divisors = [d for d in range(1, L + 1) if L % d == 0]
                return [f"{pp_key}={pp} does not divide num_hidden_layers={L}; use one of {divisors}, or set "
                        f"{f_key} / {LAST_KEY} for uneven stages"]
            if vpp > 1 and pp > 1 and L % (pp * vpp):
                return [f"{prefix}virtual_pipeline_model_parallel_size={vpp} needs num_hidden_layers={L} divisible "
                        f"by pipeline_model_parallel_size*virtual_pipeline_model_parallel_size={pp * vpp}; unset it "
                        "or change the layout"]
            return []
        if pp < 2:
            return [f"{f_key} / {LAST_KEY} = {first} / {last} need {pp_key} >= 2 (it is {pp}); set them to null"]
        bad = [f"{k}={v} must be a positive integer (or null)" for k, v in ((f_key, first), (l_key, last))
               if v is not None and (not isinstance(v, int) or v < 1)]
        if bad:
            return bad
        middle_stages = pp - (first is not None) - (last is not None)
        middle = L - (first or 0) - (last or 0)
        given = prefix + " + ".join(f"{k}={v}" for k, v in ((FIRST_KEY, first), (LAST_KEY, last)) if v is not None)
        if middle_stages == 0 and middle != 0:
            return [f"{given} = {L - middle} must sum to num_hidden_layers={L} at {pp_key}={pp} (no middle stage); "
                    f"set them to sum to {L}"]
        if middle_stages and (middle < middle_stages or middle % middle_stages):
            return [f"{given} leave {middle} of num_hidden_layers={L} layers for the {middle_stages} middle "
                    f"stage(s) of {pp_key}={pp}, which must split them evenly (a positive multiple of "
                    f"{middle_stages}); change {f_key} / {LAST_KEY} so that {L} - first - last is one"]
        if vpp > 1 and middle_stages == 0:  # megatron-core 0.16.1's interleaved offset divides by the middle stages
            return [f"{f_key} and {LAST_KEY} both set with {prefix}virtual_pipeline_model_parallel_size={vpp} need "
                    f"{pp_key} >= 3 (megatron divides by the middle stages; it is {pp}); set one of them to null"]
        out = [f"{k}={v} must be divisible by {prefix}virtual_pipeline_model_parallel_size={vpp}"
               for k, v in ((f_key, first), (l_key, last)) if vpp > 1 and v is not None and v % vpp]
        if vpp > 1 and middle_stages and (middle // middle_stages) % vpp:
            out.append(f"the {middle // middle_stages} layers of each middle stage must be divisible by "
                       f"{prefix}virtual_pipeline_model_parallel_size={vpp}; change {f_key} / {LAST_KEY} or vpp")
        return out

    def check(self, name: str = "model") -> None:
        """Raise ValueError (one line, `name` prefixes it) when `problems()` finds any."""
        found = self.problems()
        if found:
            raise ValueError(f"{name} " + "; ".join(found))

    # ---- megatron's arithmetic ----------------------------------------------------------------------
    def _megatron_config(self) -> SimpleNamespace:
        return SimpleNamespace(
            num_layers=self.num_layers, pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp if self.vpp > 1 and self.pp > 1 else None,
            num_layers_in_first_pipeline_stage=self.first, num_layers_in_last_pipeline_stage=self.last,
            pipeline_model_parallel_layout=None, account_for_embedding_in_pipeline_split=False,
            account_for_loss_in_pipeline_split=False)

    def layers(self, pp_rank: int, vp_stage: int | None = None) -> range:
        """Global layer ids built on PP rank `pp_rank` (its virtual chunk `vp_stage` when vpp > 1)."""
        return self._layers(pp_rank, vp_stage if self.vpp > 1 and self.pp > 1 else None)

    @functools.lru_cache(maxsize=None)
    def _layers(self, pp_rank: int, vp_stage: int | None) -> range:
        if self.pp == 1:
            return range(self.num_layers)
        self.check()
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        config = self._megatron_config()
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))

    def stage_layers(self, pp_rank: int) -> list[int]:
        """Every global layer id held by PP rank `pp_rank` (all its virtual chunks)."""
        chunks = range(self.vpp) if self.vpp > 1 and self.pp > 1 else [None]
        return [i for v in chunks for i in self.layers(pp_rank, v)]

    @functools.cached_property
    def stage_of_layer(self) -> tuple[int, ...]:
        """PP rank of every global layer id."""
        owner = [-1] * self.num_layers
        for r in range(self.pp):
            for i in self.stage_layers(r):
                owner[i] = r
        if -1 in owner:
            raise ValueError(f"no pipeline stage holds layer {owner.index(-1)} of {self}")
        return tuple(owner)

    def stage_sizes(self) -> list[int]:
        """Layers on each PP rank."""
        return [len(self.stage_layers(r)) for r in range(self.pp)]

    def describe(self) -> str:
        sizes = self.stage_sizes()
        return "/".join(map(str, sizes)) if self.uneven else f"{sizes[0]} per stage"


def split_of(m: Any, num_layers: int) -> StageSplit:
    """The `StageSplit` of a `megatron` config section (MegatronConfig) for a `num_layers`-layer model."""
    return StageSplit(num_layers, m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1,
                      m.num_layers_in_first_pipeline_stage, m.num_layers_in_last_pipeline_stage)
