"""`tripod train` with test hooks applied in every rank: `python tests/dist/train_with_hooks.py train RECIPE k=v ...`.

The hook runs at import, so it also applies in the ranks `tripod train` spawns (multiprocessing's spawn re-imports
this script as `__mp_main__` in each child) and under torchrun: TRIPOD_TEST_PLANT=<bug> plants one bug (read only
here, never by the engine), to prove that the cross-layout equivalence check fails on it:
      lm_head_tp_split   the LM head's vocab-parallel split rule is flipped (TP rank r loads rank tp-1-r's rows)
      pp_stage_grads     the first pipeline stage's gradients are dropped before every optimizer step
"""
import os
import sys


def _flip_lm_head_split() -> None:
    import parallel.convert as convert
    from parallel.convert.common import OUTPUT_LAYER

    original = convert.tp_slice

    def tp_slice(arch, name, full, tp_size, tp_rank):
        if name == OUTPUT_LAYER:
            tp_rank = tp_size - 1 - tp_rank
        return original(arch, name, full, tp_size, tp_rank)

    convert.tp_slice = tp_slice  # load_hf_weights looks it up in parallel.convert at call time


def _drop_first_stage_grads() -> None:
    from engine.workers.megatron_worker import MegatronWorker

    original = MegatronWorker.step

    def step(self):
        if self.layout.pp > 1 and self.layout.is_first_stage:
            for p in self.module.parameters():
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.zero_()
        return original(self)

    MegatronWorker.step = step


PLANTS = {"lm_head_tp_split": _flip_lm_head_split, "pp_stage_grads": _drop_first_stage_grads}
_plant = os.environ.get("TRIPOD_TEST_PLANT")
if _plant:
    PLANTS[_plant]()

if __name__ == "__main__":
    from engine.cli import main

    sys.exit(main(sys.argv[1:]))
