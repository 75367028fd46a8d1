"""`tripod report RUN_DIR`: reads metrics.jsonl only (finished, running or crashed runs), writes a PNG dashboard and a
verdict that flags the health signals outside their ranges (ppo_kl 0.01-0.03, grad norm < 10, validation rising and
not past its best, not stalled) and passes a healthy run."""
import json
import os
import random

import matplotlib.image
import pytest

from tripod.engine.cli import main
from tripod.engine.logging.report import _memory_keys, health_verdict, load_metrics, write_report


def _run(rng: random.Random, val: dict[int, float], kl=(0.012, 0.028), grad=(0.5, 6.0), steps: int = 12) -> list:
    entries = [{"step": 0, "val/reward_mean": val[0]}]
    for step in range(1, steps + 1):
        e = {"step": step, "critic/score/mean": rng.random(), "actor/ppo_kl": rng.uniform(*kl),
             "actor/pg_clipfrac": rng.uniform(0, 0.1), "actor/grad_norm": rng.uniform(*grad),
             "critic/grad_norm": rng.uniform(*grad), "actor/lr": 5e-5 * rng.random(), "actor/entropy": rng.random(),
             "actor/reward_kl_penalty": rng.uniform(0, 0.01), "actor/reward_kl_penalty_coeff": 0.01,
             "perf/throughput": rng.uniform(20, 40), "perf/max_memory_allocated_gb": rng.uniform(4, 5),
             "timing_s/gen": rng.uniform(5, 10), "timing_s/update_actor": rng.uniform(5, 10),
             "timing_s/reshard": rng.uniform(0.5, 1)}
        e["timing_s/step"] = e["timing_s/gen"] + e["timing_s/update_actor"] + e["timing_s/reshard"] + 0.3
        if step in val:
            e["val/reward_mean"] = val[step]
        entries.append(e)
    return entries


def _write(run_dir, entries, tail: str = "") -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in entries)
        f.write(tail)


def _flags(verdict: list[str]) -> list[str]:
    return [line for line in verdict if line.startswith("FLAG")]


def test_healthy_run_has_no_flags_and_a_readable_dashboard(tmp_path, capsys):
    rng = random.Random(0)
    _write(tmp_path, _run(rng, {0: 0.02, 4: 0.3, 8: 0.45, 12: 0.5}))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"dashboard {tmp_path / 'report.png'}" in out
    verdict = (tmp_path / "report.txt").read_text().splitlines()
    assert _flags(verdict) == [], verdict
    assert any(line.startswith("OK   validation reward 0.020 (step 0) -> 0.500 (step 12)") for line in verdict)
    image = matplotlib.image.imread(str(tmp_path / "report.png"))
    assert image.shape[0] >= 800 and image.shape[1] >= 1000  # 12 panels at 16x15 in, 80 dpi


def test_unhealthy_run_is_flagged_signal_by_signal(tmp_path):
    rng = random.Random(1)
    entries = _run(rng, {0: 0.02, 4: 0.47, 8: 0.3, 12: 0.28}, kl=(0.05, 0.09), grad=(0.5, 6.0))
    entries[7]["actor/grad_norm"] = 10 + rng.random() * 50  # a spike at step 7
    verdict = health_verdict(entries)
    flags = _flags(verdict)
    assert any(f.startswith("FLAG actor/ppo_kl median") and "12/12 steps outside" in f for f in flags), flags
    assert any(f.startswith("FLAG actor/grad_norm") and "steps [7]" in f for f in flags), flags
    assert any(f.startswith("FLAG last validation is 0.190 below the best") and "step-4 checkpoint" in f
               for f in flags), flags
    assert not any("critic/grad_norm" in f for f in flags)

    # a validation that stopped improving: flagged as stalled (and a run that never rose as not rising)
    stalled = _run(random.Random(2), {0: 0.1, 3: 0.4, 6: 0.405, 9: 0.402, 12: 0.404})
    assert any(f.startswith("FLAG validation stalled: the last 3 validations (from step 6)")
               for f in _flags(health_verdict(stalled)))
    falling = _run(random.Random(3), {0: 0.3, 12: 0.29})
    assert any("not rising" in f for f in _flags(health_verdict(falling)))
    entries[3]["actor/entropy"] = float("nan")
    assert any(f.startswith("FLAG non-finite values in ['actor/entropy']") for f in _flags(health_verdict(entries)))


def test_crashed_run_reads_up_to_the_torn_line(tmp_path):
    rng = random.Random(4)
    entries = _run(rng, {0: 0.02, 4: 0.3}, steps=5)
    rerun = dict(entries[3], **{"critic/score/mean": 0.123456})  # a guard rollback logs step 3 again
    _write(tmp_path, entries + [rerun], tail='{"step": 6, "critic/sco')  # the crash cut the last line short
    loaded = load_metrics(str(tmp_path / "metrics.jsonl"))
    assert [e["step"] for e in loaded] == [0, 1, 2, 3, 4, 5]
    assert loaded[3]["critic/score/mean"] == 0.123456
    png, txt, verdict = write_report(str(tmp_path), str(tmp_path / "out" / "dash.png"))
    assert os.path.getsize(png) > 10_000 and verdict[-1].startswith("NOTE 6 logged steps, 0..5")


def test_bad_run_dir_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == (f"tripod report: error: RUN_DIR {tmp_path / 'missing'} is not a "
                                               "directory; pass a run's trainer.default_local_dir")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tripod report: error: ") and "metrics.jsonl does not exist" in err
    with pytest.raises(ValueError, match="holds no logged step"):
        _write(tmp_path, [], tail="{")
        load_metrics(str(tmp_path / "metrics.jsonl"))


def test_memory_panel_draws_every_rank_in_rank_order():
    per_rank = [{"step": 1, "perf/max_memory_allocated_gb": 4.0, "perf/peak_memory_gb/max": 4.2,
                 **{f"perf/peak_memory_gb/rank{r}": 4.0 + r / 100 for r in (0, 1, 2, 10)}}]
    assert _memory_keys(per_rank) == [f"perf/peak_memory_gb/rank{r}" for r in (0, 1, 2, 10)]
    big_world = [{"step": 1, "perf/peak_memory_gb/max": 4.2, "perf/peak_memory_gb/min": 3.9}]
    assert _memory_keys(big_world) == ["perf/peak_memory_gb/max", "perf/peak_memory_gb/min"]
    assert _memory_keys([{"step": 1, "perf/max_memory_allocated_gb": 4.0}]) == ["perf/max_memory_allocated_gb"]
