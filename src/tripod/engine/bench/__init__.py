"""`tripod bench`: the throughput harness of a recipe's PPO/GRPO step, side by side with peer trainers.

    command.py    the CLI (`tripod bench RECIPE [key=value ...] --steps N --warmup W --out DIR [--sweep] [--baseline]`)
    runner.py     on every rank: PPOTrainer.train_step (the code path of `tripod train`), raw per-step records
    summary.py    the arithmetic: tokens, shares of the step, medians and spreads, MFU, the bench.json schema
    report.py     bench.md and the PNGs (matplotlib)
    baselines.py  peers measured in the same invocation: TRL's GRPOTrainer (own venv) and a plain HF loop
    trl_grpo.py   the TRL script (runs inside .venv-trl, imports no tripod code but the reward rule)
    hf_loop.py    a plain transformers GRPO loop that materialises full logits
"""
