"""torchrun worker (2 ranks): the distillation teacher's scores do not depend on its layout.

argv: teacher_hf_dir student_hf_dir. One random PPO batch (the same on both ranks). The teacher (a bigger model
than the student) at TP1 x DP2 and at TP2 x DP1 computes the log-probs of the sampled tokens (`compute_log_probs`,
the estimator modes) and its top-k at every response position (`compute_topk`, chunked over its vocab shards);
both are compared with the teacher's Hugging Face forward in float64. The student (TP1 x DP2) then takes
forward_kl_topk's per-token terms against each teacher's top-k from its own forward: they must agree too.
Prints `TEACHER <layout> <quantity> <max diff>` lines.

`PLANT=local_ids` (tests/multiprocess/test_distillation.py's planted bug): the top-k ids are left in each TP rank's
local vocab coordinates (no shard offset), which only a TP2 teacher gets wrong.
"""
import os
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker

TOL = 2e-5  # fp32 forwards of a 2-layer model vs float64: log-probs ~ log(vocab) ~ 5, relative error ~1e-6
K = 6


def hf_scores(hf_dir, batch, temperature):
    """(log-probs of the sampled tokens [N, R], top-k log-probs [N, R, K], ids) from HF's float64 forward."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float64).eval()
    n, r = batch["responses"].shape
    logp, topv, topi = torch.zeros(n, r, dtype=torch.float64), torch.zeros(n, r, K, dtype=torch.float64), \
        torch.zeros(n, r, K, dtype=torch.long)
    with torch.no_grad():
        for i in range(n):
            ids = batch["input_ids"][i][batch["attention_mask"][i] > 0][None]
            p = int(batch["prompt_lens"][i])
            lp = torch.log_softmax(model(ids).logits[0].double() / temperature, dim=-1)
            count = int(batch["response_mask"][i].sum())
            rows = lp[p - 1:p - 1 + count]
            logp[i, :count] = rows.gather(1, batch["responses"][i, :count, None])[:, 0]
            topv[i, :count], topi[i, :count] = rows.topk(K, dim=-1)
    return logp, topv, topi


def main():
    from tripod.engine.algorithms import topk_logprobs
    from tripod.engine.data.tiny_ppo import random_ppo_batch
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.engine.workers.teacher import TeacherWorker, student_topk_terms
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout

    if os.environ.get("PLANT") == "local_ids":
        topk_logprobs._slice = lambda weight, vocab_size, tp_group: (0, min(weight.shape[0], vocab_size))
    teacher_dir, student_dir = sys.argv[1], sys.argv[2]
    arch, student_arch = arch_from_hf(teacher_dir), arch_from_hf(student_dir)
    batch, _, _, _ = random_ppo_batch(arch.vocab_size, n=6, resp_len=5, seed=3)
    temperature = 0.9
    want_logp, want_topv, want_topi = hf_scores(teacher_dir, batch, temperature)
    mask = batch["response_mask"] > 0
    student = PolicyWorker("actor", student_arch, ParallelLayout(name="student", arch=student_arch, ranks=[0, 1],
                                                                 dp=2), student_dir, trainable=False)
    per_layout = {}
    for name, kw in (("TP1", dict(dp=2)), ("TP2", dict(tp=2))):
        layout = ParallelLayout(name=f"teacher_{name}", arch=arch, ranks=[0, 1], **kw)
        teacher = TeacherWorker("teacher", arch, layout, teacher_dir, trainable=False)
        logp, _ = teacher.compute_log_probs(batch, 3, temperature)
        topv, topi = teacher.compute_topk(batch, 3, temperature, K)
        diffs = {"logp": float((logp.double() - want_logp)[mask].abs().max()),
                 "topk_logp": float((topv.double() - want_topv)[mask].abs().max()),
                 "topk_ids": float((topi != want_topi)[mask].any(-1).sum())}
        # the student's side at TP1 against this teacher's top-k (forward only)
        scored = batch.select(list(range(batch.size)))
        scored["teacher_topk_log_probs"], scored["teacher_topk_ids"] = topv, topi
        mine = scored.select(student.dp_rows(batch.size))

        def loss_fn(output, mb):
            terms = student_topk_terms(student, output, mb, temperature, type("C", (), {"log_prob_min_clamp": None}))
            return output.sum() * 0.0, {"kl": terms.loss.detach()}

        outs = student.run([mine], loss_fn, forward_only=True)
        per_layout[name] = student.gather_rows(outs[0]["kl"] if outs else None, (batch["responses"].shape[1],),
                                               batch.size)
        for key, value in diffs.items():
            print(f"TEACHER {name} {key} {value:.3g}", flush=True)
            assert value <= (0 if key == "topk_ids" else TOL), f"teacher at {name}: {key} differs by {value:.3g}"
        del teacher
    student_diff = float((per_layout["TP1"] - per_layout["TP2"])[mask].abs().max())
    print(f"TEACHER student_kl TP1-vs-TP2 {student_diff:.3g}", flush=True)
    assert student_diff <= TOL, f"the student's top-k KL differs by {student_diff:.3g} between teacher layouts"
    dist.barrier()


if __name__ == "__main__":
    dist_worker(main)
