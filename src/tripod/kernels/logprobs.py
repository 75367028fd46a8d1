"""Per-token log-probs and entropy straight from hidden states and the (vocab-parallel) LM head.

Owns `logprobs_from_hidden`: log softmax(h W^T / T)[label] and the entropy of softmax(h W^T / T),
per token, with gradients w.r.t. `hidden` and `weight`, without ever materialising the
[tokens, vocab] logits. The torch twin here chunks over tokens and vocab; the Triton kernels in
`kernels/_triton_logprobs.py` do the same with tl.dot tiles. Both produce the same four per-token
partial statistics over this rank's vocab slice, which `_combine_over_tp` merges across the
tensor-parallel group:

    m   running max of the logits z
    s   sum exp(z - m)
    b   sum exp(z - m) * (z - m)           (so entropy = log S - B / S, no large-number cancellation)
    zy  logit of the label (0 on ranks that do not own it)

Backward recomputes each chunk of logits from the saved lse and entropy and uses
    d logp / dz = onehot(y) - p,        d H / dz = -p * (log p + H).

Tensor parallelism follows Megatron's output layer (ColumnParallelLinear over the vocab): `hidden`
is the replicated input, `weight` is this rank's [V_local, H] row slice of the padded vocab, and the
gradient of `hidden` is all-reduced over `tp_group` in backward, exactly what
`copy_to_tensor_model_parallel_region` would do. Pass the plain replicated hidden states; if the
caller's graph already reduces that gradient over TP (e.g. it passes the output of
`gather_from_sequence_parallel_region`, whose backward reduce-scatters), pass
`reduce_hidden_grad=False`. The weight gradient is local to the rank (data-parallel reduction is the
DDP wrapper's job).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

DEFAULT_CHUNK_TOKENS = 1024
DEFAULT_CHUNK_VOCAB = 4096


def _tp_rank_world(tp_group) -> tuple[int, int]:
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_stats_torch(z: torch.Tensor, local_labels: torch.Tensor, with_entropy: bool):
    """(m, s, b, zy) of one [t, v] chunk of scaled logits (padded vocab columns already cut off).

    z is a scratch buffer and is overwritten.
    """
    owns = (local_labels >= 0) & (local_labels < z.shape[1])
    picked = z.gather(1, local_labels.clamp(0, z.shape[1] - 1)[:, None])[:, 0]
    m = z.amax(dim=1)
    zy = torch.where(owns, picked, torch.zeros_like(m))
    shifted = z.sub_(m[:, None])
    e = torch.exp(shifted)
    s = e.sum(dim=1)
    b = (e.mul_(shifted)).sum(dim=1) if with_entropy else None
    return m, s, b, zy


def _merge_stats(m1, s1, b1, m2, s2, b2):
    """Online merge of two (max, sum-exp, sum-exp*shift) triples; either side may be empty (m=-inf)."""
    m = torch.maximum(m1, m2)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    a1, a2 = torch.exp(m1 - m_safe), torch.exp(m2 - m_safe)
    s = s1 * a1 + s2 * a2
    b = None
    if b1 is not None:
        # b is measured from the old max; re-anchor it: (z - m) = (z - m_i) + (m_i - m).
        d1 = torch.where(s1 > 0, m1 - m_safe, torch.zeros_like(m1))
        d2 = torch.where(s2 > 0, m2 - m_safe, torch.zeros_like(m2))
        b = a1 * (b1 + d1 * s1) + a2 * (b2 + d2 * s2)
    return m, s, b


def _forward_stats_torch(h2d, weight, labels1d, inv_temp, vocab_start, valid_local, with_entropy,
                         chunk_tokens, chunk_vocab):
    n_tokens = h2d.shape[0]
    cdt = _compute_dtype(h2d.dtype)
    m = torch.full((n_tokens,), float("-inf"), dtype=cdt, device=h2d.device)
    s = torch.zeros_like(m)
    b = torch.zeros_like(m) if with_entropy else None
    zy = torch.zeros_like(m)
    local_labels = labels1d - vocab_start
    for t0 in range(0, n_tokens, chunk_tokens):
        t1 = min(t0 + chunk_tokens, n_tokens)
        h_c = h2d[t0:t1]
        m_c, s_c, b_c = m[t0:t1], s[t0:t1], (b[t0:t1] if with_entropy else None)
        zy_c = zy[t0:t1]
        for v0 in range(0, valid_local, chunk_vocab):
            v1 = min(v0 + chunk_vocab, valid_local)
            z = (h_c @ weight[v0:v1].T).to(cdt).mul_(inv_temp)
            cm, cs, cb, czy = _chunk_stats_torch(z, local_labels[t0:t1] - v0, with_entropy)
            nm, ns, nb = _merge_stats(m_c, s_c, b_c, cm, cs, cb)
            m_c.copy_(nm)
            s_c.copy_(ns)
            if with_entropy:
                b_c.copy_(nb)
            zy_c.add_(czy)
    return m, s, b, zy


def _combine_over_tp(m, s, b, zy, tp_group, world: int):
    """Merge per-rank partial stats over the TP group -> (logp, entropy or None, lse)."""
    if world > 1:
        m_glob = m.clone()
        dist.all_reduce(m_glob, op=dist.ReduceOp.MAX, group=tp_group)
        zeros = torch.zeros_like(m)
        _, s, b = _merge_stats(m, s, b, m_glob, zeros, (zeros if b is not None else None))
        stacked = torch.stack([s, zy] + ([b] if b is not None else [])).contiguous()
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
        s, zy = stacked[0], stacked[1]
        b = stacked[2] if b is not None else None
        m = m_glob
    lse = m + torch.log(s)
    logp = zy - lse
    entropy = torch.log(s) - b / s if b is not None else None
    return logp, entropy, lse


def _grad_logits_chunk(z, lse, entropy, grad_logp, grad_ent, local_labels):
    """d loss / d z for one [t, v] chunk of scaled logits z (overwritten; padded columns cut off).

    In place, so a chunk costs two [t, v] buffers: z (-> log p -> the bracket) and p (-> the grad).
    """
    log_p = z.sub_(lse[:, None])
    p = torch.exp(log_p)
    if grad_ent is not None:
        # g = -p * (g_logp + g_ent * (log p + H))
        bracket = log_p.add_(entropy[:, None]).mul_(grad_ent[:, None]).add_(grad_logp[:, None])
        g = p.mul_(bracket).neg_()
    else:
        g = p.mul_(grad_logp[:, None]).neg_()
    owns = (local_labels >= 0) & (local_labels < z.shape[1])
    rows = owns.nonzero(as_tuple=True)[0]
    g[rows, local_labels[rows]] += grad_logp[rows]
    return g


def _backward_torch(h2d, weight, labels1d, lse, entropy, grad_logp, grad_ent, inv_temp, vocab_start,
                    valid_local, chunk_tokens, chunk_vocab, need_h=True, need_w=True):
    cdt = _compute_dtype(h2d.dtype)
    grad_h = torch.zeros(h2d.shape, dtype=cdt, device=h2d.device) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None
    local_labels = labels1d - vocab_start
    for t0 in range(0, h2d.shape[0], chunk_tokens):
        t1 = min(t0 + chunk_tokens, h2d.shape[0])
        h_c = h2d[t0:t1]
        for v0 in range(0, valid_local, chunk_vocab):
            v1 = min(v0 + chunk_vocab, valid_local)
            w_c = weight[v0:v1]
            z = (h_c @ w_c.T).to(cdt).mul_(inv_temp)
            g = _grad_logits_chunk(z, lse[t0:t1], None if entropy is None else entropy[t0:t1],
                                   grad_logp[t0:t1], None if grad_ent is None else grad_ent[t0:t1],
                                   local_labels[t0:t1] - v0)
            g = g.mul_(inv_temp).to(h2d.dtype)
            if need_h:
                _add_matmul(grad_h[t0:t1], g, w_c)
            if need_w:
                _add_matmul(grad_w[v0:v1], g.T, h_c)
    return grad_h, grad_w


def _add_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b: in place (addmm_, no [rows, cols] temporary) where out has the operands' dtype; a bf16 / fp16
    product is formed first and accumulated into the float32 buffer (addmm_ takes one dtype)."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        out.add_(a @ b)


class _LogprobsFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden2d, weight, labels1d, inv_temp, vocab_start, valid_local, with_entropy,
                tp_group, world, use_triton, chunk_tokens, chunk_vocab, reduce_hidden_grad):
        if use_triton:
            from tripod.kernels import _triton_logprobs as tri
            m, s, b, zy = tri.forward_stats(hidden2d, weight, labels1d, inv_temp, vocab_start,
                                            valid_local, with_entropy)
        else:
            m, s, b, zy = _forward_stats_torch(hidden2d, weight, labels1d, inv_temp, vocab_start,
                                               valid_local, with_entropy, chunk_tokens, chunk_vocab)
        logp, entropy, lse = _combine_over_tp(m, s, b, zy, tp_group, world)
        ctx.save_for_backward(hidden2d, weight, labels1d, lse, entropy)
        ctx.cfg = (inv_temp, vocab_start, valid_local, tp_group, world, use_triton, chunk_tokens,
                   chunk_vocab, reduce_hidden_grad)
        if entropy is not None:
            return logp, entropy
        placeholder = torch.zeros_like(logp)  # autograd.Function outputs are fixed in number
        ctx.mark_non_differentiable(placeholder)
        return logp, placeholder

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden2d, weight, labels1d, lse, entropy = ctx.saved_tensors
        (inv_temp, vocab_start, valid_local, tp_group, world, use_triton, chunk_tokens, chunk_vocab,
         reduce_hidden_grad) = ctx.cfg
        cdt = lse.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.to(cdt).contiguous()
        grad_ent = None if (grad_ent is None or entropy is None) else grad_ent.to(cdt).contiguous()
        if use_triton:
            from tripod.kernels import _triton_logprobs as tri
            grad_h, grad_w = tri.backward(hidden2d, weight, labels1d, lse, entropy, grad_logp,
                                          grad_ent, inv_temp, vocab_start, valid_local,
                                          chunk_tokens, chunk_vocab, need_h, need_w)
        else:
            grad_h, grad_w = _backward_torch(hidden2d, weight, labels1d, lse, entropy, grad_logp,
                                             grad_ent, inv_temp, vocab_start, valid_local,
                                             chunk_tokens, chunk_vocab, need_h, need_w)
        if need_h and world > 1 and reduce_hidden_grad:
            grad_h = grad_h.contiguous()
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=tp_group)
        grad_h = grad_h.to(hidden2d.dtype) if need_h else None
        grad_w = grad_w.to(weight.dtype) if need_w else None
        return (grad_h, grad_w) + (None,) * 11


def _triton_usable(device: torch.device) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _validate(hidden, weight, labels, temperature, vocab_size, padded_vocab, chunk_tokens, chunk_vocab,
              backend) -> None:
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating-point tensor [..., H], got "
                         f"{getattr(hidden, 'dtype', type(hidden))}")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        raise ValueError("weight must be a 2-D floating-point tensor [V_local, H] (this rank's LM-head "
                         f"rows), got {getattr(weight, 'dtype', type(weight))} "
                         f"shape {tuple(getattr(weight, 'shape', ()))}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != hidden dtype {hidden.dtype}; cast one of them")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden last dim {tuple(hidden.shape)[-1:]} must equal weight.shape[1]="
                         f"{weight.shape[1]} (the hidden size)")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex() \
            or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor of token ids, got "
                         f"{getattr(labels, 'dtype', type(labels))}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden.shape[:-1]="
                         f"{tuple(hidden.shape[:-1])}")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if vocab_size is not None and not (0 < vocab_size <= padded_vocab):
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {padded_vocab}] (V_local * tp_size)")
    for name, value in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if labels.numel():
        real_vocab = vocab_size if vocab_size is not None else padded_vocab
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= real_vocab:
            raise ValueError(f"labels must be token ids in [0, {real_vocab}) (vocab_size), got range "
                             f"[{lo}, {hi}]; mask ignored positions (e.g. -100) to a valid id first")


def logprobs_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, tp_group=None, with_entropy: bool = True, *,
                         backend: str = "auto", chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                         chunk_vocab: int = DEFAULT_CHUNK_VOCAB, vocab_size: int | None = None,
                         reduce_hidden_grad: bool = True,
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log softmax(hidden @ weight.T / temperature)[labels] and its entropy.

    hidden: [..., H] replicated over the TP group; weight: [V_local, H], rank r's rows
    [r*V_local, (r+1)*V_local) of the (padded) vocab; labels: [...] global token ids.
    vocab_size: the real vocab; rows with id >= vocab_size are padding and excluded.
    Returns (logprobs [...], entropy [...] or None), float32 (float64 for float64 inputs).
    Differentiable w.r.t. hidden and weight; under TP the hidden grad is all-reduced over
    tp_group unless reduce_hidden_grad=False (see the module docstring).
    """
    rank, world = _tp_rank_world(tp_group)
    padded_vocab = weight.shape[0] * world if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 0
    _validate(hidden, weight, labels, temperature, vocab_size, padded_vocab, chunk_tokens, chunk_vocab,
              backend)
    triton_dtype = hidden.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if backend == "triton" and not (_triton_usable(hidden.device) and triton_dtype):
        raise ValueError("backend='triton' needs float32/bfloat16/float16 CUDA tensors and an "
                         "importable triton (or TRITON_INTERPRET=1 set before importing triton, for "
                         "CPU tensors); use backend='torch' otherwise")
    use_triton = backend == "triton" or (backend == "auto" and hidden.is_cuda and triton_dtype
                                         and _triton_usable(hidden.device))
    v_local = weight.shape[0]
    vocab_start = rank * v_local
    real_vocab = vocab_size if vocab_size is not None else padded_vocab
    valid_local = max(0, min(v_local, real_vocab - vocab_start))

    lead_shape = labels.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    labels1d = labels.reshape(-1).to(torch.int64).contiguous()
    logp, entropy = _LogprobsFromHidden.apply(
        hidden2d, weight.contiguous(), labels1d, 1.0 / float(temperature), vocab_start, valid_local,
        with_entropy, tp_group, world, use_triton, chunk_tokens, chunk_vocab, reduce_hidden_grad)
    logp = logp.reshape(lead_shape)
    return logp, (entropy.reshape(lead_shape) if with_entropy else None)
