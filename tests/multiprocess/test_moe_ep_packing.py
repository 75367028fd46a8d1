"""An MoE actor at EP2 across two DP ranks with shared-prompt packing on (the default): megatron's allgather token
dispatcher needs one [rows, seq] per micro-batch over the EP group, which each DP rank's own packing does not give
(gloo: "Received data size doesn't match expected size"). MegatronWorker.run agrees on it (engine/workers/moe_shapes.py);
the padded rows and slots change no log-prob, loss or gradient (against the same actor unpacked), token-budget
micro-batch counts are agreed, and unequal counts stop every rank with one line
(tests/multiprocess/workers/moe_ep_packing_check.py)."""
import re

import pytest


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    from tests.helpers.common import run_torchrun
    from tests.helpers.moe_models import hf_moe_model

    out = str(tmp_path_factory.mktemp("moe_ep_packing") / "qwen3_moe")
    hf_moe_model("qwen3_moe", 3).save_pretrained(out, safe_serialization=True)
    return run_torchrun("moe_ep_packing_check.py", 2, out, timeout=600).stdout


def test_ep2_packed_equals_unpacked(output):
    assert "EPPACK-OK" in output, output[-3000:]
    diffs = dict(re.findall(r"^EPPACK (\w+) (\S+)$", output, re.M))
    assert set(diffs) == {"logp_micro4", "logp_micro2", "logp_budget", "pg_loss", "grad_norm"}, output[-3000:]
    assert "EPPACK refused:" in output
