"""torchrun worker (2 ranks): the memory plan's activations (parallel/activation_plan.py) against the bytes autograd
really saves in a megatron training pass on CPU.

argv: OUT_JSON NAME=HF_DIR ... For each model and each layout of the 2 ranks (PP2, 4 micro-batches under 1F1B; TP2
with sequence parallelism, 2 micro-batches), the model is built as the trainer builds it (build_gpt_model, the output
layer bypassed, tripod's log-prob kernel as the head), run forward + backward through parallel/pipeline.py, and the
peak of the tensors saved for backward (tripod.runtime.memory.SavedTensorBytes: unique storages, parameters and
buffers excluded) is taken on every rank. Rank 0 writes {name/layout: [max over ranks measured, planned,
planned with one micro-batch in flight]} to OUT_JSON.
"""
import json
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker

ROWS, SEQ = 2, 32
LAYOUTS = {"pp2": dict(tp=1, pp=2, sequence_parallel=False, microbatches=4),
           "tp2sp": dict(tp=2, pp=1, sequence_parallel=True, microbatches=2)}


def measure(hf_dir: str, tp: int, pp: int, sequence_parallel: bool, microbatches: int) -> tuple[int, int, int]:
    from tripod.kernels import logprobs_from_hidden
    from tripod.parallel.activation_plan import ActivationLayout, activation_bytes
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.megatron_patches.gpt_model import bypass_output_layer
    from tripod.parallel.model import build_gpt_model
    from tripod.parallel.pipeline import run_pipeline
    from tripod.runtime.memory import SavedTensorBytes

    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(tp=tp, pp=pp, name="actor", arch=arch)
    model = build_gpt_model(arch, layout, sequence_parallel=sequence_parallel)
    sp = model.config.sequence_parallel
    if layout.is_last_stage:
        bypass_output_layer(model, layout.tp_group)
    g = torch.Generator().manual_seed(11)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    mbs = [dict(input_ids=torch.randint(3, arch.vocab_size, (ROWS, SEQ), generator=g),
                labels=torch.randint(3, arch.vocab_size, (ROWS * SEQ,), generator=g)) for _ in range(microbatches)]

    def forward_step(mb, chunk):
        pos = torch.arange(SEQ).unsqueeze(0).expand(ROWS, SEQ)
        out = chunk(input_ids=mb["input_ids"], position_ids=pos, attention_mask=mask)

        def loss_fn(hidden):
            logp, _ = logprobs_from_hidden(hidden.reshape(-1, hidden.shape[-1]), chunk.output_layer.weight,
                                           mb["labels"], tp_group=layout.tp_group if tp > 1 else None,
                                           with_entropy=False, vocab_size=arch.vocab_size,
                                           reduce_hidden_grad=not sp)
            loss = -logp.mean()
            return loss, {"loss": loss.detach()}
        return out, loss_fn

    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    with SavedTensorBytes(exclude) as saved:
        run_pipeline([model], layout, mbs, forward_step, forward_only=False, seq_length=SEQ, micro_batch_size=ROWS)
    peak = torch.tensor([saved.peak], dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    lay = ActivationLayout(tp=tp, pp=pp, sequence_parallel=sp)
    planned = activation_bytes(arch, tp, pp, ROWS, SEQ, torch.float32, num_microbatches=microbatches, layout=lay)
    one = activation_bytes(arch, tp, pp, ROWS, SEQ, torch.float32, num_microbatches=1, layout=lay)
    return int(peak.item()), planned, one


def main() -> None:
    out, models = sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:])
    results = {}
    for name, hf_dir in models.items():
        for lname, kw in LAYOUTS.items():
            measured, planned, one = measure(hf_dir, **kw)
            results[f"{name}/{lname}"] = [measured, planned, one]
            if dist.get_rank() == 0:
                print(f"ACTIVATIONS {name} {lname} measured {measured} planned {planned} "
                      f"(ratio {planned / measured:.3f}); one micro-batch in flight {one}", flush=True)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    dist_worker(main)
