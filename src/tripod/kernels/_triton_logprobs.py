"""Triton kernels behind `tripod.kernels.logprobs.logprobs_from_hidden` (CUDA; CPU via TRITON_INTERPRET=1).

Forward: the grid is (token blocks, vocab splits of SPLIT_V columns): each program walks its split in tiles, builds
each logits tile with tl.dot over the hidden dim and folds it into the per-token online statistics (running max m,
sum exp(z-m), sum exp(z-m)*(z-m), label logit) of its split; the splits are merged in torch, exactly as
`tripod.kernels.logprobs` merges ranks over the TP group. Splitting the vocab keeps the GPU busy at few tokens, and
each weight tile is read by tokens / BLOCK_T programs instead of every program streaming the whole vocab.
Nothing of size [tokens, vocab] is written.

Backward: one program per (token block, vocab block) of a [chunk_tokens, chunk_vocab] chunk
recomputes the logits tile with tl.dot and writes d loss / d logits for it; the two matmuls that
turn it into grad_hidden and grad_weight are left to cuBLAS (torch) on that chunk.

Tiles are autotuned on CUDA (`_CONFIGS`, keyed by the hidden size); the interpreter runs one small config. Row
offsets are computed in int64: V_local x H or tokens x H past 2^31 elements (a 152k vocab x 8k hidden LM head, or
256k tokens x 8k) would wrap in int32.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SPLIT_V = 2048  # vocab columns per forward program (a multiple of every BLOCK_V below)

if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter: one small config, no tuning runs
    _CONFIGS = [triton.Config({"BLOCK_T": 16, "BLOCK_V": 32, "BLOCK_H": 16})]
else:
    _CONFIGS = [triton.Config({"BLOCK_T": bt, "BLOCK_V": bv, "BLOCK_H": bh}, num_warps=w, num_stages=st)
                for bt, bv, bh, w, st in ((32, 64, 32, 4, 3), (64, 64, 32, 4, 3), (64, 128, 32, 4, 3),
                                          (64, 128, 64, 8, 3), (128, 128, 32, 8, 3), (128, 64, 64, 8, 4),
                                          (32, 128, 64, 4, 4))]


def _dot_precision(dtype: torch.dtype) -> tl.constexpr:
    # fp32 inputs: true fp32 products (tf32 would cost ~3 decimal digits of the log-probs).
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


@triton.jit
def _logits_tile(h_ptr, w_ptr, offs_t, offs_v, t_mask, v_mask, hidden, stride_h, stride_w,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                 PRECISION: tl.constexpr):
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    rows_h = offs_t.to(tl.int64) * stride_h  # int64: tokens x H may pass 2^31
    rows_w = offs_v.to(tl.int64) * stride_w  # int64: V_local x H may pass 2^31
    for k0 in range(0, hidden, BLOCK_H):
        offs_k = k0 + tl.arange(0, BLOCK_H)
        k_mask = offs_k < hidden
        h_tile = tl.load(h_ptr + rows_h[:, None] + offs_k[None, :],
                         mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(w_ptr + rows_w[None, :] + offs_k[:, None],
                         mask=v_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(h_tile, w_tile, acc, input_precision=PRECISION)
    return acc


@triton.autotune(configs=_CONFIGS, key=["hidden"])
@triton.jit
def _forward_stats_kernel(h_ptr, w_ptr, labels_ptr, stats_ptr,
                          n_tokens, valid_local, hidden, vocab_start, inv_temp, stride_h, stride_w,
                          WITH_ENTROPY: tl.constexpr, SPLIT_V: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    v_begin = split * SPLIT_V
    v_end = tl.minimum(v_begin + SPLIT_V, valid_local)
    t_mask = offs_t < n_tokens
    local_labels = tl.load(labels_ptr + offs_t, mask=t_mask, other=-1) - vocab_start
    m = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    b = tl.zeros((BLOCK_T,), dtype=tl.float32)
    zy = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        v_mask = offs_v < v_end
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
    out = stats_ptr + split.to(tl.int64) * 4 * n_tokens + offs_t  # stats[split, 0..3, token]
    tl.store(out, m, mask=t_mask)
    tl.store(out + n_tokens, s, mask=t_mask)
    tl.store(out + 2 * n_tokens, b, mask=t_mask)
    tl.store(out + 3 * n_tokens, zy, mask=t_mask)


@triton.autotune(configs=_CONFIGS, key=["hidden"])
@triton.jit
def _grad_logits_kernel(h_ptr, w_ptr, labels_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, out_ptr,
                        n_tokens, n_vocab, hidden, label_offset, inv_temp, stride_h, stride_w,
                        stride_out, HAS_ENT_GRAD: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
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
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_out + offs_v[None, :],
             g.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & v_mask[None, :])


def forward_stats(h2d: torch.Tensor, weight: torch.Tensor, labels1d: torch.Tensor, inv_temp: float,
                  vocab_start: int, valid_local: int, with_entropy: bool):
    """Per-token (m, s, b or None, zy) over this rank's valid vocab rows, float32."""
    n_tokens, hidden = h2d.shape
    if not (n_tokens and valid_local):
        m = torch.full((n_tokens,), float("-inf"), dtype=torch.float32, device=h2d.device)
        zeros = torch.zeros(n_tokens, dtype=torch.float32, device=h2d.device)
        return m, zeros, (zeros.clone() if with_entropy else None), zeros.clone()
    splits = triton.cdiv(valid_local, SPLIT_V)
    stats = torch.empty((splits, 4, n_tokens), dtype=torch.float32, device=h2d.device)
    grid = lambda meta: (triton.cdiv(n_tokens, meta["BLOCK_T"]), splits)  # noqa: E731
    _forward_stats_kernel[grid](h2d, weight, labels1d, stats, n_tokens, valid_local, hidden, vocab_start,
                                inv_temp, h2d.stride(0), weight.stride(0), WITH_ENTROPY=with_entropy,
                                SPLIT_V=SPLIT_V, PRECISION=_dot_precision(h2d.dtype))
    return merge_splits(stats, with_entropy)


def merge_splits(stats: torch.Tensor, with_entropy: bool):
    """[splits, 4, tokens] partial (m, s, b, zy) -> one (m, s, b or None, zy), as the TP merge does across ranks:
    s and b re-anchored to the global max, zy summed (one split holds the label)."""
    m_split, s_split, b_split, zy_split = stats.unbind(1)
    m = m_split.amax(0)
    scale = torch.exp(m_split - m)  # every split saw >= 1 valid column: m_split is finite
    s = (s_split * scale).sum(0)
    b = ((b_split + (m_split - m) * s_split) * scale).sum(0) if with_entropy else None
    return m, s, b, zy_split.sum(0)


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
            nt, nv = t1 - t0, v1 - v0
            grid = lambda meta: (triton.cdiv(nt, meta["BLOCK_T"]), triton.cdiv(nv, meta["BLOCK_V"]))  # noqa: E731
            _grad_logits_kernel[grid](h_c, w_c, labels1d[t0:t1], lse[t0:t1], ent[t0:t1],
                                      grad_logp[t0:t1], g_ent[t0:t1], g, nt, nv, hidden,
                                      vocab_start + v0, inv_temp, h_c.stride(0), w_c.stride(0),
                                      g.stride(0), HAS_ENT_GRAD=has_ent_grad,
                                      PRECISION=_dot_precision(h2d.dtype))
            if need_h:
                grad_h[t0:t1].add_(g @ w_c)
            if need_w:
                grad_w[v0:v1].add_(g.T @ h_c)
    return grad_h, grad_w
