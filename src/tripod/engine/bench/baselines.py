"""Peers of `tripod bench`, run on the same work right after tripod: TRL's GRPOTrainer and a plain HF loop.

The work is fixed by the resolved tripod config: the same prompts per step (the rows tripod's loader hands out,
in its order), samples per prompt, max new tokens, epochs, learning rate and optimizer settings, temperature,
top-p. Each peer runs in its own process (so its peak RSS is its own) with all the cores this process may use as threads
(tripod's ranks share the same cores: trainer.threads_per_rank x ranks).

TRL stays out of tripod's requirements: it lives in its own virtualenv (default `.venv-trl` in the repo root,
`TRIPOD_TRL_VENV` to point elsewhere), created on first use with the torch wheel of the version tripod runs on,
pinned so pip never pulls a different (CUDA) build: `python -m venv`, then
`pip install torch==<tripod's> trl==TRL_VERSION transformers==<tripod's>`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tripod import CHECKOUT, SRC_DIR
from tripod.engine.launch import cores_available

REPO = str(CHECKOUT)
TRL_VERSION = "1.16.0"
BASELINES = {"trl": "TRL GRPOTrainer", "hf": "plain transformers GRPO loop (full logits)"}

MATCHED = ["model weights and tokenizer", "prompts of every step (same rows, same order, same chat template)",
           "prompts per step", "samples per prompt", "max new tokens", "epochs over the batch", "optimizer steps "
           "per batch (one per mini-batch)", "learning rate, Adam betas/eps, weight decay, grad clip", "sampling temperature and top-p "
           "(top-k off)", "GRPO advantage (group mean, std scaling as the recipe)", "no reference model / KL",
           "token-mean loss", "fp32 on CPU", "reward rule (tripod's engine.rewards)"]
NOT_MATCHED = {
    "trl": ["random samples (each framework draws its own, so response lengths and token counts differ per step; "
            "throughput uses each one's own tokens)", "generation engine (TRL: transformers generate with full "
            "logits; tripod: its embedded KV-cache engine)", "parallel layout (TRL: 1 process with all the cores "
            "as threads; tripod: the recipe's ranks x trainer.threads_per_rank, the same cores in all)", "TRL-only extras (its internal "
            "metrics, accelerate wrapping) are inside its step time; its log printing is off", "with several "
            "mini-batches: TRL shuffles the generation batch's rows before splitting it (steps_per_generation), "
            "tripod splits it by prompt groups"],
    "hf": ["random samples (own draws)", "generation with transformers generate", "1 process with all cores"],
}


def check_baselines(names: list[str]) -> None:
    for name in names:
        if name not in BASELINES:
            raise ValueError(f"--baseline {name}: unknown; choose from {sorted(BASELINES)}")


def work_spec(cfg, steps: int, warmup: int) -> dict:
    """The work of `steps + warmup` tripod steps in a form any peer can run: messages, answers, settings."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from tripod.engine.data import PromptDataLoader, PromptDataset

    d, arc = cfg.data, cfg.actor_rollout_ref
    tok = AutoTokenizer.from_pretrained(d.tokenizer or arc.model.path)
    ds = PromptDataset(d.train_files, tok, d.prompt_key, d.max_prompt_length, d.filter_overlong_prompts,
                       d.apply_chat_template, d.reward_fn_key,
                       chat_template_kwargs=dict(d.apply_chat_template_kwargs or {}))
    files = [d.train_files] if isinstance(d.train_files, str) else list(d.train_files)
    rows = [r for path in files for r in pq.read_table(path).to_pylist()]
    loader = PromptDataLoader(ds, d.train_batch_size, d.shuffle, d.seed)
    prompts, counts = [], []
    for _ in range(steps + warmup):
        batch = next(iter(loader))
        step_rows = []
        for index, ids in zip(batch.indices, batch.input_ids):
            row = rows[index]
            msgs = row[d.prompt_key]
            msgs = [{"role": "user", "content": msgs}] if isinstance(msgs, str) else \
                [{"role": m.get("role", "user"), "content": m["content"]} for m in msgs]
            step_rows.append({"messages": msgs, "ground_truth": str(row["reward_model"]["ground_truth"]),
                              "data_source": str(row[d.reward_fn_key]), "extra_info": dict(row.get("extra_info") or {})})
        prompts.append(step_rows)
        counts.append([len(ids) for ids in batch.input_ids])
    a, r = arc.actor, arc.rollout
    return {"repo": REPO, "model": arc.model.path, "prompts": prompts, "prompt_token_counts": counts,
            "prompts_per_step": d.train_batch_size, "n": r.n, "max_new_tokens": r.response_length,
            "epochs": a.ppo_epochs, "mini_batches": d.train_batch_size // a.ppo_mini_batch_size, "temperature": r.temperature, "top_p": r.top_p, "clip_ratio": a.clip_ratio,
            "norm_adv_by_std": cfg.algorithm.norm_adv_by_std_in_grpo, "seed": cfg.trainer.seed, "warmup": warmup,
            "threads": cores_available(),
            "optim": {"lr": a.optim.lr, "weight_decay": a.optim.weight_decay, "betas": list(a.optim.betas),
                      "eps": a.optim.eps, "grad_clip": a.grad_clip}}


def check_matchable(cfg) -> None:
    """Peers run the GRPO work of item 4 only; anything else cannot be matched and is refused up front."""
    algo, a = cfg.algorithm, cfg.actor_rollout_ref.actor
    if algo.adv_estimator != "grpo" or algo.use_kl_in_reward or a.use_kl_loss or a.loss_agg_mode != "token-mean":
        raise ValueError("--baseline needs a GRPO recipe without KL (algorithm.adv_estimator=grpo, "
                         "use_kl_in_reward=false, actor.use_kl_loss=false, loss_agg_mode=token-mean)")
    if cfg.data.train_batch_size % a.ppo_mini_batch_size:
        raise ValueError("--baseline needs whole mini-batches (data.train_batch_size a multiple of "
                         "actor.ppo_mini_batch_size): TRL takes one optimizer step per mini-batch of a generation "
                         "batch (steps_per_generation)")


def trl_python() -> str:
    """The TRL venv's python, creating the venv on first use (torch pinned to tripod's CPU build)."""
    from importlib import metadata

    venv = os.environ.get("TRIPOD_TRL_VENV", os.path.join(REPO, ".venv-trl"))
    py = os.path.join(venv, "bin", "python")
    probe = [py, "-c", f"import trl, sys; sys.exit(trl.__version__ != '{TRL_VERSION}')"]
    if os.path.exists(py) and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    print(f"tripod bench: creating the TRL virtualenv {venv} (trl {TRL_VERSION}, torch "
          f"{metadata.version('torch')})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    torch_v = metadata.version("torch").split("+")[0]
    log = os.path.join(venv, "pip-install.log")  # pip's warnings go here, not between the bench's lines
    with open(log, "w") as out:
        done = subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"torch=={torch_v}",
                               f"trl=={TRL_VERSION}", f"transformers=={metadata.version('transformers')}"],
                              stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"creating the TRL virtualenv failed (pip exit {done.returncode}); see {log}")
    return py


def run_baseline(name: str, cfg, steps: int, warmup: int, out_dir: str) -> tuple[dict, dict]:
    """Run peer `name` on tripod's work; returns (raw records in the summary's form, matched settings)."""
    check_matchable(cfg)
    run_dir = os.path.join(out_dir, "runs", name)
    os.makedirs(run_dir, exist_ok=True)
    spec_path, raw_path = os.path.join(run_dir, "spec.json"), os.path.join(run_dir, "raw.json")
    with open(spec_path, "w") as f:
        json.dump(work_spec(cfg, steps, warmup), f)
    if name == "trl":
        cmd = [trl_python(), os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_grpo.py"), spec_path, raw_path]
    else:
        cmd = [sys.executable, "-m", "tripod.engine.bench.hf_loop", spec_path, raw_path]
    env = dict(os.environ, PYTHONPATH=str(SRC_DIR), TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    print(f"tripod bench: running {BASELINES[name]} on the same work", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"baseline {name} failed (exit {proc.returncode}); its spec is {spec_path}")
    with open(raw_path) as f:
        raw = json.load(f)
    return raw, {"matched": MATCHED, "not_matched": NOT_MATCHED[name]}


def load_baseline(name: str, out_dir: str) -> tuple[dict, dict]:
    """The raw records peer `name` left in DIR/runs/NAME/raw.json (written after each of its steps)."""
    path = os.path.join(out_dir, "runs", name, "raw.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--from-raw: {path} does not exist; drop --baseline {name} or rerun it")
    with open(path) as f:
        return json.load(f), {"matched": MATCHED, "not_matched": NOT_MATCHED[name]}
