"""A/B of generation on one fixed prompt batch, interleaved in one process: tripod's embedded rollout engine (with
the decode steps on all threads or on `--decode_threads`) against transformers' `generate` on the same model.

Prompts: the first `--prompts` of the data set with the chat template, `--n` samples each, `--max_new_tokens`,
sampling at temperature 1 (stop tokens disabled so every variant decodes the same number of tokens).

    flock /tmp/tripod-heavy.lock python scripts/bench_generate.py outputs/models/smollm2-135m-instruct --repeats 3
"""
from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--data", default="outputs/data/arithmetic/train.parquet")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--decode_threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tripod.engine.data import PromptDataset
    from tripod.engine.rollout import SamplingParams, make_rollout_engine
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import family_of, hf_to_megatron

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    prompts = PromptDataset(args.data, tokenizer=tok, prompt_key="prompt", max_prompt_length=1024).batch(
        list(range(args.prompts))).input_ids
    arch = arch_from_hf(args.model_dir)
    state = load_file(os.path.join(args.model_dir, "model.safetensors"))
    family = family_of(arch)
    shard = {k: family.shard(arch, k, t, 1, 0) for k, t in hf_to_megatron(arch, state).items()}
    engine = make_rollout_engine("embedded", arch, None)
    engine.load_weights(shard)
    hf = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.n, seed=1,
                            ignore_eos=True)

    def tripod(decode_threads: int):
        def run():
            engine.decode_threads = decode_threads
            return engine.generate(prompts, params)
        return run

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    @torch.no_grad()
    def hf_generate():
        return hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                           num_return_sequences=args.n, pad_token_id=pad)

    runs = {"tripod": tripod(0), f"tripod-decode{args.decode_threads}t": tripod(args.decode_threads),
            "hf-generate": hf_generate}
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(args.repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            print(f"repeat {rep} {name}: {times[name][-1]:.2f} s", flush=True)
    for name, ts in times.items():
        ts = sorted(ts)
        print(f"RESULT {name}: median {ts[len(ts) // 2]:.2f} s  min {ts[0]:.2f}  max {ts[-1]:.2f}", flush=True)


if __name__ == "__main__":
    main()
