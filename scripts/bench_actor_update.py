"""A/B of the actor update on one fixed GRPO batch, interleaved in one process (robust to machine load).

Builds tripod's actor (`PolicyWorker`, TP1 x PP1, fp32) and the same model in transformers from one HF dir, makes one
batch like `recipes/bench/smollm2-135m-grpo.yaml` (the first `--prompts` prompts of the data set with the chat
template, `--n` sampled-length random responses each) and times, in turn, `--repeats` times:

- `tripod`: `PolicyWorker.update` (forward, fused log-probs from the hidden state, PPO loss, backward, Adam step);
  with `--variants` also `tripod-unshared` (actor.share_prompt_prefix off: every row runs its own copy of the prompt)
  and `tripod-rmpad` (model.use_remove_padding on: each prompt group without padding, several to a model row);
- `hf`: transformers forward over the same rows, log-softmax of the response positions only, the same loss,
  backward, clip, AdamW.

`--profile` adds one torch.profiler pass of each and prints the top ops by self CPU time.

    flock /tmp/tripod-heavy.lock python scripts/bench_actor_update.py outputs/models/smollm2-135m-instruct \
        --data outputs/data/arithmetic/train.parquet --repeats 3
"""
from __future__ import annotations

import argparse
import os
import time

import torch


def make_batch(model_dir: str, data: str, prompts: int, n: int, resp_len: int, seed: int):
    from transformers import AutoTokenizer

    from tripod.engine.data import PromptDataset
    from tripod.engine.workers.batch import build_ppo_batch

    tok = AutoTokenizer.from_pretrained(model_dir)
    ds = PromptDataset(data, tokenizer=tok, prompt_key="prompt", max_prompt_length=1024)
    ids = ds.batch(list(range(prompts))).input_ids
    g = torch.Generator().manual_seed(seed)
    rows = [p for p in ids for _ in range(n)]
    responses = [torch.randint(10, 40000, (int(k),), generator=g).tolist()
                 for k in torch.randint(resp_len // 2, resp_len + 1, (len(rows),), generator=g)]
    batch = build_ppo_batch(rows, responses, resp_len, tok.pad_token_id or 0, [i for i in range(prompts) for _ in range(n)])
    batch["advantages"] = torch.randn(len(rows), 1, generator=g).expand(-1, resp_len) * batch["response_mask"]
    return batch


def hf_update(model, opt, batch, clip: float) -> float:
    ids, attn = batch["input_ids"], batch["attention_mask"]
    pos = batch.response_positions()
    hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
    h = hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
    logp = torch.log_softmax(model.lm_head(h).float(), -1).gather(-1, batch["responses"][..., None]).squeeze(-1)
    mask, adv = batch["response_mask"], batch["advantages"]
    ratio = torch.exp(logp - logp.detach())
    loss = (-torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return float(norm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--data", default="outputs/data/arithmetic/train.parquet")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--response_length", type=int, default=16)
    ap.add_argument("--micro", type=int, default=32, help="ppo_micro_batch_size_per_gpu (rows)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--variants", action="store_true", help="also time tripod with share_prompt_prefix off and "
                    "with use_remove_padding on")
    ap.add_argument("--no_hf", action="store_true")
    ap.add_argument("--runs", default=None, help="comma list: time only these of the runs above (e.g. "
                    "tripod,tripod-rmpad,hf)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    known = ["tripod"] + (["tripod-unshared", "tripod-rmpad"] if args.variants else []) + ([] if args.no_hf else ["hf"])
    unknown = sorted(set(args.runs.split(",")) - set(known)) if args.runs else []
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; choose from {known} (tripod-* need --variants)")

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from tripod.parallel.megatron_patches import apply_megatron_patches

    apply_megatron_patches(None if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from tripod.engine.config import ActorConfig, OptimConfig
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout

    arch = arch_from_hf(args.model_dir)
    batch = make_batch(args.model_dir, args.data, args.prompts, args.n, args.response_length, seed=0)
    rows = batch.size
    tokens = int(batch["attention_mask"].sum())
    print(f"batch: {rows} rows, {tokens} tokens ({int(batch['response_mask'].sum())} response), "
          f"padded [{rows}, {batch['input_ids'].shape[1]}], threads {torch.get_num_threads()}", flush=True)
    if args.variants:  # the model rows each variant runs (one micro-batch of --micro rows)
        from tripod.engine.workers.packing import pack_shared_prompts, pack_without_padding

        mb = batch.select(slice(0, min(args.micro, rows))).trimmed()
        for name, packed in (("tripod", pack_shared_prompts(mb)), ("tripod-rmpad", pack_without_padding(mb, True))):
            shape = list(packed.input_ids.shape) if packed is not None else list(mb["input_ids"].shape)
            print(f"layout {name}: first micro-batch as {shape} = {shape[0] * shape[1]} slots "
                  f"(its rows: {int(mb['attention_mask'].sum())} tokens)", flush=True)
    optim = OptimConfig(lr=1e-6, weight_decay=0.0)
    actor = PolicyWorker("actor", arch, ParallelLayout(tp=1, pp=1, name="actor", arch=arch), args.model_dir,
                         optim=optim, grad_clip=1.0, total_steps=100)
    runs = {}

    def tripod_run(shared: bool, remove_padding: bool = False):
        cfg = ActorConfig(ppo_mini_batch_size=args.prompts, ppo_micro_batch_size_per_gpu=args.micro, ppo_epochs=1,
                          clip_ratio_low=0.2, clip_ratio_high=0.2, use_dynamic_bsz=False, shuffle=False)

        def run() -> float:
            actor.share_prompt_prefix, actor.remove_padding = shared, remove_padding
            return actor.update(batch, cfg, 1.0, args.n)["actor/grad_norm"]
        return run

    runs["tripod"] = tripod_run(True)
    if args.variants:
        runs["tripod-unshared"] = tripod_run(False)
        runs["tripod-rmpad"] = tripod_run(True, remove_padding=True)
    if not args.no_hf:
        hf = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        hf.train()
        hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, weight_decay=0.0)
        runs["hf"] = lambda: hf_update(hf, hf_opt, batch, 1.0)

    if args.runs:
        runs = {k: runs[k] for k in args.runs.split(",")}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for name, fn in runs.items():  # warm-up (allocator, lazy init)
        fn()
    for rep in range(args.repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            norm = fn()
            times[name].append(time.perf_counter() - t0)
            print(f"repeat {rep} {name}: {times[name][-1]:.2f} s (grad norm {norm:.4g})", flush=True)
    for name, ts in times.items():
        ts = sorted(ts)
        print(f"RESULT {name}: median {ts[len(ts) // 2]:.2f} s  min {ts[0]:.2f}  max {ts[-1]:.2f}", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, fn in runs.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            print(f"---- profile {name}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
