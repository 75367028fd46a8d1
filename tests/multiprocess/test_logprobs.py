"""Tests of kernels.logprobs.logprobs_from_hidden against a float64 full-logits reference.

The reference (written here, from the definitions): logits = h @ W.T / T in float64, log_softmax,
gather the label; entropy = -sum p log p; gradients by torch autograd through that graph.
The Triton path runs under TRITON_INTERPRET=1 in a subprocess (this file run as a script);
vocab-parallel runs on 2 gloo ranks via torchrun (tests/multiprocess/workers/tp2_logprobs_check.py).

fp32 tolerances: fp32 logits carry a rounding error ~ eps32 * |logit|, so an fp32 result can only
equal the float64 one to ~1e-7 relative to the logit scale. We require 1e-6 x that scale
(values) and 1e-6 x scale x max|grad| (gradients); the float64 run of the same op must match to 1e-10.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tripod.kernels.logprobs import logprobs_from_hidden

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reference(h, w, labels, temperature, vocab_size=None):
    """(logp, entropy) from float64 full logits; padded rows (>= vocab_size) dropped."""
    w = w if vocab_size is None else w[:vocab_size]
    log_p = torch.log_softmax(h.double() @ w.double().T / temperature, dim=-1)
    logp = log_p.gather(-1, labels[..., None])[..., 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logp, entropy


def run_case(dtype, lead_shape, hidden, vocab, temperature, chunk_tokens, chunk_vocab, *,
             hidden_scale=1.0, vocab_size=None, with_entropy=True, backend="torch", seed=0):
    """Our op and the float64 reference on the same fresh random inputs; returns both + logit scale."""
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(*lead_shape, hidden, generator=gen) * hidden_scale).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab_size or vocab, lead_shape, generator=gen)
    grad_logp = torch.randn(lead_shape, generator=gen, dtype=torch.float64)
    grad_ent = torch.randn(lead_shape, generator=gen, dtype=torch.float64)

    logp, ent = logprobs_from_hidden(h, w, labels, temperature, with_entropy=with_entropy,
                                     backend=backend, chunk_tokens=chunk_tokens,
                                     chunk_vocab=chunk_vocab, vocab_size=vocab_size)
    loss = (logp * grad_logp.to(logp.dtype)).sum()
    if with_entropy:
        loss = loss + (ent * grad_ent.to(ent.dtype)).sum()
    loss.backward()

    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref_logp, ref_ent = reference(h64, w64, labels, temperature, vocab_size)
    ref_loss = (ref_logp * grad_logp).sum() + ((ref_ent * grad_ent).sum() if with_entropy else 0.0)
    ref_loss.backward()
    logits = h64.detach() @ w64.detach()[: vocab_size or vocab].T / temperature
    scale = max(1.0, logits.abs().max().item())
    ours = dict(logp=logp, ent=ent, gh=h.grad, gw=w.grad)
    refs = dict(logp=ref_logp, ent=ref_ent, gh=h64.grad, gw=w64.grad)
    return ours, refs, scale


def assert_matches(ours, refs, atol_values, atol_grads_rel, with_entropy=True):
    keys = ["logp", "ent"] if with_entropy else ["logp"]
    for key in keys:
        err = (ours[key].double() - refs[key]).abs().max().item()
        assert err <= atol_values, f"{key}: max error {err:.3g} > {atol_values:.3g}"
    for key in ["gh", "gw"]:
        bound = atol_grads_rel * max(1.0, refs[key].abs().max().item())
        err = (ours[key].double() - refs[key]).abs().max().item()
        assert err <= bound, f"{key}: max error {err:.3g} > {bound:.3g}"


CASES = [
    # lead_shape, hidden, vocab, temperature, chunk_tokens, chunk_vocab, hidden_scale
    pytest.param((3, 29), 48, 203, 0.7, 16, 37, 1.0, id="bsH-T0.7-ragged-chunks"),
    pytest.param((53,), 33, 150, 1.6, 7, 64, 3.0, id="tokensH-T1.6-ragged-chunks"),
    pytest.param((2, 11), 40, 97, 0.9, 5, 13, 400.0, id="extreme-logits"),
]


@pytest.mark.parametrize("lead_shape,hidden,vocab,temperature,chunk_tokens,chunk_vocab,hscale", CASES)
@pytest.mark.parametrize("with_entropy", [True, False])
def test_fp32_matches_float64_reference(lead_shape, hidden, vocab, temperature, chunk_tokens,
                                        chunk_vocab, hscale, with_entropy):
    ours, refs, scale = run_case(torch.float32, lead_shape, hidden, vocab, temperature, chunk_tokens,
                                 chunk_vocab, hidden_scale=hscale, with_entropy=with_entropy)
    assert ours["logp"].shape == lead_shape and ours["logp"].dtype == torch.float32
    assert (ours["ent"] is not None) == with_entropy
    assert_matches(ours, refs, 1e-6 * scale, 1e-6 * scale, with_entropy)


@pytest.mark.parametrize("lead_shape,hidden,vocab,temperature,chunk_tokens,chunk_vocab,hscale", CASES)
def test_fp64_is_exact(lead_shape, hidden, vocab, temperature, chunk_tokens, chunk_vocab, hscale):
    ours, refs, _ = run_case(torch.float64, lead_shape, hidden, vocab, temperature, chunk_tokens,
                             chunk_vocab, hidden_scale=hscale)
    assert_matches(ours, refs, 1e-10, 1e-10)


def test_extreme_logits_stay_finite_and_peaked():
    # One token's label logit towers ~1e4 above the rest: logp -> 0, entropy -> 0, no nan/inf.
    ours, refs, scale = run_case(torch.float32, (64,), 32, 300, 1.0, 10, 50, hidden_scale=2000.0)
    for key, value in ours.items():
        assert torch.isfinite(value).all(), key
    assert scale > 1e3
    assert_matches(ours, refs, 1e-6 * scale, 1e-6 * scale)


def test_padded_vocab_rows_are_excluded():
    ours, refs, scale = run_case(torch.float32, (4, 9), 24, 128, 1.1, 8, 30, vocab_size=113)
    assert_matches(ours, refs, 1e-6 * scale, 1e-6 * scale)
    assert ours["gw"][113:].abs().max() == 0
    ours64, refs64, _ = run_case(torch.float64, (4, 9), 24, 128, 1.1, 8, 30, vocab_size=113, seed=1)
    assert_matches(ours64, refs64, 1e-10, 1e-10)


def test_bf16_close_to_reference_on_same_inputs():
    ours, refs, scale = run_case(torch.bfloat16, (40,), 64, 256, 1.0, 16, 100)
    assert ours["logp"].dtype == torch.float32 and ours["gh"].dtype == torch.bfloat16
    # bf16 logits carry ~2^-8 relative rounding; the gradients come back in bf16.
    assert_matches(ours, refs, 2e-2 * scale, 2e-2 * scale)


def test_frozen_lm_head_and_no_grad():
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(2, 9, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(70, 16, generator=gen, dtype=torch.float64)  # frozen: no weight grad computed
    labels = torch.randint(0, 70, (2, 9), generator=gen)
    logp, ent = logprobs_from_hidden(h, w, labels, 1.2, chunk_tokens=4, chunk_vocab=32)
    (logp.sum() - ent.sum()).backward()
    h64 = h.detach().clone().requires_grad_()
    ref_logp, ref_ent = reference(h64, w, labels, 1.2)
    (ref_logp.sum() - ref_ent.sum()).backward()
    assert w.grad is None
    torch.testing.assert_close(h.grad, h64.grad, rtol=0, atol=1e-10)
    with torch.no_grad():
        logp_ng, ent_ng = logprobs_from_hidden(h, w, labels, 1.2)
    assert not logp_ng.requires_grad
    torch.testing.assert_close(logp_ng, ref_logp.detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(ent_ng, ref_ent.detach(), rtol=0, atol=1e-10)


def test_bad_inputs_name_the_argument():
    h, w = torch.randn(5, 8), torch.randn(20, 8)
    y = torch.randint(0, 20, (5,))
    bad = [
        (dict(hidden=h.long()), "hidden"),
        (dict(weight=w.long()), "weight"),
        (dict(weight=w.double()), "dtype"),
        (dict(weight=torch.randn(20, 7)), "hidden last dim"),
        (dict(labels=y[:4]), "labels shape"),
        (dict(labels=y.float()), "labels"),
        (dict(labels=torch.full((5,), 20)), "labels must be token ids"),
        (dict(labels=torch.full((5,), -100)), "labels must be token ids"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(vocab_size=21), "vocab_size"),
        (dict(vocab_size=10, labels=torch.full((5,), 15)), "labels must be token ids"),
        (dict(chunk_vocab=0), "chunk_vocab"),
        (dict(backend="cuda"), "backend"),
    ]
    for override, needle in bad:
        kwargs = dict(hidden=h, weight=w, labels=y)
        kwargs.update(override)
        with pytest.raises(ValueError, match=needle):
            logprobs_from_hidden(**kwargs)


def test_triton_kernels_under_interpreter():
    """Runs this file as a script with TRITON_INTERPRET=1 (must be set before triton is imported)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "triton-interpreter"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TRITON-INTERPRETER-OK" in proc.stdout


def test_vocab_parallel_two_gloo_ranks():
    from tests.helpers.common import run_torchrun

    proc = run_torchrun("tp2_logprobs_check.py", 2, timeout=240)
    assert proc.stdout.count("TP2-LOGPROBS-OK") == 2, proc.stdout[-3000:]


def _triton_interpreter_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    cases = [
        # lead, H, V, T, chunk_tokens, chunk_vocab, hidden_scale, vocab_size, with_entropy
        ((2, 21), 40, 150, 0.7, 16, 70, 1.0, None, True),       # H, V, tokens not block multiples
        ((37,), 24, 101, 1.3, 50, 64, 300.0, 90, True),         # extreme logits + padded vocab
        ((19,), 32, 80, 1.0, 8, 33, 1.0, None, False),          # logp only
    ]
    for lead, hid, voc, temp, ct, cv, hs, vs, we in cases:
        ours, refs, scale = run_case(torch.float32, lead, hid, voc, temp, ct, cv, hidden_scale=hs,
                                     vocab_size=vs, with_entropy=we, backend="triton")
        assert_matches(ours, refs, 1e-5 * scale, 1e-5 * scale, we)
        if vs is not None:
            assert ours["gw"][vs:].abs().max() == 0
    print("TRITON-INTERPRETER-OK")


if __name__ == "__main__":
    if sys.argv[1:] == ["triton-interpreter"]:
        _triton_interpreter_main()
    else:
        sys.exit(f"usage: {sys.argv[0]} triton-interpreter   (or run it with pytest)")
