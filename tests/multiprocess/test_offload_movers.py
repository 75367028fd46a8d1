"""runtime/offload.py's movers executed on CPU (tests/multiprocess/workers/offload_movers_worker.py; the stand-in for
the device side is described there and in docs/operating.md): over two PPO steps with every offload kind on, each
kind the manager puts on the host has released its device storage (0 bytes), params and optimizer states come back
bit for bit, gradients come back zeroed, log-probs, weights and optimizer states equal a twin's that never offloads,
and the bytes released per kind are the memory plan's: the actor in bf16 / fp32 with and without the distributed
optimizer (param_offload without it moves each parameter's own storage), and the frozen reference.
scripts/gpu_check.py runs the same worker on CUDA (its `offload` step)."""
import json

import pytest

from tests.helpers.common import make_tiny_hf_model, run_torchrun

CASES = ["actor_bf16_distopt", "actor_fp32_distopt", "actor_bf16_plain", "actor_fp32_plain", "reference"]


@pytest.mark.dist
def test_movers_release_restore_and_leave_the_update_unchanged(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", seed=3, num_hidden_layers=2)
    out = run_torchrun("offload_movers_worker.py", 1, hf_dir, timeout=600).stdout
    rows = [json.loads(line[len("OFFLOAD "):]) for line in out.splitlines() if line.startswith("OFFLOAD ")]
    assert [r["case"] for r in rows] == CASES, out[-3000:]
    for r in rows:
        trained = r["case"] != "reference"
        assert r["device"] == "cpu" and r["phases"] == (1 + 2 * 7 if trained else 1 + 2 * 2), r
        # kinds that came back over two steps: the actor's params at the first rollout (the save before the second
        # keeps them on the device), params + grads + optim at each update: 1 + 3 + 3; the reference's params twice
        assert r["released_checks"] > 0 and r["reload_checks"] == (7 if trained else 2), r
        assert r["twin_max_diff"] == 0.0, r  # CPU: bit for bit (also asserted tensor by tensor in the worker)
        assert set(r["released"]) == ({"params", "grads", "optim"} if trained else {"params"}), r
        # the plan's bytes: exact without the distributed optimizer, else up to megatron's padding (the worker's)
        assert all(r["padding"][k] == 0 for k in r["padding"]) == ("distopt" not in r["case"]), r
        for kind, planned in r["plan"].items():
            extra = r["released"][kind] - planned
            assert planned > 0 and 0 <= extra <= r["padding"][kind], (r["case"], kind, r["released"], r["plan"])
