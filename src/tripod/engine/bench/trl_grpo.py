"""The TRL peer of `tripod bench`: TRL's `GRPOTrainer` on the spec `tripod.engine.bench.baselines` writes, run by the
python of the separate TRL virtualenv (`python engine/bench/trl_grpo.py SPEC.json RAW.json`).

It imports no tripod code except the reward rule (`tripod.engine.rewards`, pure python) and the memory reader
(`tripod.runtime.memory`), so it measures TRL itself.
Per step it records the wall time of the optimizer step (callback on_step_begin -> on_step_end), the time spent
in TRL's `_generate` ("gen"), `_calculate_rewards` ("reward"), the rest of `_prepare_inputs` (old log-probs when
TRL needs them, advantages: "adv"), the forward+backward of the loss ("update_actor"; optimizer step in "other"),
the prompt tokens (tripod's tokenization of the same prompts), the tokens of TRL's real completions (the
`completion_ids` TRL hands to the reward), the mean reward and the share of samples with a non-zero GRPO advantage
(reward unlike its group's mean), and at the end the process' peak RSS (VmHWM).
"""
from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, raw_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import torch  # tripod itself comes from PYTHONPATH (src/): not installed in the TRL venv, the reward rule only

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tripod.engine.rewards import get_reward_fn
    from tripod.runtime.memory import GiB, peak_rss_bytes

    rows = [p for step in spec["prompts"] for p in step]
    data = Dataset.from_list([{"prompt": r["messages"], "ground_truth": r["ground_truth"],
                               "data_source": r["data_source"], "extra": json.dumps(r["extra_info"])} for r in rows])

    generated: dict[str, float] = {}  # of the step's completions, read where TRL hands them to the reward

    def reward(completions, ground_truth, data_source, extra, completion_ids=None, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [float(get_reward_fn(s)(t, g, json.loads(e))) for t, g, s, e in zip(texts, ground_truth,
                                                                                      data_source, extra)]
        groups = [scores[i:i + n] for i in range(0, len(scores), n)]  # TRL repeats each prompt n times in a row
        generated.update(samples=len(scores), score_mean=sum(scores) / len(scores),
                         nonzero_adv_frac=sum(s != sum(g) / len(g) for g in groups for s in g) / len(scores))
        if completion_ids is not None:  # TRL's own token ids of each completion (EOS included, padding not)
            generated["response_tokens"] = sum(len(ids) for ids in completion_ids)
        return scores

    stage: dict[str, float] = {}

    class Timed(GRPOTrainer):
        def _timed(self, key, fn, *a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                stage[key] = stage.get(key, 0.0) + time.perf_counter() - t0

        def _generate(self, *a, **k):
            return self._timed("gen", super()._generate, *a, **k)

        def _calculate_rewards(self, *a, **k):
            return self._timed("reward", super()._calculate_rewards, *a, **k)

        def _prepare_inputs(self, *a, **k):
            return self._timed("prepare", super()._prepare_inputs, *a, **k)

        def training_step(self, *a, **k):
            return self._timed("training_step", super().training_step, *a, **k)

    records: list[dict] = []
    n, prompts_per_step = spec["n"], spec["prompts_per_step"]
    minis = spec.get("mini_batches", 1)  # optimizer steps per generation batch: one record per generation batch

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step % minis:
                return
            stage.clear()
            generated.clear()
            self.tokens0, self.t0 = state.num_input_tokens_seen, time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % minis:  # global_step counts the optimizer step just taken
                return
            wall = time.perf_counter() - self.t0
            total = int(state.num_input_tokens_seen - self.tokens0)
            i = len(records)
            prompt_tokens = n * sum(spec["prompt_token_counts"][i])  # tripod's tokenization of the same prompts
            response_tokens = int(generated.get("response_tokens", total - prompt_tokens))
            gen, rew, prep = stage.get("gen", 0.0), stage.get("reward", 0.0), stage.get("prepare", 0.0)
            stages = {"gen": gen, "reward": rew, "adv": max(prep - gen - rew, 0.0),
                      "update_actor": max(stage.get("training_step", 0.0) - prep, 0.0)}
            records.append({"index": i, "warmup": i < spec["warmup"], "wall_s": wall, "step_s": wall,
                            "stages_s": stages, "prompts": prompts_per_step,
                            "samples": int(generated.get("samples", prompts_per_step * n)),
                            "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
                            "score_mean": generated.get("score_mean"),
                            "nonzero_adv_frac": generated.get("nonzero_adv_frac")})
            print(f"trl bench: step {i + 1}/{len(spec['prompts'])} {wall:.2f} s  "
                  + "  ".join(f"{k}={v:.2f}" for k, v in stages.items()), flush=True)
            write_raw()  # after every step: a run cut short still leaves its measured steps

    def write_raw() -> None:
        raw = {"records": records, "world_size": 1, "ranks": [{"rank": 0, "peak_memory_gb": peak_rss_bytes() / GiB,
                                                               "threads": torch.get_num_threads(),
                                                               "peak_flops": None}],
               "versions": {"trl": __import__("trl").__version__,
                            "transformers": __import__("transformers").__version__, "torch": torch.__version__}}
        with open(raw_path, "w") as f:
            json.dump(raw, f, indent=1)

    steps = len(spec["prompts"])
    o = spec["optim"]
    args = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(raw_path), "trl_out"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=prompts_per_step * n // minis, gradient_accumulation_steps=1,
        steps_per_generation=minis, num_generations=n,
        max_completion_length=spec["max_new_tokens"], num_iterations=spec["epochs"], learning_rate=o["lr"],
        weight_decay=o["weight_decay"], adam_beta1=o["betas"][0], adam_beta2=o["betas"][1], adam_epsilon=o["eps"],
        max_grad_norm=o["grad_clip"], lr_scheduler_type="constant", warmup_steps=0, beta=0.0,
        epsilon=spec["clip_ratio"], temperature=spec["temperature"], top_p=spec["top_p"], top_k=0,
        scale_rewards="group" if spec["norm_adv_by_std"] else "none", loss_type="dapo", max_steps=steps * minis,
        # no log dicts or progress bars between the bench's lines (the records above are what is measured)
        shuffle_dataset=False, seed=spec["seed"], logging_strategy="no", disable_tqdm=True, report_to="none",
        save_strategy="no",
        disable_dropout=True, log_completions=False, dataloader_num_workers=0)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    trainer = Timed(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer,
                    callbacks=[StepTimer()])
    trainer.train()
    write_raw()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
