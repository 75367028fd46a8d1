"""The Triton log-prob kernels (issue 18 item 9) through the interpreter: int64 row offsets past 2^31 elements, and
a forward grid that splits the vocab, both against torch on the same numbers.

* Index arithmetic: the LM head and the hidden states are strided views whose rows lie 2^30 elements apart in one
  (virtual, untouched) 8 GiB buffer, so row 2 starts at element 2^31: int32 offsets wrap there (the old kernels read
  the wrong memory). Tiny hidden size, three rows each; only the touched pages are ever resident.
* Vocab splits: 2.1 x SPLIT_V columns make three forward programs per token block, merged like TP ranks.
Bounds: fp32 on both sides (ieee dot), sums over <= 16 (hidden) and <= 4400 (vocab) terms; reduction order alone
differs, a few ulps of the log-sum-exp: 1e-5 absolute on values of order 1-10.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.common import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from tripod.kernels import _triton_logprobs as tri

    def reference(h, w, y):
        z = (h.double() @ w.double().T)
        logp = torch.log_softmax(z, -1)
        return logp.gather(1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    def check(h, w, y, what):
        m, s, b, zy = tri.forward_stats(h, w, y, 1.0, 0, w.shape[0], True)
        lse = m + torch.log(s)
        logp, ent = zy - lse, torch.log(s) - b / s
        ref_logp, ref_ent = reference(h.contiguous(), w.contiguous(), y)
        torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=1e-5, msg=what + " logp")
        torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-5, msg=what + " entropy")
        # backward: d sum(logp * c) / d h, d w against autograd on the small copies
        c = torch.linspace(-1, 1, h.shape[0])
        gh, gw = tri.backward(h, w, y, lse, None, c.clone(), None, 1.0, 0, w.shape[0], 2, 64)
        hh, ww = h.contiguous().double().requires_grad_(), w.contiguous().double().requires_grad_()
        (torch.log_softmax(hh @ ww.T, -1).gather(1, y[:, None])[:, 0] * c.double()).sum().backward()
        torch.testing.assert_close(gh.double(), hh.grad, rtol=0, atol=1e-5, msg=what + " grad_hidden")
        torch.testing.assert_close(gw.double(), ww.grad, rtol=0, atol=1e-5, msg=what + " grad_weight")

    g = torch.Generator().manual_seed(9)
    if sys.argv[1] == "int64":
        rows, hid, step = 3, 16, 1 << 30
        buf = torch.empty(2 * step + 64 + hid, dtype=torch.float32)  # 8 GiB virtual; 3 rows of each are written
        w = buf.as_strided((rows, hid), (step, 1), 0)
        h = buf.as_strided((rows, hid), (step, 1), 32)
        w.copy_(torch.randn(rows, hid, generator=g))
        h.copy_(torch.randn(rows, hid, generator=g))
        assert (rows - 1) * w.stride(0) >= 2 ** 31  # the last rows start past int32
        check(h, w, torch.tensor([2, 0, 1]), "strided past 2^31")
    else:
        vocab = 2 * tri.SPLIT_V + tri.SPLIT_V // 10
        h = torch.randn(5, 16, generator=g)
        w = torch.randn(vocab, 16, generator=g) / 4
        check(h, w, torch.randint(0, vocab, (5,), generator=g), "vocab splits")
    print("KERNEL_OK", sys.argv[1])
""")


@pytest.mark.parametrize("case", ["int64", "splits"])
def test_triton_logprobs_under_interpreter(case):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, case], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0 and f"KERNEL_OK {case}" in proc.stdout, (proc.returncode, proc.stdout[-3000:])
