"""bench.json, bench.md and the PNGs of `tripod bench` (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import json
import os
from typing import Any

from tripod.engine.bench.summary import check_schema

STAGE_LABELS = {"reshard": "reshard", "gen": "generation", "reward": "rewards", "old_log_prob": "old log-probs",
                "ref": "reference", "values": "values", "adv": "advantages", "update_critic": "critic update",
                "update_actor": "actor update", "other": "other"}


def _f(x: Any, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def side_by_side(doc: dict[str, Any]) -> str:
    """The markdown table of every run: step time, tokens/s, samples/s, peak memory, ratio to the first run."""
    lines = ["| run | layout | steps | step s (median [min-max]) | tokens/step | tokens/s | tokens/s/device | samples/s "
             "| peak GB/process | reward | non-zero adv. | tripod / this (tokens/s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = doc["runs"][0]["summary"]
    for run in doc["runs"]:
        s = run["summary"]
        layout = f"{s['world_size']} proc x {'/'.join(str(t) for t in s['threads_per_process'])} thr"
        st = s["step_s"]
        lines.append(f"| {run['label']} | {layout} | {s['steps']} | {st['median']:.2f} [{st['min']:.2f}-{st['max']:.2f}] "
                     f"| {s['tokens_per_step']:.0f} | {s['tokens_per_s']:.1f} | {s['tokens_per_s_per_device']:.1f} "
                     f"| {s['samples_per_s']:.2f} | {_f(s['peak_memory_gb_max'])} | {_f(s.get('score_mean'), 3)} "
                     f"| {_f(s.get('nonzero_adv_frac'))} "
                     f"| {base['tokens_per_s'] / s['tokens_per_s']:.2f}x |")
    return "\n".join(lines)


def stage_table(run: dict[str, Any]) -> str:
    s = run["summary"]
    lines = [f"| stage ({run['label']}) | median s | min s | max s | share of step | MFU |", "|---|---:|---:|---:|---:|---:|"]
    for k, v in s["stages"].items():
        mfu = s["mfu"].get(k)
        lines.append(f"| {STAGE_LABELS.get(k, k)} | {v['median_s']:.2f} | {v['min_s']:.2f} | {v['max_s']:.2f} "
                     f"| {100 * v['share']:.1f}% | {'-' if mfu is None else f'{100 * mfu:.1f}%'} |")
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    m, v = doc["machine"], doc["versions"]
    out = [f"# tripod bench: `{doc['recipe']}`", "",
           f"{doc['created_utc']}; {doc['steps']} measured steps after {doc['warmup']} warmup; overrides: "
           f"`{' '.join(doc['overrides']) or 'none'}`" + (f"; sweep `{doc['sweep']}`" if doc.get("sweep") else ""),
           "", f"Machine: {m.get('cpu_model')}, {m.get('cpu_count')} logical CPUs, GPU: {m.get('gpu') or 'none'}, "
           f"load average at the end {m.get('load_average')}. Versions: "
           + ", ".join(f"{k} {val}" for k, val in v.items()), "", "## Side by side", "", side_by_side(doc), ""]
    for name, ratios in doc["comparison"].items():
        out.append(f"- tripod vs {name}: throughput **{ratios['throughput_ratio']:.2f}x**, median step time "
                   f"{ratios['step_time_ratio']:.2f}x" + (f", peak memory per process tripod/{name} "
                                                          f"{ratios['peak_memory_ratio']:.2f}"
                                                          if "peak_memory_ratio" in ratios else ""))
    for name, settings in doc["settings"].items():
        out += ["", f"### Settings vs {name}", "", "Matched: " + "; ".join(settings["matched"]) + ".", "",
                "Not matched: " + "; ".join(settings["not_matched"]) + "."]
    out += ["", "## Where the time goes", "", "Share = the stage's summed time / the summed step time (other = step "
            "minus the timed stages). MFU = the stage's matmul FLOPs / time / processes / the per-process ceiling "
            "measured in the same run (CPU: fp32 1024^3 matmul, best of 5; GPU: bf16 peak).", ""]
    for run in doc["runs"]:
        s = run["summary"]
        out += [stage_table(run), "",
                f"decode tokens/s: {_f(s['decode_tokens_per_s'], 1)}; matmul ceiling "
                f"{_f(s['matmul_ceiling_gflops'], 1)} GFLOP/s per process; peak memory per process (GB): "
                + ", ".join(f"{x:.2f}" for x in s["peak_memory_gb"])
                + (f"; `tripod plan`: model {run['plan']['model_gb']:.2f} GB, resharding peak extra "
                   f"{run['plan']['reshard_peak_extra_gb']:.3f} GB per rank" if run.get("plan") else "")
                + ("; old log-probs taken from the on-policy update's forward (not recomputed)"
                   if run.get("on_policy_old_log_probs_skipped") else "")
                + (f"; a checkpoint save: {s['checkpoint']['gb']:.2f} GB, the step waits "
                   f"{s['checkpoint']['blocking_s']:.2f} s, on disk after {s['checkpoint']['total_s']:.2f} s"
                   if s.get("checkpoint") else ""), ""]
    out += ["![stages and tokens/s per step](bench.png)", ""]
    if doc.get("sweep"):
        out += ["![sweep](sweep.png)", ""]
    return "\n".join(out)


def plot(doc: dict[str, Any], raws: dict[str, dict], path: str) -> None:
    """Left: stacked stage seconds per measured step of every run; right: tokens/s over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    x, ticks = 0, []
    colors = {k: plt.cm.tab10(i % 10) for i, k in enumerate(STAGE_LABELS)}
    drawn = set()
    for label, raw in raws.items():
        recs = [r for r in raw["records"] if not r.get("warmup")]
        for i, r in enumerate(recs):
            bottom = 0.0
            parts = dict(r["stages_s"], other=r["step_s"] - sum(r["stages_s"].values()))
            for k, secs in parts.items():
                ax1.bar(x, secs, bottom=bottom, color=colors.get(k, "gray"),
                        label=None if k in drawn else STAGE_LABELS.get(k, k))
                drawn.add(k)
                bottom += secs
            ticks.append((x, f"{label}\n#{i + 1}"))
            x += 1
        x += 1
        tps = [(r["prompt_tokens"] + r["response_tokens"]) / r["step_s"] for r in recs]
        ax2.plot(range(1, len(tps) + 1), tps, marker="o", label=label)
    ax1.set_xticks([t for t, _ in ticks], [s for _, s in ticks], fontsize=7)
    ax1.set_ylabel("seconds per step")
    ax1.set_title("time per stage, each measured step")
    ax1.legend(fontsize=7)
    ax2.set_xlabel("measured step")
    ax2.set_ylabel("tokens/s (prompt + response)")
    ax2.set_title("throughput over steps")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in doc["runs"] if r["system"] == "tripod"]
    xs = [str(next(iter(r["point"].values()))) for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(xs, [r["summary"]["tokens_per_s"] for r in runs], marker="o", label="total")
    ax1.plot(xs, [r["summary"]["tokens_per_s_per_device"] for r in runs], marker="s", label="per device")
    ax1.set_xlabel(doc["sweep"].split("=")[0])
    ax1.set_ylabel("tokens/s")
    ax1.legend()
    bottom = [0.0] * len(runs)
    for k in STAGE_LABELS:
        vals = [r["summary"]["stages"].get(k, {}).get("median_s", 0.0) for r in runs]
        if any(vals):
            ax2.bar(xs, vals, bottom=bottom, label=STAGE_LABELS[k])
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_ylabel("median seconds per step")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(doc: dict[str, Any], out_dir: str) -> str:
    """Write bench.json / bench.md / bench.png (+ sweep.png); return the side-by-side table."""
    check_schema(doc)
    raws = {}
    for run in doc["runs"]:
        with open(os.path.join(out_dir, "runs", run["label"], "raw.json")) as f:
            raws[run["label"]] = json.load(f)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(markdown(doc))
    plot(doc, raws, os.path.join(out_dir, "bench.png"))
    if doc.get("sweep"):
        plot_sweep(doc, os.path.join(out_dir, "sweep.png"))
    return side_by_side(doc)
