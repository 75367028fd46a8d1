"""On-policy distillation's math (issue 48) against references nobody here wrote: verl 0.9.1's own functions
(kl_penalty, agg_loss, compute_policy_loss_vanilla, the FSDP forward_kl_topk) and full-vocabulary float64 softmax.

* the chunked top-k ops (engine/algorithms/topk_logprobs.py) equal a full log_softmax, values and gradients;
* forward_kl_topk with k = vocab on a tiny model equals the full-vocabulary KL(teacher || student), and its gradient;
* teacher = student gives zero loss and zero gradient in every mode (top-k: with k = vocab; a truncated top-k
  KL has a non-zero gradient at teacher = student, as verl's);
* every loss_mode x use_policy_gradient x use_task_rewards x clamps equals verl's distillation_loss /
  distillation_ppo_loss composed from verl's functions, in float64.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.verl_reference import verl_core_algos
from tripod.engine.algorithms import distillation as D
from tripod.engine.algorithms import topk_logprobs as T
from tripod.engine.config.distillation import ESTIMATOR_MODES, DistillationLossConfig

verl_core, _ = verl_core_algos()


def _verl_fsdp_topk():
    """verl's FSDP compute_forward_kl_topk, read from its file (verl.trainer's package import pulls in `datasets`,
    which this environment does not install; the file itself needs torch and verl's config only)."""
    import importlib.util
    import os

    import verl

    path = os.path.join(os.path.dirname(verl.__file__), "trainer", "distillation", "fsdp", "losses.py")
    spec = importlib.util.spec_from_file_location("verl_fsdp_distillation_losses", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_forward_kl_topk


def _head(seed: int, tokens: int = 13, hidden: int = 8, vocab: int = 19, padded: int = 24):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(padded, hidden, generator=g, dtype=torch.float64)
    return h, w, vocab


def _full_logp(h, w, vocab, temperature):
    return torch.log_softmax((h @ w[:vocab].t()) / temperature, dim=-1)


def test_topk_ops_match_full_softmax():
    h, w, v = _head(1)
    ref = _full_logp(h, w, v, 0.7)
    logp, ids = T.topk_from_hidden(h, w, 5, temperature=0.7, vocab_size=v, chunk_tokens=4, chunk_vocab=6)
    want_logp, want_ids = ref.topk(5, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-12)

    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    pick = torch.randint(0, v, (h.shape[0], 4), generator=torch.Generator().manual_seed(2))
    got = T.logprobs_at_ids(hh, ww, pick, temperature=0.7, vocab_size=v, chunk_tokens=4, chunk_vocab=6)
    up = torch.randn(got.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (got * up).sum().backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = _full_logp(hr, wr, v, 0.7).gather(1, pick)
    (want * up).sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(hh.grad, hr.grad, rtol=0, atol=1e-11)
    torch.testing.assert_close(ww.grad, wr.grad, rtol=0, atol=1e-11)


def _topk_kl(h_s, w_s, h_t, w_t, v, k, temperature=1.0, clamp=None):
    """Per-token forward_kl_topk through the ops the trainer runs (teacher top-k, student at the teacher's ids)."""
    t_logp, t_ids = T.topk_from_hidden(h_t, w_t, k, temperature=temperature, vocab_size=v, chunk_vocab=7)
    s_at = T.logprobs_at_ids(h_s, w_s, t_ids, temperature=temperature, vocab_size=v, chunk_vocab=7)
    _, s_ids = T.topk_from_hidden(h_s.detach(), w_s.detach(), k, temperature=temperature, vocab_size=v)
    return D.forward_kl_topk(s_at[None], t_logp[None], t_ids[None], clamp, s_ids[None])


def test_topk_forward_kl_with_k_vocab_is_the_full_kl():
    """A tiny model: student and teacher LM heads over their own hidden states; k = vocab."""
    h_s, w_s, v = _head(4)
    h_t, w_t, _ = _head(5)
    hs, ws = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
    terms = _topk_kl(hs, ws, h_t, w_t, v, v, temperature=1.3)
    terms.loss.sum().backward()
    hr, wr = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
    q, p = _full_logp(h_t, w_t, v, 1.3), _full_logp(hr, wr, v, 1.3)
    full = (q.exp() * (q - p)).sum(-1)
    full.sum().backward()
    torch.testing.assert_close(terms.loss[0], full, rtol=0, atol=1e-12)
    torch.testing.assert_close(hs.grad, hr.grad, rtol=0, atol=1e-11)
    torch.testing.assert_close(ws.grad, wr.grad, rtol=0, atol=1e-11)
    torch.testing.assert_close(terms.teacher_mass[0], torch.ones(h_s.shape[0], dtype=torch.float64))
    assert torch.equal(terms.overlap_count[0], torch.full((h_s.shape[0],), v))


# k1 / kl without the policy gradient are refused by the config (verl too): their gradient ignores the teacher
@pytest.mark.parametrize("mode,policy_gradient", [(m, pg) for m in ESTIMATOR_MODES + ("forward_kl_topk",)
                                                  for pg in (False, True) if pg or m not in ("k1", "kl")])
def test_teacher_equals_student_gives_zero_loss_and_gradient(mode, policy_gradient):
    h, w, v = _head(6)
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    labels = torch.randint(0, v, (1, h.shape[0]), generator=torch.Generator().manual_seed(7))
    student = T.logprobs_at_ids(hs, ws, labels.t(), temperature=0.8, vocab_size=v).t()  # [1, T]
    teacher = T.logprobs_at_ids(h, w, labels.t(), temperature=0.8, vocab_size=v).t()
    terms = _topk_kl(hs, ws, h, w, v, v, temperature=0.8) if mode == "forward_kl_topk" else None
    mask = torch.ones_like(student)
    losses = D.per_token_loss(mode, student, teacher, terms)
    cfg = DistillationLossConfig(loss_mode=mode, use_policy_gradient=policy_gradient, use_task_rewards=False)
    loss, _ = D.distillation_loss(losses, mask, cfg, "token-mean", None, student, student.detach())
    total = D.combine(torch.zeros(()), loss, cfg)
    total.backward()
    assert float(losses.detach().abs().max()) < 1e-12 and abs(float(total.detach())) < 1e-12
    assert float(hs.grad.abs().max()) < 1e-12 and float(ws.grad.abs().max()) < 1e-12


# ---- every mode against verl's formula (verl/trainer/distillation/losses.py), float64 ----------------------
class _VerlCfg(dict):
    """What verl's policy loss reads of its `config` (attribute and .get access)."""
    __getattr__ = dict.__getitem__


def _verl_distillation(mode, loss_cfg, student, teacher, old, mask, agg, s_at=None, t_topk=None, t_ids=None,
                       s_logits=None, task_loss=None):
    """verl's distillation_loss and distillation_ppo_loss's combination, from verl's own functions."""
    if mode == "forward_kl_topk":
        compute_forward_kl_topk = _verl_fsdp_topk()
        nested = lambda x: torch.nested.nested_tensor([x[0]], layout=torch.jagged)  # noqa: E731
        holder = _VerlCfg(distillation_loss=loss_cfg)
        out = compute_forward_kl_topk(s_logits, nested(t_topk), nested(t_ids), holder, "thd")
        losses = out["distillation_losses"].clamp_min(0.0).reshape(mask.shape)  # verl's compute_forward_kl_topk
    else:
        losses = verl_core.kl_penalty(logprob=student, ref_logprob=teacher, kl_penalty=mode)
    counted = losses[mask.bool()]
    extrema = (counted.min(), counted.max())
    if loss_cfg.loss_max_clamp is not None:
        losses = losses.clamp(min=-loss_cfg.loss_max_clamp, max=loss_cfg.loss_max_clamp)
    if loss_cfg.use_policy_gradient:
        pcfg = _VerlCfg(clip_ratio=loss_cfg.clip_ratio, clip_ratio_low=loss_cfg.clip_ratio_low,
                        clip_ratio_high=loss_cfg.clip_ratio_high, global_batch_info={}, tis_imp_ratio_cap=-1)
        distill, _ = verl_core.compute_policy_loss_vanilla(old, student, -losses.detach(), mask, agg, pcfg, None)
    else:
        distill = verl_core.agg_loss(losses, mask, agg)
    coef = loss_cfg.distillation_loss_coef if loss_cfg.use_task_rewards else 1.0
    total = (task_loss if loss_cfg.use_task_rewards else 0.0) + distill * coef
    return total, extrema


CASES = [(m, pg, task, clamp) for m in ESTIMATOR_MODES + ("forward_kl_topk",) for pg in (False, True)
         for task in (True, False) for clamp in (None, 0.3) if not (m in ("k1", "kl") and not pg)]


@pytest.mark.parametrize("mode,policy_gradient,task_rewards,max_clamp", CASES)
def test_each_mode_matches_verls_formula(mode, policy_gradient, task_rewards, max_clamp):
    g = torch.Generator().manual_seed(hash((mode, policy_gradient, task_rewards, max_clamp)) % 2**31)
    rows, resp, v, k = 3, 5, 11, 4
    mask = (torch.rand(rows, resp, generator=g) > 0.25).double()
    mask[0, 0] = 1.0
    s_logits = torch.randn(1, rows * resp, v, generator=g, dtype=torch.float64)
    t_logits = torch.randn(1, rows * resp, v, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (rows, resp), generator=g)
    s_full, t_full = s_logits.log_softmax(-1), t_logits.log_softmax(-1)
    t_topk, t_ids = t_full.topk(k, dim=-1)
    old = s_full.gather(-1, labels.reshape(1, -1, 1)).reshape(rows, resp) + 0.1 * torch.randn(rows, resp, generator=g,
                                                                                            dtype=torch.float64)
    task = torch.tensor(0.37, dtype=torch.float64)
    cfg = DistillationLossConfig(loss_mode=mode, topk=k, use_policy_gradient=policy_gradient,
                                 use_task_rewards=task_rewards, distillation_loss_coef=0.6, loss_max_clamp=max_clamp,
                                 log_prob_min_clamp=-2.5 if mode == "forward_kl_topk" else None,
                                 clip_ratio_low=0.15, clip_ratio_high=0.28)

    def ours(s_logits):
        s_full = s_logits.log_softmax(-1)
        student = s_full.gather(-1, labels.reshape(1, -1, 1)).reshape(rows, resp)
        teacher = t_full.gather(-1, labels.reshape(1, -1, 1)).reshape(rows, resp)
        terms = None
        if mode == "forward_kl_topk":
            at = s_full.gather(-1, t_ids).reshape(rows, resp, k)
            terms = D.forward_kl_topk(at, t_topk.reshape(rows, resp, k), t_ids.reshape(rows, resp, k), -2.5)
        losses = D.per_token_loss(mode, student, teacher, terms)
        loss, m = D.distillation_loss(losses, mask, cfg, "token-mean", None, student, old)
        return D.combine(task, loss, cfg), m

    def theirs(s_logits):
        s_full = s_logits.log_softmax(-1)
        student = s_full.gather(-1, labels.reshape(1, -1, 1)).reshape(rows, resp)
        teacher = t_full.gather(-1, labels.reshape(1, -1, 1)).reshape(rows, resp)
        # verl's top-k path sees every token (the nested batch is the flat token list): mask it like verl's rows
        return _verl_distillation(mode, cfg, student, teacher, old, mask, "token-mean", t_topk=t_topk, t_ids=t_ids,
                                  s_logits=s_logits, task_loss=task)

    a = s_logits.clone().requires_grad_()
    got, metrics = ours(a)
    got.backward()
    b = s_logits.clone().requires_grad_()
    want, (lo, hi) = theirs(b)
    want.backward()
    # verl's top-k KL (fsdp/losses.py kl_divergence) computes in float32 whatever its inputs: float32 bounds there
    tol = 2e-6 if mode == "forward_kl_topk" else 1e-12
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(a.grad, b.grad, rtol=tol * 10, atol=tol)
    assert float(metrics["distillation/loss_min"]) == pytest.approx(float(lo), abs=tol)
    assert float(metrics["distillation/loss_max"]) == pytest.approx(float(hi), abs=tol)


def test_config_refuses_what_verl_refuses():
    assert any("use_policy_gradient=false" in p for p in DistillationLossConfig(loss_mode="k1").check())
    assert any("policy_loss_mode" in p for p in DistillationLossConfig(policy_loss_mode="gspo").check())
    assert any("loss_mode='nope'" in p for p in DistillationLossConfig(loss_mode="nope").check())
    assert DistillationLossConfig().check() == []
