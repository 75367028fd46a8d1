"""torchrun worker (3 ranks): uneven pipeline stages, megatron's num_layers_in_first/last_pipeline_stage, at PP3.

argv: CASE_PT FIRST LAST OUT_DIR — CASE_PT holds {"hf_dir", "input_ids", "ref_logits", "layers"} (a 7-layer model,
transformers' logits, the expected global layer ids of each stage). One PP3 layout over the 3 ranks:
  1. each stage builds exactly its layers (global numbering), logits == transformers (1e-5);   UNEVEN_PARITY
  2. HF -> megatron -> HF: save_hf_checkpoint gives back the original tensors bit for bit;     UNEVEN_HF_ROUNDTRIP
  3. a dist checkpoint saved at PP3 2/3/2 loads at PP1 (DP3) with the same logits;             UNEVEN_CKPT
  4. the hybrid engine around a PolicyWorker at this layout (hybrid_actor_roundtrip.round_trip): generation shard ==
     HF, embedded greedy decode == transformers, rollout log-probs == actor's, training unaffected.   OK rollout_tp=1
"""
import os
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker

TOLERANCE = 1e-5


def main() -> None:
    from safetensors.torch import load_file

    from tests.helpers.model_forward import forward_logits
    from tests.multiprocess.workers.hybrid_actor_roundtrip import round_trip
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.checkpoint import load_model_checkpoint, read_checkpoint_metadata, save_model_checkpoint
    from tripod.parallel.convert import load_hf_weights, save_hf_checkpoint
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.model import build_gpt_model

    case = torch.load(sys.argv[1])
    first, last, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    hf_dir, me = case["hf_dir"], dist.get_rank()
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(pp=3, name="actor", arch=arch, first_stage_layers=first, last_stage_layers=last)
    whole = ParallelLayout(tp=1, pp=1, name="pp1")  # DP3: every rank holds every layer

    # 1. megatron builds this stage's layers; logits match transformers
    model = build_gpt_model(arch, layout)
    built = [layer.layer_number - 1 for layer in model.decoder.layers]
    assert not load_hf_weights(model, hf_dir, arch, layout)
    logits = forward_logits(model, layout, case["input_ids"])
    if layout.is_last_stage:
        diff = (logits - case["ref_logits"]).abs().max().item()
        print(f"UNEVEN_PARITY stages {layout.stage_split(arch.num_layers).describe()} maxdiff {diff:.3e}", flush=True)
        assert diff < TOLERANCE, diff
    assert built == case["layers"][layout.pp_rank] == layout.stage_layers(arch.num_layers), (me, built)

    # 2. HF -> megatron (above) -> HF
    hf_out = os.path.join(out, "hf_roundtrip")
    save_hf_checkpoint(model, arch, layout, hf_out)
    dist.barrier()
    if me == 0:
        want, got = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(os.path.join(hf_out, "model.safetensors"))
        assert set(want) == set(got), sorted(set(want) ^ set(got))
        differ = [n for n in want if not torch.equal(want[n], got[n])]
        assert not differ, differ[:6]
        print(f"UNEVEN_HF_ROUNDTRIP {len(want)} tensors bit-identical", flush=True)

    # 3. dist checkpoint at PP3 2/3/2 -> PP1
    ckpt = os.path.join(out, "ckpt")
    save_model_checkpoint(model, ckpt, arch, layout)
    saved = read_checkpoint_metadata(ckpt)["saved_layout"]
    assert (saved["num_layers_in_first_pipeline_stage"], saved["num_layers_in_last_pipeline_stage"]) == (first, last)
    flat = build_gpt_model(arch, whole)
    load_model_checkpoint(flat, ckpt, whole)
    diff = (forward_logits(flat, whole, case["input_ids"]) - case["ref_logits"]).abs().max().item()
    print(f"UNEVEN_CKPT rank {me} PP3->PP1 maxdiff {diff:.3e}", flush=True)
    assert diff < TOLERANCE, diff
    del model, flat

    # 4. the hybrid engine and the embedded decoder around an actor on the uneven layout
    round_trip(hf_dir, arch, layout, 1, label=f"pp3-{first}/{arch.num_layers - first - last}/{last}")


if __name__ == "__main__":
    dist_worker(main)
