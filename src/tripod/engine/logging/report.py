"""`tripod report RUN_DIR`: a PNG dashboard and a short health verdict of a run, from `RUN_DIR/metrics.jsonl` only.

Reading only metrics.jsonl (one JSON object per logged step, appended and flushed by the Tracker) makes the report
work on a finished run, a running one and a crashed one alike: a last line cut short by a crash is skipped, and a
step logged twice (a divergence-guard rollback re-runs steps) keeps its last entry.

Dashboard panels: train and validation reward, KL in the reward and its coefficient (and the KL loss), entropy,
clip fractions, actor/ppo_kl, grad norms, learning rates, time per stage (stacked), memory, tokens/s.

Health signals (the usual PPO operator's table; `HEALTH` holds the ranges):
- actor/ppo_kl: healthy in 0.01-0.03 per step (above: updates too large; below: the policy barely moves),
- grad norm: under 10,
- validation reward: rising; the last validation within 0.05 of the best one,
- stop when it stalls: the last 3 validations add less than 0.01 over the best before them,
- every logged value finite.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from typing import Any, Sequence

HEALTH = {"ppo_kl": (0.01, 0.03), "grad_norm_max": 10.0, "val_drop": 0.05, "stall_window": 3, "stall_gain": 0.01}
STAGE_PREFIX = "timing_s/"
PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["critic/score/mean", "val/reward_mean"]),
    ("KL in reward and its coefficient", ["actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff",
                                          "actor/kl_loss"]),
    ("entropy", ["actor/entropy"]),
    ("clip fraction", ["actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac"]),
    ("actor/ppo_kl (healthy 0.01-0.03)", ["actor/ppo_kl"]),
    ("grad norm (healthy < 10)", ["actor/grad_norm", "critic/grad_norm"]),
    ("learning rate", ["actor/lr", "critic/lr"]),
    ("time per stage, s (stacked)", []),  # filled from the timing_s/* keys
    ("peak memory per rank, GB", []),  # perf/peak_memory_gb/rank{r} (or max/min over ranks in big worlds)
    ("tokens/s per rank", ["perf/throughput"]),
]


def load_metrics(path: str) -> list[dict[str, Any]]:
    """The entries of a metrics.jsonl, sorted by step, one per step (the last logged), torn lines skipped."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist; `tripod report` reads RUN_DIR/metrics.jsonl (needs "
                                "'jsonl' in trainer.logger)")
    by_step: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # the last line of a crashed run
                continue
            if isinstance(entry, dict) and "step" in entry:
                by_step[int(entry["step"])] = entry
    if not by_step:
        raise ValueError(f"{path} holds no logged step yet")
    return [by_step[s] for s in sorted(by_step)]


def series(entries: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for e in entries:
        v = e.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            steps.append(e["step"])
            values.append(float(v))
    return steps, values


def health_verdict(entries: Sequence[dict[str, Any]]) -> list[str]:
    """Lines `OK  ...` / `FLAG ...` / `NOTE ...`, one per health signal, then the run's extent."""
    out: list[str] = []
    lo, hi = HEALTH["ppo_kl"]
    steps, kl = series(entries, "actor/ppo_kl")
    if not kl:
        out.append("NOTE actor/ppo_kl not logged")
    elif all(v == 0 for v in kl):
        out.append("NOTE actor/ppo_kl is 0 at every step: each update is exactly on-policy (one epoch of one "
                   "mini-batch), so it says nothing here")
    else:
        outside = [(s, v) for s, v in zip(steps, kl) if not lo <= v <= hi]
        median = statistics.median(kl)
        where = ", ".join(f"{s}: {v:.3g}" for s, v in outside[:6]) + (" ..." if len(outside) > 6 else "")
        tag = "OK  " if lo <= median <= hi else "FLAG"
        hint = (" (above: lower the actor LR or set actor.target_kl; below: the policy barely moves)"
                if tag == "FLAG" else "")
        out.append(f"{tag} actor/ppo_kl median {median:.3g}, healthy {lo}-{hi}; {len(outside)}/{len(kl)} steps "
                   f"outside{' (' + where + ')' if outside else ''}{hint}")
    limit = HEALTH["grad_norm_max"]
    for key in ("actor/grad_norm", "critic/grad_norm"):
        steps, norms = series(entries, key)
        if norms:
            high = [(s, v) for s, v in zip(steps, norms) if v >= limit]
            tag = "FLAG" if high else "OK  "
            detail = f"; >= {limit:g} at steps {[s for s, _ in high][:10]}" if high else ""
            out.append(f"{tag} {key} max {max(norms):.3g} (healthy < {limit:g}){detail}")
    out += _validation_verdict(entries)
    bad = sorted({k for e in entries for k, v in e.items() if isinstance(v, float) and not math.isfinite(v)})
    if bad:
        out.append(f"FLAG non-finite values in {bad[:8]}")
    out.append(f"NOTE {len(entries)} logged steps, {entries[0]['step']}..{entries[-1]['step']} (a running or "
               "crashed run reports what it logged so far)")
    return out


def _validation_verdict(entries: Sequence[dict[str, Any]]) -> list[str]:
    steps, val = series(entries, "val/reward_mean")
    if not val:
        return ["NOTE no validation logged (data.val_files, trainer.test_freq)"]
    first, last = val[0], val[-1]
    best_i = max(range(len(val)), key=lambda i: val[i])
    out = []
    if len(val) == 1:
        return [f"NOTE one validation so far: {first:.3f} at step {steps[0]}"]
    rising = last > first
    out.append(f"{'OK  ' if rising else 'FLAG'} validation reward {first:.3f} (step {steps[0]}) -> {last:.3f} "
               f"(step {steps[-1]}), best {val[best_i]:.3f} at step {steps[best_i]}"
               + ("" if rising else "; not rising"))
    drop = HEALTH["val_drop"]
    if val[best_i] - last > drop:
        out.append(f"FLAG last validation is {val[best_i] - last:.3f} below the best (> {drop}): the run is past "
                   f"its best; keep the step-{steps[best_i]} checkpoint, or decay the LR (optim.lr_decay_style: "
                   "cosine, min_lr_ratio)")
    window, gain = HEALTH["stall_window"], HEALTH["stall_gain"]
    if len(val) > window:
        before = max(val[:-window])
        if max(val[-window:]) - before < gain:
            out.append(f"FLAG validation stalled: the last {window} validations (from step {steps[-window]}) add "
                       f"less than {gain} over {before:.3f}; stop the run or change the recipe")
    return out


def _stage_keys(entries: Sequence[dict[str, Any]]) -> list[str]:
    keys = {k for e in entries for k in e if k.startswith(STAGE_PREFIX)  # (an asynchronous save's write overlaps steps)
            and k not in (STAGE_PREFIX + "step", STAGE_PREFIX + "checkpoint_write")}
    return sorted(keys, key=lambda k: -sum(series(entries, k)[1]))


def _memory_keys(entries: Sequence[dict[str, Any]]) -> list[str]:
    """Each rank's peak when the run logged per-rank keys, else max/min over ranks, else whatever memory key it has
    (runs from before per-rank memory: perf/max_memory_allocated_gb, rank 0's peak)."""
    keys = {k for e in entries for k in e if "memory" in k and not k.startswith(STAGE_PREFIX)}
    per_rank = sorted((k for k in keys if k.startswith("perf/peak_memory_gb/rank")), key=lambda k: int(k[24:]))
    if per_rank:
        return per_rank
    spread = sorted(k for k in keys if k.startswith("perf/peak_memory_gb/"))
    return spread or sorted(keys)


def write_report(run_dir: str, out_png: str | None = None) -> tuple[str, str, list[str]]:
    """Writes the dashboard PNG (default RUN_DIR/report.png) and RUN_DIR/report.txt; returns (png, txt, verdict)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = load_metrics(os.path.join(run_dir, "metrics.jsonl"))
    verdict = health_verdict(entries)
    out_png = out_png or os.path.join(run_dir, "report.png")
    fig, axes = plt.subplots(4, 3, figsize=(16, 15))
    flat = list(axes.flat)
    for ax, (title, keys) in zip(flat, PANELS):
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("step", fontsize=9)
        ax.grid(alpha=0.3)
        if title.startswith("time per stage"):
            _stacked_stages(ax, entries)
            continue
        keys = keys or (_memory_keys(entries) if title.startswith("peak memory") else [])
        drawn = 0
        for key in keys:
            steps, values = series(entries, key)
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 40 else None, markersize=3, label=key)
                drawn += 1
        if title.startswith("actor/ppo_kl"):
            ax.axhspan(*HEALTH["ppo_kl"], color="green", alpha=0.12)
        if title.startswith("grad norm") and drawn:
            ax.axhline(HEALTH["grad_norm_max"], color="red", alpha=0.4, linestyle="--")
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    text_ax = flat[len(PANELS)]
    for ax in flat[len(PANELS) + 1:]:
        ax.axis("off")
    text_ax.axis("off")
    text_ax.set_title("health verdict", fontsize=11)
    text_ax.text(0.0, 1.0, "\n".join(_wrap(line, 62) for line in verdict), va="top", ha="left", fontsize=8,
                 family="monospace", transform=text_ax.transAxes)
    fig.suptitle(f"tripod report: {os.path.abspath(run_dir)}", fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    txt = os.path.join(run_dir, "report.txt")
    with open(txt, "w") as f:
        f.write("\n".join(verdict) + "\n")
    return out_png, txt, verdict


def _stacked_stages(ax, entries: Sequence[dict[str, Any]]) -> None:
    keys = _stage_keys(entries)
    rows = [e for e in entries if any(k in e for k in keys)]
    if not rows:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        return
    steps = [e["step"] for e in rows]
    layers = [[float(e.get(k, 0.0)) for e in rows] for k in keys]
    ax.stackplot(steps, layers, labels=[k.removeprefix(STAGE_PREFIX) for k in keys], alpha=0.85)
    total = series(rows, STAGE_PREFIX + "step")
    if total[0]:
        ax.plot(*total, color="black", linewidth=1, label="step (total)")
    top = max(total[1] + [sum(col) for col in zip(*layers)])
    ax.set_ylim(0, top * 1.6)  # headroom for the legend above the stack
    ax.legend(fontsize=7, ncol=3, loc="upper center")


def _wrap(line: str, width: int) -> str:
    words, lines, cur = line.split(" "), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = "     " + w
        else:
            cur = f"{cur} {w}" if cur else w
    lines.append(cur)
    return "\n".join(lines)
