"""torchrun worker (4 ranks): a TP2xPP2 train step with sequence parallel, full activation recomputation and
the distributed optimizer, under the cpu_compat trace. Prints every megatron call site a shim caught
(`TRACED shim file:line function`) and `UNEXPECTED ...` for sites not in ALLOWED_CALL_SITES."""
import sys

import torch
import torch.nn.functional as F

from tests.helpers.common import dist_worker
from tests.multiprocess.workers.common_layout_train import train_step, wrap_for_training


def main() -> None:
    from tests.helpers.model_forward import gather_vocab_logits
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import load_hf_weights
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.megatron_patches import cpu_compat
    from tripod.parallel.model import build_gpt_model, causal_attention_mask

    assert cpu_compat.cpu_compat_applied() and cpu_compat.apply_cpu_compat(trace=True)  # idempotent
    arch = arch_from_hf(sys.argv[1])
    layout = ParallelLayout(tp=2, pp=2, name="actor", arch=arch)
    model = build_gpt_model(arch, layout, sequence_parallel=True, recompute_granularity="full",
                            recompute_method="uniform", recompute_num_layers=1)
    load_hf_weights(model, sys.argv[1], arch, layout)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, arch.vocab_size, (2, 16), generator=g)
    labels = torch.randint(3, arch.vocab_size, (2, 16), generator=g)
    ddp, opt = wrap_for_training(model, layout, distributed_optimizer=True)
    batch = dict(input_ids=ids, position_ids=torch.arange(16).expand(2, 16), attention_mask=causal_attention_mask(16))
    for step in range(2):
        loss, norm = train_step(ddp, opt, layout, batch, lambda out: F.cross_entropy(
            gather_vocab_logits(out, layout, arch.vocab_size).flatten(0, 1), labels.flatten()))
        print(f"CANARY_STEP {step} loss {loss} grad_norm {norm:.6f}", flush=True)
        assert torch.isfinite(torch.tensor(norm)) and norm > 0
    for (shim, path, fn), line in sorted(cpu_compat.traced_call_sites().items()):
        print(f"TRACED {shim} {path}:{line} {fn}", flush=True)
    for site in cpu_compat.unexpected_call_sites():
        print(f"UNEXPECTED {site}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
