"""The policy head at the real response tokens only (MegatronWorker.token_logprobs): the same log-probs, entropy and
gradients at those tokens as the head over the whole padded [N, R] grid, zeros at padding, and the head run on exactly
the real tokens; unpacked and packed (shared prompts, padding-free), on DP2, CP2 and TP2
(tests/multiprocess/workers/response_head_check.py)."""
import re

import pytest

from tests.helpers.common import make_tiny_hf_model, run_torchrun


@pytest.mark.dist
def test_head_at_real_tokens_equals_the_full_grid(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", vocab_size=96, max_position_embeddings=128)
    out = run_torchrun("response_head_check.py", 2, hf_dir, timeout=600).stdout
    reports = set(re.findall(r"HEAD (\w+ \w+ \w+)", out))
    for layout in ("DP2", "CP2", "TP2"):
        for kind in ("plain", "shared", "rmpad"):
            for key in ("logp", "entropy", "grad_hidden", "grad_weight", "tokens"):
                assert f"{layout} {kind} {key}" in reports, out[-3000:]
