"""`tripod report RUN_DIR [--out PNG]`: the dashboard PNG and health verdict of a run (engine/logging/report.py).

Reads RUN_DIR/metrics.jsonl only, so it works on a finished, running or crashed run; writes RUN_DIR/report.png (or
--out) and RUN_DIR/report.txt, prints the verdict and the PNG's path. No torch.distributed world is needed.
"""
from __future__ import annotations

import argparse
import os


def cmd_report(args: argparse.Namespace) -> int:
    from tripod.engine.logging.report import write_report

    if not os.path.isdir(args.run_dir):
        raise NotADirectoryError(f"RUN_DIR {args.run_dir} is not a directory; pass a run's trainer.default_local_dir")
    png, txt, verdict = write_report(args.run_dir, args.out)
    print("\n".join(verdict))
    print(f"tripod report: dashboard {png}, verdict {txt}")
    return 0


def add_report_command(subparsers) -> None:
    p = subparsers.add_parser("report", help="PNG dashboard + health verdict of a run, from its metrics.jsonl",
                              description="Plot a run's rewards, KL, entropy, clipping, ppo_kl, grad norms, LRs, "
                                          "stage times, memory and tokens/s from RUN_DIR/metrics.jsonl (finished, "
                                          "running or crashed) and flag health signals outside their ranges.")
    p.add_argument("run_dir", help="the run directory (trainer.default_local_dir) holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/report.png)")
    p.set_defaults(func=cmd_report)
