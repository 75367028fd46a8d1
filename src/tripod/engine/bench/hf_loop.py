"""The cheap peer of `tripod bench`: GRPO as a plain transformers loop that materialises full logits.

`python -m tripod.engine.bench.hf_loop SPEC.json RAW.json` (spec from tripod.engine.bench.baselines.work_spec). Per step:
`model.generate` (left-padded prompts, n samples each, sampling as the recipe) -> rule rewards -> group-normalised
advantages -> one on-policy PPO-clip update (ratio exp(logp - logp.detach()), token-mean) from the full
[B, S, vocab] log-softmax -> clip grad norm -> AdamW. Peak RSS (VmHWM) at the end.
"""
from __future__ import annotations

import json
import sys
import time

import torch


def main(spec_path: str, raw_path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tripod.engine.rewards import get_reward_fn
    from tripod.runtime.memory import GiB, peak_rss_bytes

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    model.train()
    o, n = spec["optim"], spec["n"]
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                            weight_decay=o["weight_decay"])
    records = []
    for i, rows in enumerate(spec["prompts"]):
        t_step = time.perf_counter()
        texts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in rows]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=spec["temperature"], top_p=spec["top_p"], top_k=0,
                                 max_new_tokens=spec["max_new_tokens"], num_return_sequences=n, pad_token_id=pad)
        gen_s = time.perf_counter() - t0
        plen = enc["input_ids"].shape[1]
        resp = out[:, plen:]
        is_eos = resp == tok.eos_token_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((resp.shape[0],), resp.shape[1]))
        resp_mask = (torch.arange(resp.shape[1])[None] <= first[:, None]).float()  # up to and including EOS
        t0 = time.perf_counter()
        decoded = tok.batch_decode([r[: int(m.sum())] for r, m in zip(resp, resp_mask)], skip_special_tokens=True)
        rep = [r for r in rows for _ in range(n)]
        scores = torch.tensor([get_reward_fn(r["data_source"])(t, r["ground_truth"], r["extra_info"])
                               for t, r in zip(decoded, rep)], dtype=torch.float32).view(-1, n)
        adv = scores - scores.mean(1, keepdim=True)
        if spec["norm_adv_by_std"]:
            adv = adv / (scores.std(1, keepdim=True) + 1e-6)
        adv = adv.reshape(-1, 1)
        reward_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        attn = torch.cat([enc["attention_mask"].repeat_interleave(n, 0), resp_mask.long()], 1)
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        for _ in range(spec["epochs"]):
            logits = model(input_ids=out, attention_mask=attn, position_ids=pos).logits[:, plen - 1:-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, resp[..., None]).squeeze(-1)
            ratio = torch.exp(logp - logp.detach())
            eps = spec["clip_ratio"]
            loss_tok = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
            loss = (loss_tok * resp_mask).sum() / resp_mask.sum().clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
            opt.step()
        update_s = time.perf_counter() - t0
        step_s = time.perf_counter() - t_step
        records.append({"index": i, "warmup": i < spec["warmup"], "wall_s": step_s, "step_s": step_s,
                        "stages_s": {"gen": gen_s, "reward": reward_s, "update_actor": update_s},
                        "prompts": len(rows), "samples": len(rows) * n,
                        "prompt_tokens": int(enc["attention_mask"].sum()) * n, "response_tokens": int(resp_mask.sum())})
        print(f"hf bench: step {i + 1}/{len(spec['prompts'])} {step_s:.2f} s  gen={gen_s:.2f} "
              f"update_actor={update_s:.2f}", flush=True)
        raw = {"records": records, "world_size": 1, "ranks": [{"rank": 0, "peak_memory_gb": peak_rss_bytes() / GiB, "threads": torch.get_num_threads(), "peak_flops": None}]}
        with open(raw_path, "w") as f:  # after every step: a run cut short still leaves its measured steps
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
