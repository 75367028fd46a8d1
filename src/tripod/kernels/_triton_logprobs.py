"""Triton kernels behind `tripod.kernels.logprobs.logprobs_from_hidden` (CUDA; CPU via TRITON_INTERPRET=1).

Forward: one program per block of tokens walks this rank's vocab in tiles; each logits tile is
built with tl.dot over the hidden dim and folded into the per-token online statistics
(running max m, sum exp(z-m), sum exp(z-m)*(z-m), label logit) that `tripod.kernels.logprobs`
merges over the TP group. Nothing of size [tokens, vocab] is written.

Backward: one program per (token block, vocab block) of a [chunk_tokens, chunk_vocab] chunk
recomputes the logits tile with tl.dot and writes d loss / d logits for it; the two matmuls that
turn it into grad_hidden and grad_weight are left to cuBLAS (torch) on that chunk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32
BLOCK_V = 64
BLOCK_H = 32


def _dot_precision(dtype: torch.dtype) -> tl.constexpr:
    # fp32 inputs: true fp32 products (tf32 would cost ~3 decimal digits of the log-probs).
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


@triton.jit
def _logits_tile(h_ptr, w_ptr, offs_t, offs_v, t_mask, v_mask, hidden, stride_h, stride_w,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                 PRECISION: tl.constexpr):
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_H):
        offs_k = k0 + tl.arange(0, BLOCK_H)
        k_mask = offs_k < hidden
        h_tile = tl.load(h_ptr + offs_t[:, None] * stride_h + offs_k[None, :],
                         mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(w_ptr + offs_v[None, :] * stride_w + offs_k[:, None],
                         mask=v_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(h_tile, w_tile, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _forward_stats_kernel(h_ptr, w_ptr, labels_ptr, m_ptr, s_ptr, b_ptr, zy_ptr,
                          n_tokens, valid_local, hidden, vocab_start, inv_temp, stride_h, stride_w,
                          WITH_ENTROPY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                          BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < n_tokens
    local_labels = tl.load(labels_ptr + offs_t, mask=t_mask, other=-1) - vocab_start
    m = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    b = tl.zeros((BLOCK_T,), dtype=tl.float32)
    zy = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for v0 in range(0, valid_local, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        v_mask = offs_v < valid_local
        z = _logits_tile(h_ptr, w_ptr, offs_t, offs_v, t_mask, v_mask, hidden, stride_h, stride_w,
                         BLOCK_T, BLOCK_V, BLOCK_H, PRECISION) * inv_temp
        z = tl.where(v_mask[None, :], z, float("-inf"))
        is_label = (offs_v[None, :] == local_labels[:, None]) & v_mask[None, :]
        zy += tl.sum(tl.where(is_label, z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(z, axis=1))  # finite: every tile has >= 1 valid column
        alpha = tl.exp(m - m_new)
        shifted = tl.where(v_mask[None, :], z - m_new[:, None], 0.0)
        e = tl.where(v_mask[None, :], tl.exp(shifted), 0.0)
        if WITH_ENTROPY:
            # re-anchor b from the old max: (z - m_new) = (z - m) + (m - m_new)
            step = tl.where(s > 0, m - m_new, 0.0)
            b = alpha * (b + step * s) + tl.sum(e * shifted, axis=1)
        s = s * alpha + tl.sum(e, axis=1)
        m = m_new
    tl.store(m_ptr + offs_t, m, mask=t_mask)
    tl.store(s_ptr + offs_t, s, mask=t_mask)
    tl.store(zy_ptr + offs_t, zy, mask=t_mask)
    if WITH_ENTROPY:
        tl.store(b_ptr + offs_t, b, mask=t_mask)


@triton.jit
def _grad_logits_kernel(h_ptr, w_ptr, labels_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, out_ptr,
                        n_tokens, n_vocab, hidden, label_offset, inv_temp, stride_h, stride_w,
                        stride_out, HAS_ENT_GRAD: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    t_mask = offs_t < n_tokens
    v_mask = offs_v < n_vocab
    z = _logits_tile(h_ptr, w_ptr, offs_t, offs_v, t_mask, v_mask, hidden, stride_h, stride_w,
                     BLOCK_T, BLOCK_V, BLOCK_H, PRECISION) * inv_temp
    lse = tl.load(lse_ptr + offs_t, mask=t_mask, other=0.0)
    g_logp = tl.load(glogp_ptr + offs_t, mask=t_mask, other=0.0)
    local_labels = tl.load(labels_ptr + offs_t, mask=t_mask, other=-1) - label_offset
    log_p = z - lse[:, None]
    p = tl.exp(log_p)
    if HAS_ENT_GRAD:
        ent = tl.load(ent_ptr + offs_t, mask=t_mask, other=0.0)
        g_ent = tl.load(gent_ptr + offs_t, mask=t_mask, other=0.0)
        g = -p * (g_logp[:, None] + g_ent[:, None] * (log_p + ent[:, None]))
    else:
        g = -p * g_logp[:, None]
    g += tl.where((offs_v[None, :] == local_labels[:, None]) & v_mask[None, :], g_logp[:, None], 0.0)
    g = g * inv_temp
    tl.store(out_ptr + offs_t[:, None] * stride_out + offs_v[None, :],
             g.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & v_mask[None, :])


def forward_stats(h2d: torch.Tensor, weight: torch.Tensor, labels1d: torch.Tensor, inv_temp: float,
                  vocab_start: int, valid_local: int, with_entropy: bool):
    """Per-token (m, s, b or None, zy) over this rank's valid vocab rows, float32."""
    n_tokens, hidden = h2d.shape
    stats = torch.empty((4, n_tokens), dtype=torch.float32, device=h2d.device)
    m, s, b, zy = stats[0], stats[1], stats[2], stats[3]
    m.fill_(float("-inf"))
    s.zero_()
    b.zero_()
    zy.zero_()
    if n_tokens and valid_local:
        grid = (triton.cdiv(n_tokens, BLOCK_T),)
        _forward_stats_kernel[grid](h2d, weight, labels1d, m, s, b, zy, n_tokens, valid_local, hidden,
                                    vocab_start, inv_temp, h2d.stride(0), weight.stride(0),
                                    WITH_ENTROPY=with_entropy, BLOCK_T=BLOCK_T, BLOCK_V=BLOCK_V,
                                    BLOCK_H=BLOCK_H, PRECISION=_dot_precision(h2d.dtype))
    return m, s, (b if with_entropy else None), zy


def backward(h2d, weight, labels1d, lse, entropy, grad_logp, grad_ent, inv_temp, vocab_start,
             valid_local, chunk_tokens, chunk_vocab, need_h=True, need_w=True):
    """(grad_hidden, grad_weight) in float32 (None where not needed): Triton grad-of-logits per
    chunk, torch matmuls."""
    n_tokens, hidden = h2d.shape
    grad_h = torch.zeros(h2d.shape, dtype=torch.float32, device=h2d.device) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    has_ent_grad = grad_ent is not None
    ent = entropy if has_ent_grad else lse  # placeholder pointer, unread when HAS_ENT_GRAD is False
    g_ent = grad_ent if has_ent_grad else grad_logp
    buf = torch.empty((min(chunk_tokens, n_tokens), min(chunk_vocab, max(valid_local, 1))),
                      dtype=h2d.dtype, device=h2d.device)
    for t0 in range(0, n_tokens, chunk_tokens):
        t1 = min(t0 + chunk_tokens, n_tokens)
        h_c = h2d[t0:t1]
        for v0 in range(0, valid_local, chunk_vocab):
            v1 = min(v0 + chunk_vocab, valid_local)
            w_c = weight[v0:v1]
            g = buf[: t1 - t0, : v1 - v0]
            grid = (triton.cdiv(t1 - t0, BLOCK_T), triton.cdiv(v1 - v0, BLOCK_V))
            _grad_logits_kernel[grid](h_c, w_c, labels1d[t0:t1], lse[t0:t1], ent[t0:t1],
                                      grad_logp[t0:t1], g_ent[t0:t1], g, t1 - t0, v1 - v0, hidden,
                                      vocab_start + v0, inv_temp, h_c.stride(0), w_c.stride(0),
                                      g.stride(0), HAS_ENT_GRAD=has_ent_grad, BLOCK_T=BLOCK_T,
                                      BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H,
                                      PRECISION=_dot_precision(h2d.dtype))
            if need_h:
                grad_h[t0:t1].add_(g @ w_c)
            if need_w:
                grad_w[v0:v1].add_(g.T @ h_c)
    return grad_h, grad_w
