"""The kernels step: each Triton kernel of tripod.kernels against its torch twin (max error on fresh random inputs),
the elementwise kernels' GB/s as a share of the measured copy rate, and the fused log-prob kernel's forward +
backward TFLOP/s and peak memory next to the full-logits torch path (the LM head of a Qwen2.5 vocabulary)."""
from __future__ import annotations

import time

from gpu_check_steps import Context


def _timer(cuda: bool):
    import torch

    def seconds(fn, iters: int) -> float:
        fn()  # first call: Triton compiles and autotunes here, outside the timing
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters
    return seconds


def _max_err(tri, ref) -> tuple[float, float]:
    tri, ref = (tri if isinstance(tri, tuple) else (tri,)), (ref if isinstance(ref, tuple) else (ref,))
    err = max(((a.float() - b.float()).abs().max().item() for a, b in zip(tri, ref) if a is not None), default=0.0)
    scale = max((b.float().abs().max().item() for b in ref if b is not None), default=1.0)
    return err, scale


def run(ctx: Context) -> dict:
    import torch

    import tripod.kernels as kernels
    from tripod.runtime.memory import measure_peak_memory

    cuda, dev = not ctx.dry, ctx.device
    seconds = _timer(cuda)
    copy_gbps = ctx.earlier("roofline").get("copy_GBps")
    matmul_tflops = ctx.earlier("roofline").get("matmul_TFLOPs")
    g = torch.Generator(device=dev).manual_seed(7)
    rows, cols = (8, (1 << 24) // 8) if cuda else (4, 256)
    x = [torch.randn(rows, cols, device=dev, generator=g) * 0.1 for _ in range(3)]
    mask = (torch.rand(rows, cols, device=dev, generator=g) > 0.1).float()
    n = rows * cols
    elementwise = {  # name: (call, bytes moved per element: inputs read + outputs written, fp32)
        "gae": (lambda be: kernels.gae(x[0], x[1], mask, 0.99, 0.95, backend=be), 4 * 4 + 2 * 4),
        "kl(k3)": (lambda be: kernels.kl(x[0], x[1], "k3", backend=be), 2 * 4 + 4),
        "policy_loss": (lambda be: kernels.policy_loss_per_token(x[0], x[1], x[2], backend=be), 3 * 4 + 3 * 4),
        "value_loss": (lambda be: kernels.value_loss_per_token(x[0], x[1], x[2], backend=be), 3 * 4 + 2 * 4),
    }
    out: dict = {"elementwise": [], "copy_GBps": copy_gbps}
    for name, (fn, bpe) in elementwise.items():
        err, scale = _max_err(fn("triton"), fn("torch"))
        iters = 20 if cuda else 1
        t_tri, t_ref = seconds(lambda fn=fn: fn("triton"), iters), seconds(lambda fn=fn: fn("torch"), iters)
        gbps = bpe * n / t_tri / 1e9
        out["elementwise"].append({"kernel": name, "max_abs_err": err, "ok": err <= 1e-4 * max(1.0, scale),
                                   "triton_GBps": gbps, "torch_GBps": bpe * n / t_ref / 1e9,
                                   "pct_of_copy": 100 * gbps / copy_gbps if copy_gbps else None})
    tokens, vocab, hid = (4096, 151936, 896) if cuda else (32, 512, 32)
    dtype = torch.bfloat16 if cuda else torch.float32
    h = torch.randn(tokens, hid, device=dev, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hid, device=dev, generator=g) / hid ** 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=dev, generator=g)
    grad_out = torch.randn(tokens, device=dev, generator=g)

    def fused(be: str):
        logp, ent = kernels.logprobs_from_hidden(h, w, labels, backend=be)
        ((logp + ent) * grad_out).sum().backward()

    def full():
        logits = (h @ w.t()).float()
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, labels[:, None])[:, 0]
        ent = -(logp_all.exp() * logp_all).sum(-1)
        ((logp + ent) * grad_out).sum().backward()

    with torch.no_grad():  # forward correctness in fp32 on both sides (the backends' own arithmetic)
        h32, w32 = h.detach().float(), w.detach().float()
        err, scale = _max_err(kernels.logprobs_from_hidden(h32, w32, labels, backend="triton"),
                              kernels.logprobs_from_hidden(h32, w32, labels, backend="torch"))
    flops = 4 * 2 * tokens * vocab * hid  # forward, recompute and the two backward matmuls
    res = {"tokens": tokens, "vocab": vocab, "hidden": hid, "dtype": str(dtype).removeprefix("torch."),
           "max_abs_err": err, "ok": err <= 1e-4 * max(1.0, scale)}
    for name, fn in (("fused", lambda: fused("triton")), ("full_logits", full)):
        h.grad = w.grad = None
        fn()  # compile / autotune, then the peak of one clean call
        h.grad = w.grad = None
        with measure_peak_memory(dev) as peak:
            fn()
        h.grad = w.grad = None
        t = seconds(fn, 5 if cuda else 1)
        res[f"{name}_TFLOPs"] = flops / t / 1e12
        res[f"{name}_peak_MiB"] = peak.extra_bytes / 2 ** 20
        res[f"{name}_pct_of_matmul"] = 100 * flops / t / 1e12 / matmul_tflops if matmul_tflops else None
    out["logprobs"] = res
    bad = [r["kernel"] for r in out["elementwise"] if not r["ok"]] + ([] if res["ok"] else ["logprobs_from_hidden"])
    if bad:
        raise RuntimeError(f"Triton kernels disagree with their torch twins: {bad}: {out}")
    return out


def summary(r: dict) -> str:
    ew = ", ".join(f"{e['kernel']} {e['triton_GBps']:.3g} GB/s"
                   + (f" ({e['pct_of_copy']:.0f}%)" if e["pct_of_copy"] is not None else "") for e in r["elementwise"])
    lp = r["logprobs"]
    err = max([e["max_abs_err"] for e in r["elementwise"]] + [lp["max_abs_err"]])
    return (f"max err {err:.1e}; {ew}; log-probs fwd+bwd fused {lp['fused_TFLOPs']:.3g} TFLOP/s "
            f"{lp['fused_peak_MiB']:.3g} MiB vs full logits {lp['full_logits_TFLOPs']:.3g} TFLOP/s "
            f"{lp['full_logits_peak_MiB']:.3g} MiB")
