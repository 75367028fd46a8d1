"""Step-time cost of each policy loss (actor_rollout_ref.actor.policy_loss.loss_mode) against vanilla.

The loss is the only part of a PPO step a loss_mode changes, so this times what it touches, interleaved in one process
(robust to machine load):

- `--loss_only`: each registered loss's forward + backward on random [rows, response_length] float32 tensors (the
  loss by itself, what the actor adds per micro-batch), median of `--repeats`;
- otherwise also the actor update (`PolicyWorker.update`: forward, fused log-probs, the loss, backward, Adam step) of
  the demo model (recipes/demo/smollm2-135m-arithmetic.yaml's SmolLM2-135M-Instruct, TP1 x PP1 fp32) on one GRPO
  batch of `--prompts` x `--n` rows of random prompt and response tokens, each loss in turn, `--repeats` rounds.

    flock /tmp/tripod-heavy.lock .venv/bin/python scripts/bench_losses.py outputs/models/smollm2-135m-instruct \
        --losses vanilla,gspo,cispo --repeats 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def loss_only(losses: list[str], rows: int, width: int, repeats: int) -> dict[str, float]:
    from tripod.engine.algorithms import get_policy_loss_fn, global_batch_info
    from tripod.engine.algorithms.policy_losses import ConfigView

    g = torch.Generator().manual_seed(0)
    mask = torch.arange(width)[None, :] < torch.randint(1, width + 1, (rows, 1), generator=g)
    old = -torch.rand(rows, width, generator=g) * 3
    logp = old + torch.randn(rows, width, generator=g) * 0.1
    adv = torch.randn(rows, 1, generator=g).expand(-1, width).contiguous()
    policy = ConfigView({"loss_mode": "", "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
                         "kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1, "dro_beta": 0.1,
                         "rollout_correction": ConfigView({"loss_type": "ppo_clip"})})
    config = ConfigView({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
                         "tau_pos": 1.0, "tau_neg": 1.05, "policy_loss": policy,
                         "global_batch_info": global_batch_info(mask.sum(-1), width, None)})
    times: dict[str, list[float]] = {name: [] for name in losses}
    for _ in range(repeats + 1):  # the first round warms up
        for name in losses:
            leaf = logp.clone().requires_grad_()
            t0 = time.perf_counter()
            loss, _ = get_policy_loss_fn(name)(old, leaf, adv, mask, "token-mean", config, None)
            loss.backward()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts[1:]) for name, ts in times.items()}


def actor_updates(model_dir: str, losses: list[str], prompts: int, n: int, resp_len: int, micro: int,
                  repeats: int) -> dict[str, float]:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from tripod.parallel.megatron_patches import apply_megatron_patches

    apply_megatron_patches(None if torch.cuda.is_available() else "cpu")
    from tripod.engine.config import ActorConfig, OptimConfig
    from tripod.engine.config.models import PolicyLossConfig
    from tripod.engine.workers.batch import build_ppo_batch
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout

    arch = arch_from_hf(model_dir)
    g = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(10, 40000, (48,), generator=g).tolist() for _ in range(prompts)]
    rows = [p for p in prompt_ids for _ in range(n)]
    responses = [torch.randint(10, 40000, (int(k),), generator=g).tolist()
                 for k in torch.randint(resp_len // 2, resp_len + 1, (len(rows),), generator=g)]
    batch = build_ppo_batch(rows, responses, resp_len, 0, [i for i in range(prompts) for _ in range(n)])
    batch["advantages"] = torch.randn(len(rows), 1, generator=g).expand(-1, resp_len) * batch["response_mask"]
    actor = PolicyWorker("actor", arch, ParallelLayout(tp=1, pp=1, name="actor", arch=arch), model_dir,
                         optim=OptimConfig(lr=1e-7, weight_decay=0.0), grad_clip=1.0, total_steps=100)
    configs = {name: ActorConfig(ppo_mini_batch_size=prompts, ppo_micro_batch_size_per_gpu=micro, ppo_epochs=1,
                                 clip_ratio_low=0.2, clip_ratio_high=0.2, use_dynamic_bsz=False, shuffle=False,
                                 policy_loss=PolicyLossConfig(loss_mode=name, dro_beta=0.1)) for name in losses}
    times: dict[str, list[float]] = {name: [] for name in losses}
    for rep in range(repeats + 1):  # round 0 warms up
        for name in losses:
            t0 = time.perf_counter()
            actor.update(batch, configs[name], 1.0, n)
            times[name].append(time.perf_counter() - t0)
            print(f"round {rep} {name}: {times[name][-1]:.2f} s", flush=True)
    dist.destroy_process_group()
    return {name: min(ts[1:]) for name, ts in times.items()}  # the least disturbed round: the machine is shared


def main() -> None:
    from tripod.engine.algorithms import list_policy_losses

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", default="outputs/models/smollm2-135m-instruct")
    ap.add_argument("--losses", default=None, help="comma list (default: every registered loss but bypass_mode, "
                    "which is vanilla on other old log-probs)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--response_length", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--loss_only", action="store_true")
    args = ap.parse_args()
    losses = args.losses.split(",") if args.losses else [n for n in list_policy_losses() if n != "bypass_mode"]
    losses = ["vanilla"] + [n for n in losses if n != "vanilla"]
    torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}", flush=True)
    alone = loss_only(losses, args.prompts * args.n, args.response_length, max(args.repeats, 20))
    for name, t in alone.items():
        print(f"RESULT loss-only {name}: {t * 1e3:.2f} ms ({t / alone['vanilla']:.2f}x vanilla)", flush=True)
    if not args.loss_only:
        updates = actor_updates(args.model_dir, losses, args.prompts, args.n, args.response_length, args.micro,
                                args.repeats)
        for name, t in updates.items():
            print(f"RESULT actor-update {name}: {t:.2f} s, fastest round ({t / updates['vanilla']:.3f}x vanilla)",
                  flush=True)
    print(f"load average after {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
