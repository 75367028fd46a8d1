"""Host offload between phases (runtime/offload.py), on CPU where it records its moves and touches nothing: the
state after each phase of two PPO steps against verl's semantics written out by hand, the moves a CUDA run would
make (in order: host-bound first), and the bad-input line for offload keys on a CPU run."""
import pytest

from tripod.runtime.offload import DEVICE as D
from tripod.runtime.offload import HOST as H
from tripod.runtime.offload import Move, OffloadFlags, OffloadManager

# the trainer's order (engine/trainer.py train_step): a GAE step with the old log-probs recomputed, then a save
STEP = ["rollout", "old_log_prob", "ref", "values", "update_critic", "update_actor"]
ALL = OffloadFlags(params=True, grads=True, optim=True)
FLAGS = {"actor": ALL, "critic": OffloadFlags(optim=True), "reference": OffloadFlags(params=True)}

# verl (megatron_workers.py): a model's params are on the GPU only inside the calls that compute with them
# (generate_sequences / compute_log_prob / compute_ref_log_prob / compute_values / update_*); grads and optimizer
# states only inside its update. Columns: actor params, grads, optim | critic params, grads, optim | ref params.
EXPECTED = {
    "idle":          (H, H, H, D, D, H, H),
    "rollout":       (D, H, H, D, D, H, H),
    "old_log_prob":  (D, H, H, D, D, H, H),
    "ref":           (H, H, H, D, D, H, D),
    "values":        (H, H, H, D, D, H, H),
    "update_critic": (H, H, H, D, D, D, H),
    "update_actor":  (D, D, D, D, D, H, H),
    "checkpoint":    (D, H, D, D, D, D, H),  # gradients are not saved: they stay on the host
}


def _row(where):
    a, c, r = where["actor"], where["critic"], where["reference"]
    return (a["params"], a["grads"], a["optim"], c["params"], c["grads"], c["optim"], r["params"])


def _never_called(model, kind):
    def move(to):
        raise AssertionError(f"a CPU run moved {model}.{kind} to {to}")
    return move


def test_state_after_each_phase_of_two_steps_on_cpu_records_only():
    movers = {m: {k: _never_called(m, k) for k in ("params", "grads", "optim")} for m in FLAGS}
    mgr = OffloadManager(FLAGS, movers, execute=False)
    for phase in STEP + ["checkpoint"]:
        mgr.enter(phase)
    before_second = len(mgr.moves)
    for phase in STEP:
        mgr.enter(phase)
    assert [p for p, _ in mgr.history] == ["idle"] + STEP + ["checkpoint"] + STEP
    for phase, where in mgr.history:
        assert _row(where) == EXPECTED[phase], phase
    # the save left the optimizer states on the device: the next rollout sends back what it does not use
    assert [m for m in mgr.moves[before_second:] if m.phase == "rollout"] == [
        Move("rollout", "actor", "optim", H), Move("rollout", "critic", "optim", H)]


def test_cuda_moves_happen_in_order_host_bound_first():
    calls = []
    movers = {m: {k: (lambda to, m=m, k=k: calls.append((m, k, to))) for k in ("params", "grads", "optim")}
              for m in FLAGS}
    mgr = OffloadManager(FLAGS, movers, execute=True)
    assert calls == [("actor", "params", H), ("actor", "grads", H), ("actor", "optim", H), ("critic", "optim", H),
                     ("reference", "params", H)]  # at build: everything offloadable leaves the device
    calls.clear()
    for phase in STEP:
        mgr.enter(phase)
    assert calls == [("actor", "params", D),                                   # rollout
                     ("actor", "params", H), ("reference", "params", D),       # ref: actor's leave first
                     ("reference", "params", H),                               # values
                     ("critic", "optim", D),                                   # update_critic
                     ("critic", "optim", H), ("actor", "params", D), ("actor", "grads", D), ("actor", "optim", D)]
    assert [(m.model, m.kind, m.to) for m in mgr.moves[5:]] == calls  # every call recorded, nothing else


def test_nothing_moves_without_offload_keys():
    flags = {m: OffloadFlags() for m in FLAGS}
    mgr = OffloadManager(flags, {m: {} for m in flags}, execute=True)
    for phase in STEP:
        mgr.enter(phase)
    assert mgr.moves == [] and all(v == D for _, w in mgr.history for k in w.values() for v in k.values())


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.megatron.param_offload",
                                 "actor_rollout_ref.actor.megatron.grad_offload",
                                 "critic.megatron.optimizer_offload", "actor_rollout_ref.ref.megatron.param_offload"])
def test_offload_keys_on_a_cpu_run_are_one_line_naming_the_key(key):
    from tripod.engine.config import ConfigError, load_config
    from tripod.engine.config_validation import validate_config

    cfg = load_config(None, [f"{key}=true", "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true"])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, 1)
    lines = [line for line in str(e.value).splitlines() if key in line]
    assert len(lines) == 1 and "trainer.device=cpu" in lines[0] and "set it to false" in lines[0]


def test_grads_or_optimizer_offload_of_the_reference_is_refused():
    from tripod.engine.config import ConfigError, load_config
    from tripod.engine.config_validation import validate_config

    cfg = load_config(None, ["actor_rollout_ref.ref.megatron.grad_offload=true", "trainer.device=cuda",
                             "algorithm.use_kl_in_reward=true"])
    with pytest.raises(ConfigError, match=r"ref.megatron.grad_offload=True has no effect on a frozen model"):
        validate_config(cfg, 1)
