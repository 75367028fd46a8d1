"""Lockstep vs per-row agent loop (engine/agent/scheduler.py) on the embedded engine, same seeds, interleaved.

GRPO rollouts (`--prompts` prompts x `--n` samples) of a tiny random Qwen2 on a character tokenizer: every model turn
ends at one of a ninth of the vocabulary (short turns), and each turn gets an environment reply after a latency
drawn per (row, turn) from U[--min_s, --max_s] (seeded: both loops see the same latencies), `--turns` replies per
row. A random model writes no tool calls, so the environment is an interaction (a user simulator, engine/agent/
interactions.py) that waits like a remote tool would; the loop treats both alike. Reported per loop: trajectories/s,
the engine's idle share of the wall time (1 - generate_s / wall_s), and whether both loops produced the same tokens.

    flock /tmp/tripod-heavy.lock python scripts/bench_agent.py --repeats 2
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time

import torch

TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class Latency:
    """An environment that replies "go on" after a seeded latency per (row, turn), `turns` times per row."""

    def __init__(self, seed: int, low: float, high: float, turns: int) -> None:
        self.seed, self.low, self.high, self.turns = seed, low, high, turns
        self.seen: dict[str, int] = {}

    async def start(self, key, kwargs):
        self.seen[key] = 0

    async def respond(self, key, messages):
        row = int(key.split("-")[1])
        await asyncio.sleep(random.Random(self.seed * 7919 + row * 131 + self.seen[key]).uniform(self.low, self.high))
        self.seen[key] += 1
        return self.seen[key] > self.turns, "go on", 0.0, {}

    async def finish(self, key):
        return 0.0


def build(hidden: int, layers: int):
    from safetensors.torch import load_file
    from tokenizers import decoders

    from tripod.engine.data.char_tokenizer import char_tokenizer
    from tripod.engine.data.tiny_models import make_tiny_hf_model
    from tripod.engine.rollout import make_rollout_engine
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import family_of, hf_to_megatron

    tok = char_tokenizer()
    tok.backend_tokenizer.decoder = decoders.Fuse()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token, tok.chat_template = "<|im_end|>", TEMPLATE
    hf_dir = make_tiny_hf_model(tempfile.mkdtemp(), "qwen2", seed=1, vocab_size=len(tok), hidden_size=hidden,
                                intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=8,
                                num_key_value_heads=4, eos_token_id=tok.eos_token_id)
    arch = arch_from_hf(hf_dir)
    canon = hf_to_megatron(arch, load_file(os.path.join(hf_dir, "model.safetensors")))
    engine = make_rollout_engine("embedded", arch, None, pad_token_id=0)
    engine.load_weights({n: family_of(arch).shard(arch, n, t, 1, 0) for n, t in canon.items()})
    return tok, engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--min_s", type=float, default=0.1)
    ap.add_argument("--max_s", type=float, default=2.0)
    ap.add_argument("--response_length", type=int, default=400)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tripod.engine.agent.chat_suffix import ChatSuffix
    from tripod.engine.agent.loop import AgentLoop
    from tripod.engine.rollout.base import SamplingParams

    tok, engine = build(args.hidden, args.layers)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"task {i}"}],
                                                  add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.response_length, temperature=1.0, seed=3,
                            stop_token_ids=tuple(range(3, len(tok), 9)))
    results: dict[str, list] = {"lockstep": [], "per_row": []}
    tokens: dict[str, list] = {}
    for repeat in range(args.repeats):
        for mode in ("lockstep", "per_row"):
            loop = AgentLoop(tok, args.response_length, ChatSuffix(tok), None,
                             Latency(repeat, args.min_s, args.max_s, args.turns), scheduling=mode)
            start = time.perf_counter()
            rows, s = loop.run(engine, prompts, args.n, params, [{"interaction_kwargs": {"name": "x"}}] * len(prompts))
            wall = time.perf_counter() - start
            results[mode].append((len(rows) / wall, 1 - s["generate_s"] / s["wall_s"], wall,
                                  sum(len(r.turns) for r in rows) / len(rows)))
            tokens[mode] = [r.response for r in rows]
    print(f"load average {os.getloadavg()[0]:.2f}; {args.prompts} prompts x {args.n} samples, {args.turns} replies "
          f"per row, latency U[{args.min_s}, {args.max_s}] s, Qwen2 hidden {args.hidden} x {args.layers} layers, "
          f"{args.threads} thread(s)")
    print("| loop | trajectories/s | engine idle share | wall s | turns per row |\n|---|---|---|---|---|")
    for mode, runs in results.items():
        best = max(runs)
        print(f"| {mode} | {best[0]:.2f} | {best[1]:.0%} | {best[2]:.1f} | {best[3]:.1f} |")
    speedup = max(r[0] for r in results["per_row"]) / max(r[0] for r in results["lockstep"])
    print(f"per_row / lockstep trajectories/s: {speedup:.2f}x; same tokens: {tokens['per_row'] == tokens['lockstep']}")


if __name__ == "__main__":
    main()
