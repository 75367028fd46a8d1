"""HF <-> Megatron weight conversion: the public API (pure-tensor part here, sharded-model IO below).

Pure tensors (no process groups; the layout contract is documented in common.py):
    hf_to_megatron(arch, hf_state) -> {global megatron name: full tensor}
    megatron_to_hf(arch, name, full) -> [(hf_name, tensor), ...]
    family_of(arch).shard / .merge (TP split rules: parallel/families/), pad_vocab / unpad_vocab
Sharded models (every rank of the model's layout calls these together):
    load_hf_weights(model, hf_dir, arch, layout)     lazy safetensors read -> this rank's TP/PP shard
    export_hf_weights(model, arch, layout)           -> Iterator[(hf_name, full tensor)], one at a time
    save_hf_checkpoint(model, arch, layout, out_dir) -> safetensors + config.json for from_pretrained
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from tripod.parallel.arch import ModelArch
from tripod.parallel.convert.common import (
    EMBEDDING,
    FINAL_NORM,
    LAYER_PREFIX,
    OUTPUT_LAYER,
    HFExpertViews,
    check_hf_names,
    extra_layer_names,
    fuse_to_megatron,
    hf_names_for,
    hf_to_megatron_state,
    is_replicated,
    megatron_names,
    megatron_to_hf_tensor,
    pad_vocab,
    padded_vocab_size,
    split_layer_name,
    unpad_vocab,
)
from tripod.parallel.families import FamilySpec, get_family
from tripod.parallel.families.spec import expert_index

log = logging.getLogger(__name__)

_EXPERT_IN_NAME = re.compile(r"\.local_experts\.\d+\.")


def family_of(arch: ModelArch) -> FamilySpec:
    """The registered family of `arch`, after checking that it supports this exact config."""
    family = get_family(arch.family)
    family.check_supported(arch)
    return family


def hf_to_megatron(arch: ModelArch, hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole HF state dict -> canonical full Megatron tensors (global layer index, unpadded vocab).

    Missing or unexpected HF tensors raise ValueError listing their names.
    """
    return hf_to_megatron_state(arch, family_of(arch), hf_state)


def megatron_to_hf(arch: ModelArch, name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One canonical Megatron tensor (vocab padded or not) -> its HF tensors ([] for a tied output layer)."""
    return megatron_to_hf_tensor(arch, family_of(arch), name, full)


def canonical_names(arch: ModelArch) -> list[str]:
    """All canonical Megatron names of `arch` in checkpoint order (global layer index)."""
    return megatron_names(arch, family_of(arch))


# Files copied next to exported weights so the directory is a complete HF model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"


# ----------------------------------------------------------------------------- reading HF files

class SafetensorsReader:
    """Lazy access to the tensors of an HF model directory (one file or shards + index json).

    transformers-5 fused expert tensors are shown under their per-expert names (common.HFExpertViews)."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.hf_dir = os.fspath(hf_dir)
        index = os.path.join(self.hf_dir, SAFETENSORS_INDEX)
        single = os.path.join(self.hf_dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                self.file_of = dict(json.load(f)["weight_map"])
        elif os.path.isfile(single):
            from safetensors import safe_open
            with safe_open(single, framework="pt") as f:
                self.file_of = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.hf_dir}: no model.safetensors or {SAFETENSORS_INDEX}; pass a "
                                    "directory written by save_pretrained(safe_serialization=True)")
        for file in sorted(set(self.file_of.values())):
            if not os.path.isfile(os.path.join(self.hf_dir, file)):
                raise FileNotFoundError(f"{self.hf_dir}: {SAFETENSORS_INDEX} lists {file}, which is missing")
        self._handles: dict[str, object] = {}
        self._last: tuple[str, torch.Tensor] | None = None  # the last fused expert tensor read
        self._views = HFExpertViews(self.file_of, self._read_cached,
                                    lambda n: self._handle(n).get_slice(n).get_shape()[0])

    def _handle(self, name: str):
        from safetensors import safe_open
        file = self.file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.hf_dir, file), framework="pt")
        return self._handles[file]

    def _read_cached(self, name: str) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = (name, self._handle(name).get_tensor(name))
        return self._last[1]

    def names(self) -> list[str]:
        return list(self._views.names)

    def get(self, name: str) -> torch.Tensor:
        return self._views.get(name) if self._views.fused else self._handle(name).get_tensor(name)


# ----------------------------------------------------------------------------- sharded models

def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module-style wrappers."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def model_chunks(model) -> list[torch.nn.Module]:
    """The GPTModels of this rank: a model, or a list of chunks (one per virtual pipeline stage), unwrapped."""
    return [unwrap_model(m) for m in (model if isinstance(model, (list, tuple)) else [model])]


def global_params(model) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers (every chunk) by canonical name: GLOBAL layer index and, for
    routed experts, GLOBAL expert index (megatron's `local_experts.{i}` on EP rank r is expert r * n_local + i),
    and the local spec's names for the norms Transformer Engine's spec folds into a linear (`Weight.te`)."""
    out = {}
    for gpt in model_chunks(model):
        arch = getattr(gpt, "tripod_arch", None)
        family = get_family(arch.family) if arch is not None else None
        for local, tensor in gpt.state_dict(keep_vars=True).items():
            if local.endswith("._extra_state") or tensor is None:
                continue
            layer, suffix = split_layer_name(local)
            if layer is not None:  # megatron's layer_number is 1-based and global
                if family is not None:
                    suffix = family.canonical_suffix(arch, suffix)
                module = gpt.decoder.layers[layer]
                e = expert_index(suffix)
                if e is not None:
                    suffix = _EXPERT_IN_NAME.sub(f".local_experts.{module.mlp.local_expert_indices[e]}.", suffix, 1)
                local = f"{LAYER_PREFIX}{module.layer_number - 1}.{suffix}"
            out[local] = tensor
    return out


def _is_value_head(model, arch: ModelArch, name: str) -> bool:
    """A critic's value head, which no HF causal-LM tensor initialises (a reward model's is HF's `score.weight`)."""
    return bool(getattr(model_chunks(model)[0], "tripod_value_head", False)) and name.startswith("output_layer.") \
        and not arch.score_head


def load_hf_weights(model: torch.nn.Module, hf_dir: str | os.PathLike, arch: ModelArch, layout) -> list[str]:
    """Copy this rank's TP/PP/EP shard of the HF checkpoint in `hf_dir` into `model` (strict; parameters and
    the persistent buffers the family names, e.g. the router's expert bias).

    Reads only the tensors this rank needs (safetensors, lazily): routed experts of its EP rank, split over
    the expert-TP group. Returns the names of model parameters that have no HF counterpart and were left as
    initialised (a critic's value head).
    """
    names = family_of(arch)
    reader = SafetensorsReader(hf_dir)
    check_hf_names(arch, names, reader.names(), source=os.fspath(hf_dir))
    not_loaded = []
    with torch.no_grad():
        for name, param in global_params(model).items():
            local = name
            if _is_value_head(model, arch, name):
                not_loaded.append(local)
                continue
            source = EMBEDDING if (name == OUTPUT_LAYER and arch.tie_word_embeddings) else name
            try:
                hf = hf_names_for(arch, names, source)
            except KeyError as e:
                raise ValueError(f"model parameter {local!r} (global {name!r}) has no HF counterpart: {e}; "
                                 "was the model built from this config.json?") from None
            _check_split_matches_megatron(names, arch, source, param, local)
            full = fuse_to_megatron(arch, names, source, [reader.get(h) for h in hf])
            size, rank = _split_coords(names, arch, source, layout)
            shard = names.shard(arch, source, full, size, rank)
            if shard.shape != param.shape:
                raise ValueError(f"{'/'.join(hf)} -> {local}: shard shape {tuple(shard.shape)} != model "
                                 f"parameter shape {tuple(param.shape)} (split {size} ways, rank {rank}); "
                                 "the model was built for a different config or layout")
            param.copy_(shard)
    return not_loaded


def _split_coords(family: FamilySpec, arch: ModelArch, name: str, layout) -> tuple[int, int]:
    """(group size, rank) that canonical `name` is split over: expert-TP for routed experts, TP otherwise."""
    if family.is_expert(arch, name):
        return layout.etp, layout.etp_rank
    return layout.tp, layout.tp_rank


def _check_split_matches_megatron(family: FamilySpec, arch: ModelArch, name: str, param, local: str) -> None:
    """The family table's TP split must be the one megatron built the parameter with (`partition_dim`)."""
    want = family.row(arch, name).tp.megatron_partition_dim
    got = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
    if want != got:
        raise ValueError(f"family {family.name!r}: its table splits {name} as {family.row(arch, name).tp.value} "
                         f"(partition dim {want}) but megatron built {local} with partition dim {got}; fix the "
                         "family's table or its layer spec")


def export_hf_weights(model: torch.nn.Module, arch: ModelArch, layout, *,
                      to_all_ranks: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) one at a time, gathered over TP, PP and the expert groups (unpadded vocab;
    routed experts under HF's per-expert names, the router's expert bias like any parameter).

    Every rank of the model's TP x PP grid must iterate it to the end (the collectives run in
    lockstep); with expert_model_parallel_size > 1 every rank of the layout (all DP replicas: the EP groups
    span them). Tensors are yielded on TP rank 0 of PP stage 0 of each DP replica, or on every rank
    with `to_all_ranks=True`; other ranks iterate and get nothing. A routed expert is gathered over its
    expert-TP group and broadcast over its EP group, so every rank of its stage holds it before the PP move.
    """
    names = family_of(arch)
    if getattr(model_chunks(model)[0], "tripod_value_head", False) and not arch.score_head:
        raise ValueError("export_hf_weights: a critic (value_head=True) has no HF causal-LM form; "
                         "keep it as a tripod checkpoint (parallel.checkpoint.save_model_checkpoint)")
    local = global_params(model)
    held = {n: str(t.dtype).removeprefix("torch.") for n, t in local.items()}
    stages: list = [held]
    if layout.pp > 1:  # which stage holds which layer (megatron may split layers unevenly)
        stages = [None] * layout.pp
        dist.all_gather_object(stages, held, group=layout.pp_group)
    owner = {n: s for s, names_of in enumerate(stages) for n in names_of}
    # routed experts live on one EP rank only: their stage is the stage of their layer
    layer_owner = {split_layer_name(n)[0]: s for n, s in owner.items() if split_layer_name(n)[0] is not None}
    dtypes = {n: getattr(torch, d) for names_of in stages for n, d in names_of.items()}
    pp_ranks = layout.group_ranks("pp")
    tp_ranks = layout.group_ranks("tp")
    is_dst = to_all_ranks or (layout.tp_rank == 0 and layout.pp_rank == 0)
    for name in megatron_names(arch, names):
        expert = names.is_expert(arch, name)
        stage = layer_owner.get(split_layer_name(name)[0]) if expert else owner.get(name)
        if stage is None:
            raise ValueError(f"export_hf_weights: no pipeline stage holds {name!r}; the model does not "
                             "match config.json")
        full = None
        if layout.pp_rank == stage:
            if expert:
                full = _gather_expert(names, arch, name, local, layout)
            else:
                shard = local[name].detach().contiguous()
                if layout.tp == 1 or is_replicated(arch, names, name):
                    full = names.merge(arch, name, [shard])
                elif to_all_ranks:
                    shards = [torch.empty_like(shard) for _ in range(layout.tp)]
                    dist.all_gather(shards, shard, group=layout.tp_group)
                    full = names.merge(arch, name, shards)
                else:
                    shards = [torch.empty_like(shard) for _ in range(layout.tp)] if layout.tp_rank == 0 else None
                    dist.gather(shard, shards, dst=tp_ranks[0], group=layout.tp_group)
                    full = names.merge(arch, name, shards) if layout.tp_rank == 0 else None
        if layout.pp > 1 and (to_all_ranks or stage != 0):
            dtype = dtypes.get(name) or next(iter(dtypes.values()))
            full = _move_over_pp(names.shape(arch, name), full, stage, dtype, layout, pp_ranks, to_all_ranks)
        if is_dst:
            yield from megatron_to_hf_tensor(arch, names, name, full)


def _gather_expert(family: FamilySpec, arch: ModelArch, name: str, local: dict, layout) -> torch.Tensor:
    """The full tensor of routed expert `name` on every rank of its pipeline stage: gathered over the expert-TP
    group of the owning EP rank, then broadcast from it over each EP group."""
    owner = family.ep_owner(arch, name, layout.ep)
    full = None
    if layout.ep_rank == owner:
        shard = local[name].detach().contiguous()
        if layout.etp > 1:
            shards = [torch.empty_like(shard) for _ in range(layout.etp)]
            dist.all_gather(shards, shard, group=layout.pg_collection.expt_tp)
        else:
            shards = [shard]
        full = family.merge(arch, name, shards)
    if layout.ep == 1:
        return full
    dtype = full.dtype if full is not None else next(t for n, t in local.items() if family.is_expert(arch, n)).dtype
    buf = full.contiguous() if full is not None else torch.empty(family.shape(arch, name), dtype=dtype)
    dist.broadcast(buf, src=layout.group_ranks("ep")[owner], group=layout.pg_collection.ep)
    return buf


def _move_over_pp(shape, full, stage, dtype, layout, pp_ranks, to_all_ranks):
    """Bring the owner stage's full tensor to stage 0 (TP rank 0 only) or to every stage."""
    if to_all_ranks:
        buf = full.contiguous() if layout.pp_rank == stage else torch.empty(shape, dtype=dtype)
        dist.broadcast(buf, src=pp_ranks[stage], group=layout.pp_group)
        return buf
    if layout.tp_rank != 0:
        return None
    if layout.pp_rank == stage:
        dist.send(full.contiguous(), dst=pp_ranks[0], group=layout.pp_group)
        return None
    if layout.pp_rank == 0:
        buf = torch.empty(shape, dtype=dtype)
        dist.recv(buf, src=pp_ranks[stage], group=layout.pp_group)
        return buf
    return None


def write_hf_config(arch: ModelArch, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                    tokenizer_dir: str | os.PathLike | None = None) -> None:
    """Write `config.json` (arch.hf_config, dtype updated) and copy tokenizer files if present."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(arch.hf_config)
    if dtype is not None:
        cfg["dtype"] = str(dtype).removeprefix("torch.")
        cfg.pop("torch_dtype", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    if tokenizer_dir is not None:
        for file in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, file)
            if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, file)):
                shutil.copyfile(src, os.path.join(out_dir, file))


def extra_layers_of(arch: ModelArch, hf_dir: str | os.PathLike | None) -> list[str]:
    """The HF tensors of `hf_dir` in layers the model leaves out (DeepSeek / GLM MTP layers), sorted; [] when the
    family has none, or `hf_dir` is None or holds no safetensors checkpoint (a tokenizer-only directory)."""
    family = family_of(arch)
    if hf_dir is None or not family.extra_hf_layers:
        return []
    try:
        names = SafetensorsReader(hf_dir).names()
    except FileNotFoundError:
        return []
    return sorted(extra_layer_names(arch, family, names))


def save_hf_checkpoint(model: torch.nn.Module, arch: ModelArch, layout, out_dir: str | os.PathLike, *,
                       tokenizer_dir: str | os.PathLike | None = None, dtype: torch.dtype | None = None,
                       max_shard_bytes: int = 2 << 30, extra_layers_from: str | os.PathLike | None = None) -> None:
    """Write `model` as an HF checkpoint (safetensors shards + index, config.json, tokenizer files).

    Every rank of DP replica 0 of the layout must call it (every rank when expert_model_parallel_size > 1);
    TP rank 0 of PP stage 0 of DP replica 0 writes.
    `dtype` casts the weights (default: the model's dtype), except rows held in fp32 (`Weight.fp32`: the
    router's expert bias, which HF keeps in fp32 too).
    `extra_layers_from`: an HF checkpoint whose layers past num_hidden_layers (the MTP layers tripod neither trains
    nor runs) are copied into the output unchanged, so a converted model keeps them.
    """
    from safetensors.torch import save_file

    if (layout.dp_rank != 0 or layout.cp_rank != 0) and layout.ep == 1:
        return  # other DP replicas hold the same weights (with EP they hold other experts and must take part)
    writer = layout.tp_rank == 0 and layout.pp_rank == 0 and layout.dp_rank == 0
    out_dir = os.fspath(out_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    files: list[str] = []
    total_bytes = 0
    if writer:
        os.makedirs(out_dir, exist_ok=True)
        for stale in os.listdir(out_dir):
            if stale.endswith(".safetensors") or stale == SAFETENSORS_INDEX:
                os.remove(os.path.join(out_dir, stale))

    def flush() -> None:
        files.append(f"tmp-{len(files):05d}.safetensors")
        save_file(shards[-1], os.path.join(out_dir, files[-1]), metadata={"format": "pt"})
        shards[-1], sizes[-1] = {}, 0

    family = family_of(arch)
    keep = {h for n, w in family.rows(arch).items() if w.fp32 for h in family.hf_names(arch, n)}
    out_dtype = dtype or next(p for chunk in model_chunks(model) for p in chunk.parameters()).dtype
    extra = extra_layers_of(arch, extra_layers_from) if writer else []
    source = SafetensorsReader(extra_layers_from) if extra else None  # type: ignore[arg-type]
    kept = ((name, source.get(name)) for name in extra if source is not None)
    for hf_name, tensor in itertools.chain(export_hf_weights(model, arch, layout), kept):
        if not writer:
            continue  # another DP replica's copy (expert parallelism makes every replica take part)
        if dtype is not None and hf_name not in keep and hf_name not in extra:
            tensor = tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + nbytes > max_shard_bytes:
            flush()
        shards[-1][hf_name] = tensor.contiguous().clone()
        sizes[-1] += nbytes
        total_bytes += nbytes
    if not writer:
        return
    if extra:
        log.info("%s: %d tensor(s) of %s copied unchanged from %s", out_dir, len(extra),
                 family.extra_hf_layers, extra_layers_from)
    weight_map = {}
    if shards[-1]:
        flush()
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    if len(files) == 1:
        names = ["model.safetensors"]
    for tmp, final in zip(files, names):
        os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, final))
        if len(files) > 1:
            from safetensors import safe_open
            with safe_open(os.path.join(out_dir, final), framework="pt") as f:
                weight_map.update({k: final for k in f.keys()})
    if weight_map:
        with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2,
                      sort_keys=True)
    write_hf_config(arch, out_dir, out_dtype, tokenizer_dir)


__all__ = [
    "load_hf_weights", "export_hf_weights", "save_hf_checkpoint", "write_hf_config", "SafetensorsReader",
    "extra_layers_of",
    "global_params", "model_chunks", "TOKENIZER_FILES",
    "family_of", "hf_to_megatron", "megatron_to_hf", "canonical_names",
    "pad_vocab", "unpad_vocab", "padded_vocab_size", "is_replicated",
    "split_layer_name", "check_hf_names", "hf_names_for", "EMBEDDING", "FINAL_NORM", "OUTPUT_LAYER",
]
