#!/usr/bin/env python
"""Benchmark: what one PPO step moves between ranks, and what it keeps on each, with a tiny model on gloo ranks.

    python scripts/bench_dataflow.py                                  # 32 prompts x 4 samples x 256 tokens, 4 ranks
    python scripts/bench_dataflow.py --prompts 256 --n 8 --response-length 1024 --json --out before.json
    PYTHONPATH=OTHER_TREE/src python scripts/bench_dataflow.py ...    # the same measurement of another checkout

This file owns the measurement only (it imports whichever tripod is on the path, so one copy of it measures a tree
before and after a change). It builds a random tiny Qwen2 (character tokenizer, arithmetic prompts) in a temporary
directory, spawns `--world` gloo ranks (every model TP1 x PP1, so DP = world; rollout TP1: one rollout replica per
rank), runs `--warmup` untimed PPO steps (GAE critic + reference for the KL in the reward: every model's pass runs)
and then `--steps` measured ones, with every torch.distributed collective wrapped:

- bytes received per rank and step, by collective and by the step's timed stage it ran in (the trainer's Timer
  sections). Logical bytes: all_gather (g-1) x input, broadcast the tensor on every rank but the source, all_reduce
  2(g-1)/g x tensor (ring), reduce_scatter (g-1) x output, recv the tensor. An object collective (all_gather_object,
  broadcast_object_list, ...) is counted through the tensor collectives it makes, under its own name: what it
  pickles is what it moves. "batch data" is everything outside the stages that move weights and gradients (reshard,
  update_actor, update_critic). Not counted: megatron's gradient / parameter bucket collectives on gloo, which
  tripod's in-place patch (parallel/megatron_patches/gloo_collectives.py) runs on the ProcessGroup object directly;
- seconds inside collectives, by stage;
- time outside model compute: the step's wall time minus its model stages (reshard, gen, old_log_prob, ref, values,
  update_critic, update_actor), which still contain their own collectives (listed separately);
- host bytes of the batch per rank: the tensors of the `PPOBatch` the actor update receives (every key the step
  added by then), counted once per storage.

Each measured step's per-rank records are written as soon as it ends (to OUT.raw.json with --out), so a run cut
short in teardown still has them: `--summarise OUT.raw.json` prints them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

MODEL_STAGES = ("reshard", "gen", "old_log_prob", "ref", "values", "update_critic", "update_actor")
WEIGHT_STAGES = ("reshard", "update_critic", "update_actor")  # their traffic is weights and gradients
# the torch.distributed functions counted; object collectives are counted through the tensor ones they call
TENSOR_OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
              "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
              "batch_isend_irecv", "gather", "scatter", "barrier")
OBJECT_OPS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (rollout.n)")
    p.add_argument("--response-length", type=int, default=256)
    p.add_argument("--world", type=int, default=4, help="gloo ranks (every model DP = world)")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps first")
    p.add_argument("--steps", type=int, default=1, help="measured steps")
    p.add_argument("--label", default="", help="a name for this tree in the output")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--out", default="", help="also write the JSON object here (and the per-rank records, written "
                   "after every measured step, to OUT.raw.json)")
    p.add_argument("--summarise", default="", metavar="RAW", help="only summarise an OUT.raw.json of an earlier run")
    args = p.parse_args(argv)
    if args.prompts % args.world or args.prompts < 4 * args.world:
        p.error(f"--prompts={args.prompts} must be a multiple of --world={args.world} and at least 4 per rank")
    return args


# ---- counting ----------------------------------------------------------------------------------------------------
class Traffic:
    """Wraps torch.distributed's collectives; `bytes[(stage, op)]`, `seconds[stage]` while `counting`."""

    def __init__(self):
        self.bytes: dict[tuple[str, str], float] = defaultdict(float)
        self.seconds: dict[str, float] = defaultdict(float)
        self.stages: list[str] = []
        self.counting = False
        self._outer: str | None = None  # the outermost wrapped call in flight (object collectives nest tensor ones)

    @property
    def stage(self) -> str:
        return self.stages[-1] if self.stages else "outside"

    @contextmanager
    def section(self, name: str):
        self.stages.append(name)
        try:
            yield
        finally:
            self.stages.pop()

    def install(self) -> None:
        """Wrap each collective where it is looked up: torch.distributed, its distributed_c10d (whose object
        collectives call the tensor ones through their module globals), and any megatron / tripod module that
        already holds a reference (megatron's DDP buffers keep theirs from import time)."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        wrapped = {}
        for name in TENSOR_OPS + OBJECT_OPS:
            fn = getattr(c10d, name, None) or getattr(dist, name, None)
            if fn is None:
                continue
            wrapped[id(fn)] = self._wrap(name, fn)
            for module in (dist, c10d):
                if getattr(module, name, None) is fn:
                    setattr(module, name, wrapped[id(fn)])
        for mod_name, module in list(sys.modules.items()):
            if module is None or not mod_name.startswith(("megatron", "tripod")):
                continue
            for attr, value in list(getattr(module, "__dict__", {}).items()):
                if callable(value) and id(value) in wrapped:
                    setattr(module, attr, wrapped[id(value)])

    def count(self, label: str, name: str, args, kwargs) -> None:
        try:
            self.bytes[(self.stage, label)] += _received(name, args, kwargs)
        except Exception:  # a call shape this counter does not know: say so instead of failing the rank
            self.bytes[(self.stage, f"uncounted:{name}")] += 0.0

    def _wrap(self, name: str, fn):
        def wrapped(*args, **kwargs):
            if self._outer is not None or not self.counting:
                if self._outer is not None and self.counting:
                    self.count(self._outer, name, args, kwargs)
                return fn(*args, **kwargs)
            self._outer = name
            start = time.perf_counter()
            try:
                self.count(name, name, args, kwargs)
                return fn(*args, **kwargs)
            finally:
                self.seconds[self.stage] += time.perf_counter() - start
                self._outer = None
        wrapped.__wrapped__ = fn
        return wrapped


def _arg(args, kwargs, i: int, key: str, default=None):
    return args[i] if len(args) > i else kwargs.get(key, default)


def _received(name: str, args, kwargs) -> float:
    """Logical bytes this rank receives in one call of torch.distributed.`name`."""
    import torch.distributed as dist

    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    if name in OBJECT_OPS or name == "barrier":
        return 0.0  # counted through the tensor collectives they make
    if name == "batch_isend_irecv":
        return float(sum(nbytes(op.tensor) for op in args[0] if "recv" in getattr(op.op, "__name__", "")))
    if name in ("recv", "irecv"):
        return float(nbytes(args[0]))
    if name in ("send", "isend"):
        return 0.0
    group = kwargs.get("group")
    if group is None:
        group = {"all_reduce": 2, "broadcast": 2, "all_gather": 2, "all_gather_into_tensor": 2, "reduce_scatter": 3,
                 "reduce_scatter_tensor": 3, "all_to_all": 2, "all_to_all_single": 4, "gather": 3,
                 "scatter": 3}.get(name, 99)
        group = args[group] if len(args) > group else None
    g = dist.get_world_size(group)
    if name == "all_reduce":
        return 2.0 * (g - 1) / g * nbytes(args[0])
    if name == "broadcast":
        src = _arg(args, kwargs, 1, "src")
        return 0.0 if src == dist.get_rank() else float(nbytes(args[0]))
    if name == "all_gather":
        return float((g - 1) * nbytes(args[1]))
    if name == "all_gather_into_tensor":
        return float((g - 1) * nbytes(args[1]))
    if name in ("reduce_scatter", "reduce_scatter_tensor"):
        return float((g - 1) * nbytes(args[0]))
    if name == "all_to_all":
        me = dist.get_rank(group)
        return float(sum(nbytes(t) for i, t in enumerate(args[0]) if i != me))
    if name == "all_to_all_single":
        out, splits = args[0], _arg(args, kwargs, 2, "output_split_sizes")
        row = nbytes(out) / max(out.shape[0], 1) if out.dim() else nbytes(out)
        own = splits[dist.get_rank(group)] * row if splits else nbytes(out) / g
        return float(nbytes(out) - own)
    if name == "gather":
        dst = _arg(args, kwargs, 2, "dst", 0)
        return float((g - 1) * nbytes(args[0])) if dst == dist.get_rank() else 0.0
    if name == "scatter":
        src = _arg(args, kwargs, 2, "src", 0)
        return 0.0 if src == dist.get_rank() else float(nbytes(args[0]))
    return 0.0


def batch_host_bytes(batch) -> int:
    """Bytes of a PPOBatch's tensors, each storage once (views of one tensor share it)."""
    seen, total = set(), 0
    for t in batch.tensors.values():
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# ---- the run ----------------------------------------------------------------------------------------------------
def make_setup(root: str, prompts: int) -> dict[str, str]:
    """A random tiny Qwen2 with a character tokenizer, and arithmetic train / val parquet files."""
    import torch
    import transformers

    from tripod.engine.data import make_arithmetic_rows, write_prompt_parquet
    from tripod.engine.data.char_tokenizer import char_tokenizer

    config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model_dir = os.path.join(root, "model")
    transformers.Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(model_dir, safe_serialization=True)
    char_tokenizer().save_pretrained(model_dir)
    paths = {"model": model_dir}
    for split, count, seed in (("train", 2 * prompts, 0), ("val", 8, 1)):
        rows = make_arithmetic_rows(count, seed=seed, max_digits=2, instruction="Answer as #### N.", split=split)
        paths[split] = os.path.join(root, f"{split}.parquet")
        write_prompt_parquet(rows, paths[split])
    return paths


def overrides(args: argparse.Namespace, setup: dict[str, str], run_dir: str) -> list[str]:
    mini = max(args.prompts // 4, args.world)  # 4 mini-batches per step
    micro = max(mini * args.n // args.world // 2, 1)  # 2 micro-batches per DP rank and mini-batch
    return [
        f"data.train_files={setup['train']}", f"data.val_files={setup['val']}", "data.shuffle=false",
        "data.max_prompt_length=64", f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.model.path={setup['model']}",
        f"critic.model.path={setup['model']}",
        f"actor_rollout_ref.rollout.n={args.n}", "actor_rollout_ref.rollout.temperature=1.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}", f"critic.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}", f"critic.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={2 * micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={2 * micro}",
        "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k3",
        "actor_rollout_ref.actor.optim.lr=1e-4", "critic.optim.lr=1e-4",
        f"trainer.total_training_steps={args.warmup + args.steps}", f"trainer.n_gpus_per_node={args.world}",
        f"trainer.default_local_dir={run_dir}", "trainer.logger=[jsonl]", "trainer.resume=disable",
        "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.test_freq=0",
    ]


def bench_on_rank(config_yaml: str, args_json: str, out_path: str) -> None:
    import torch.distributed as dist

    traffic = Traffic()
    traffic.install()  # before the trainer's modules are imported: every collective of the run goes through it
    from omegaconf import OmegaConf

    from tripod.engine.config import TripodConfig
    from tripod.engine.trainer import PPOTrainer

    args = argparse.Namespace(**json.loads(args_json))
    began = time.perf_counter()
    say = (lambda msg: print(f"[bench {time.perf_counter() - began:6.1f} s] {msg}", flush=True)) \
        if dist.get_rank() == 0 else (lambda msg: None)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TripodConfig), OmegaConf.create(config_yaml)))
    trainer = PPOTrainer(cfg)
    ranges = trainer.profiler.range

    @contextmanager
    def tagged(name: str):
        with traffic.section(name), ranges(name):
            yield

    trainer.profiler.range = tagged
    seen: dict[str, int] = {}
    update = trainer.actor.update

    def counted_update(batch, *a, **k):
        seen["batch_host_bytes"] = batch_host_bytes(batch)
        seen["batch_rows"] = batch.size
        return update(batch, *a, **k)

    trainer.actor.update = counted_update
    say("trainer built")
    for k in range(args.warmup):
        trainer.train_step(next(iter(trainer.loader)))
        trainer.step += 1
        say(f"warm-up step {k + 1} done")
    steps = []
    for _ in range(args.steps):
        traffic.bytes.clear()
        traffic.seconds.clear()
        traffic.counting = True
        start = time.perf_counter()
        metrics = trainer.train_step(next(iter(trainer.loader)))
        wall = time.perf_counter() - start
        traffic.counting = False
        trainer.step += 1
        timings = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("timing_s/")}
        steps.append(dict(wall_s=wall, timings=timings,
                          bytes={f"{s}|{op}": b for (s, op), b in traffic.bytes.items()},
                          comm_s=dict(traffic.seconds), **seen,
                          response_length_mean=metrics.get("response_length/mean", 0.0)))
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, steps)  # after each measured step, not counted: a cut-short run keeps it
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(everyone, f)
        say(f"measured step {len(steps)} done ({wall:.1f} s)")
    if trainer.rewards is not None:
        trainer.rewards.close()


def summarise(args: argparse.Namespace, per_rank: list[list[dict]]) -> dict:
    """Per measured step: bytes received per rank (max, mean; by collective and by stage), comm seconds, time outside
    model compute, batch host bytes per rank."""
    out_steps = []
    for i in range(min(len(r) for r in per_rank)):  # a cut-short run: the steps every rank finished
        ranks = [r[i] for r in per_rank]
        totals = [sum(s["bytes"].values()) for s in ranks]
        # the batch's own traffic: everything but the model stages that move weights and gradients
        data = [sum(b for k, b in s["bytes"].items() if k.split("|")[0] not in WEIGHT_STAGES) for s in ranks]
        pickled = [sum(b for k, b in s["bytes"].items() if k.split("|")[1] in OBJECT_OPS) for s in ranks]
        by_op: dict[str, float] = defaultdict(float)
        by_stage: dict[str, float] = defaultdict(float)
        for s in ranks:
            for key, b in s["bytes"].items():
                stage, op = key.split("|")
                by_op[op] += b / len(ranks)
                by_stage[stage] += b / len(ranks)
        walls = [s["timings"].get("step", s["wall_s"]) for s in ranks]
        outside = [s["timings"].get("step", s["wall_s"]) - sum(s["timings"].get(k, 0.0) for k in MODEL_STAGES)
                   for s in ranks]
        comm: dict[str, float] = defaultdict(float)
        for s in ranks:
            for stage, sec in s["comm_s"].items():
                comm[stage] += sec / len(ranks)
        out_steps.append(dict(
            bytes_received_per_rank_max=max(totals), bytes_received_per_rank_mean=sum(totals) / len(totals),
            batch_data_bytes_per_rank_max=max(data), pickled_bytes_per_rank_max=max(pickled),
            bytes_by_collective_mean=dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
            bytes_by_stage_mean=dict(sorted(by_stage.items(), key=lambda kv: -kv[1])),
            comm_seconds_by_stage_mean=dict(sorted(comm.items(), key=lambda kv: -kv[1])),
            step_s_max=max(walls), outside_model_s_max=max(outside),
            timings_rank0=ranks[0]["timings"],
            batch_host_bytes_per_rank_max=max(s.get("batch_host_bytes", 0) for s in ranks),
            batch_rows_per_rank=[s.get("batch_rows", 0) for s in ranks],
            response_length_mean=ranks[0]["response_length_mean"]))
    import tripod
    measured = f"the run of {args.summarise}" if args.summarise else os.path.dirname(tripod.__file__)
    return dict(label=args.label, tripod=measured, world=args.world, prompts=args.prompts,
                n=args.n, response_length=args.response_length, rows=args.prompts * args.n,
                load_average=os.getloadavg() if not args.summarise else "at the run", steps=out_steps)


def print_tables(result: dict) -> None:
    mb = 1 << 20
    print(f"{result['label'] or 'tree'}: {result['tripod']}  {result['world']} gloo ranks, {result['prompts']} prompts x "
          f"{result['n']} samples x {result['response_length']} tokens ({result['rows']} rows); load {result['load_average']}")
    for i, s in enumerate(result["steps"]):
        print(f"step {i}: received per rank max {s['bytes_received_per_rank_max'] / mb:.3f} MiB (batch data "
              f"{s['batch_data_bytes_per_rank_max'] / mb:.3f} MiB outside {'/'.join(WEIGHT_STAGES)}; pickled "
              f"{s['pickled_bytes_per_rank_max'] / mb:.3f} MiB); batch on host per rank "
              f"{s['batch_host_bytes_per_rank_max'] / mb:.2f} MiB ({s['batch_rows_per_rank']} rows); step "
              f"{s['step_s_max']:.2f} s, outside model stages {s['outside_model_s_max']:.2f} s; mean response "
              f"{s['response_length_mean']:.0f} tokens")
        print("  by collective (MiB/rank): " + ", ".join(f"{k} {v / mb:.3f}" for k, v in s["bytes_by_collective_mean"].items()))
        print("  by stage (MiB/rank):      " + ", ".join(f"{k} {v / mb:.3f}" for k, v in s["bytes_by_stage_mean"].items()))
        print("  in collectives (s/rank):  " + ", ".join(f"{k} {v:.2f}" for k, v in s["comm_seconds_by_stage_mean"].items()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarise:
        with open(args.summarise) as f:
            return _emit(args, summarise(args, json.load(f)))
    from tripod.engine.config import config_to_yaml
    from tripod.engine.launch import detect_launch, run_distributed
    from tripod.engine.preflight import prepare_train

    recipe = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "recipes", "defaults.yaml")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="tripod-bench-dataflow-") as root:
        setup = make_setup(root, args.prompts)
        cfg, world = prepare_train(recipe, overrides(args, setup, os.path.join(root, "run")), detect_launch())
        out_path = f"{args.out}.raw.json" if args.out else os.path.join(root, "per_rank.json")
        run_distributed(world, bench_on_rank, config_to_yaml(cfg), json.dumps(vars(args)), out_path)
        with open(out_path) as f:
            result = summarise(args, json.load(f))
    return _emit(args, result)


def _emit(args: argparse.Namespace, result: dict) -> int:
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
    else:
        print_tables(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
