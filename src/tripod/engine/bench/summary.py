"""The arithmetic of `tripod bench`: raw per-step records -> one run's summary, and the bench.json schema.

Every system (tripod, TRL, the plain HF loop) hands in the same raw form: `records` (one per step, with
`step_s`, `stages_s`, `prompt_tokens`, `response_tokens`, `samples`, `prompts`, optional `flops` per stage,
`warmup`), `ranks` (peak memory, threads and matmul ceiling of each process) and `world_size`.

- tokens/s = (prompt + response tokens of the measured steps) / (their summed step time); per device: / world.
- a stage's share = its summed time / the summed step time, with "other" = step minus the timed stages, so the
  shares of a run sum to 1 exactly.
- MFU of a stage = its FLOPs / its time / world / the per-device ceiling measured in the same run (the highest any
  rank measured).
- median and spread (min, max) of each stage over the measured (non-warmup) steps.
"""
from __future__ import annotations

import statistics
from typing import Any

SCHEMA_VERSION = 1
RUN_KEYS = ("label", "system", "point", "summary")
SUMMARY_KEYS = ("steps", "world_size", "threads_per_process", "step_s", "prompts_per_step", "samples_per_step",
                "prompt_tokens_per_step", "response_tokens_per_step", "tokens_per_step", "tokens_per_s",
                "tokens_per_s_per_device", "samples_per_s", "stages", "mfu", "decode_tokens_per_s",
                "peak_memory_gb", "peak_memory_gb_max", "matmul_ceiling_gflops", "score_mean", "nonzero_adv_frac")
TOP_KEYS = ("schema_version", "created_utc", "recipe", "overrides", "steps", "warmup", "machine", "versions",
            "config", "runs", "comparison", "settings")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """One run's summary from its raw records (warmup records are dropped)."""
    recs = [r for r in raw["records"] if not r.get("warmup")]
    if not recs:
        raise ValueError("no measured steps: --steps must be at least 1")
    world = int(raw["world_size"])
    total_s = sum(r["step_s"] for r in recs)
    tokens = [r["prompt_tokens"] + r["response_tokens"] for r in recs]
    names = [k for k in _ordered_stages(recs)]
    per_stage = {k: [r["stages_s"].get(k, 0.0) for r in recs] for k in names}
    per_stage["other"] = [r["step_s"] - sum(r["stages_s"].values()) for r in recs]
    stages = {k: {**{f"{s}_s": v for s, v in spread(vals).items()}, "share": sum(vals) / total_s}
              for k, vals in per_stage.items()}
    ranks = raw.get("ranks") or []
    ceilings = [r["peak_flops"] for r in ranks if r.get("peak_flops")]
    ceiling = max(ceilings) if ceilings else None  # the best any rank saw: MFU is never flattered by a slow reading
    mfu = {}
    for k in names:
        flops = sum(r.get("flops", {}).get(k, 0.0) for r in recs)
        secs = sum(per_stage[k])
        if ceiling and flops and secs > 0:
            mfu[k] = flops / secs / world / ceiling
    gen_s = sum(per_stage.get("gen", [0.0]))
    memory = [r["peak_memory_gb"] for r in ranks if r.get("peak_memory_gb") is not None]
    return {
        "steps": len(recs), "world_size": world,
        "threads_per_process": [r.get("threads") for r in ranks],
        "step_s": spread([r["step_s"] for r in recs]),
        "prompts_per_step": statistics.median(r["prompts"] for r in recs),
        "samples_per_step": statistics.median(r["samples"] for r in recs),
        "prompt_tokens_per_step": statistics.median(r["prompt_tokens"] for r in recs),
        "response_tokens_per_step": statistics.median(r["response_tokens"] for r in recs),
        "tokens_per_step": statistics.median(tokens),
        "tokens_per_s": sum(tokens) / total_s,
        "tokens_per_s_per_device": sum(tokens) / total_s / world,
        "samples_per_s": sum(r["samples"] for r in recs) / total_s,
        "stages": stages, "mfu": mfu,
        "decode_tokens_per_s": sum(r["response_tokens"] for r in recs) / gen_s if gen_s > 0 else None,
        "peak_memory_gb": memory, "peak_memory_gb_max": max(memory) if memory else None,
        "matmul_ceiling_gflops": ceiling / 1e9 if ceiling else None,
        # what the update had to work with: mean reward, and the share of samples with a non-zero advantage (0: every
        # group scored alike and the update is a no-op any system could skip)
        "score_mean": _mean_of(recs, "score_mean"), "nonzero_adv_frac": _mean_of(recs, "nonzero_adv_frac"),
        "checkpoint": raw.get("checkpoint"),  # one save after the steps: blocking_s, total_s, gb (tripod runs)
    }


def _mean_of(recs: list[dict], key: str) -> float | None:
    values = [r[key] for r in recs if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _ordered_stages(recs: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in recs:
        for k in r["stages_s"]:
            seen.setdefault(k, None)
    return list(seen)


def compare(base: dict[str, Any], peer: dict[str, Any]) -> dict[str, float]:
    """tripod vs a peer on the same work: >1 means tripod is faster / uses less memory."""
    out = {"throughput_ratio": base["tokens_per_s"] / peer["tokens_per_s"],
           "step_time_ratio": peer["step_s"]["median"] / base["step_s"]["median"]}
    if base["peak_memory_gb_max"] and peer["peak_memory_gb_max"]:
        out["peak_memory_ratio"] = base["peak_memory_gb_max"] / peer["peak_memory_gb_max"]
    return out


def check_schema(doc: dict[str, Any]) -> None:
    """Raise ValueError naming the first missing key of a bench.json document."""
    for key in TOP_KEYS:
        if key not in doc:
            raise ValueError(f"bench.json: missing top-level key {key!r}")
    if doc["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"bench.json: schema_version {doc['schema_version']} != {SCHEMA_VERSION}")
    for i, run in enumerate(doc["runs"]):
        for key in RUN_KEYS:
            if key not in run:
                raise ValueError(f"bench.json: runs[{i}] has no {key!r}")
        for key in SUMMARY_KEYS:
            if key not in run["summary"]:
                raise ValueError(f"bench.json: runs[{i}].summary has no {key!r}")
