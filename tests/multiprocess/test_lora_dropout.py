"""LoRA dropout > 0 (`model.lora.dropout`): the passes without gradients (old log-probs, reference, values) run the
adapters in eval mode, equal to the same adapters at dropout 0 bit for bit and to peft's model in eval mode; the
update's forward (gradients) does drop (tests/multiprocess/workers/lora_dropout_worker.py). Planted by hand: the
no-gradient passes left in train mode (engine/workers/megatron_worker.py `set_training`) fails the eval check."""
import re

import pytest

from tests.helpers.common import make_tiny_hf_model, run_torchrun

FLOAT = r"(-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf)"


@pytest.mark.dist
def test_lora_dropout_only_where_gradients_flow(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", seed=4)
    out = run_torchrun("lora_dropout_worker.py", 1, hf_dir, timeout=300).stdout
    actor, critic, peft = map(float, re.search(
        rf"LORA_DROPOUT eval actor_vs_plain {FLOAT} critic_vs_plain {FLOAT} actor_vs_peft {FLOAT}", out).groups())
    gap, plain_gap = map(float, re.search(rf"LORA_DROPOUT train gap {FLOAT} plain_gap {FLOAT}", out).groups())
    print(f"dropout 0.3 in eval vs dropout 0: actor {actor:.3e}, critic {critic:.3e}; vs peft {peft:.3e}; "
          f"train-mode forward vs eval: {gap:.3e} (dropout 0: {plain_gap:.3e})")
    assert actor == critic == 0.0 and peft < 1e-5
    assert gap > 1e-3 and plain_gap <= 1e-6
