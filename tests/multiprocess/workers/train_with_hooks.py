"""`tripod train` with test hooks applied in every rank: `python tests/multiprocess/workers/train_with_hooks.py train RECIPE k=v ...`.

The hook runs at import, so it also applies in the ranks `tripod train` spawns (multiprocessing's spawn re-imports
this script as `__mp_main__` in each child) and under torchrun: TRIPOD_TEST_PLANT=<bug> plants one bug (read only
here, never by the engine), to prove that the cross-layout equivalence check fails on it:
      lm_head_tp_split   the LM head's vocab-parallel split rule is flipped (TP rank r loads rank tp-1-r's rows)
      pp_stage_grads     the first pipeline stage's gradients are dropped before every optimizer step
      expert_dp_grads    routed-expert gradients are summed over expert-DP instead of averaged (x edp)
      adam_step_shared   a resumed distributed optimizer keeps megatron's one shared Adam `step` tensor (the bug
                         engine/checkpoints/optimizer_state.py's _unshare_adam_steps fixes)
      adam_exp_avg_sq_on_load   a resumed optimizer's exp_avg_sq is zeroed after loading
      expert_bias_frozen the router's expert-bias update (megatron's finalize_model_grads step) does nothing
      sp_value_grad      the critic's value head sums its sequence-parallel gradient over TP instead of splitting it
                         (every TP rank already holds the full gradient: a TP-fold over-count)
      vpp_drop_chunk_grad  the gradients of the first virtual-pipeline chunk are dropped before each optimizer step
      cp_sum_grad        context parallelism's per-token sum over CP ranks all-reduces its gradient too (every CP
                         rank then back-propagates every token: a CP-fold over-count)
      scored_batch_loses_token_codes  the rollout's own ranks send their scored batches without the multi-turn token
                         codes, so the trainer trains the tool and user tokens (tests/multiprocess/test_matrix.py)
      replay_layer_shift routing replay (R2 / R3) hands MoE layer i the recorded ids of layer i-1
      lora_eager_merge   the LoRA rollout sync merges every adapted weight up front instead of a bucket at a time
      lora_export_alpha  adapters rebuilt from a checkpoint get twice the saved alpha (export --lora / --merge)
      lora_plan_base_trained  the memory plan counts a LoRA model's frozen base as trained (grads, optimizer states)
`plant(bug)` / `unplant()` do the same in-process for one command of a world that runs several
(tests/multiprocess/workers/tripod_commands.py): every plant only replaces attributes, and `unplant` puts the originals back.
TRIPOD_TEST_OFFLOAD_RECORD=<path> turns every offload kind of every model on inside runtime/offload.py's manager (a CPU
run refuses the keys themselves; there the manager only records) and appends rank 0's placement after each phase the
trainer enters to <path>, one JSON line each.
"""
import os
import sys

_REPLACED: list[tuple[object, str, object]] = []  # (owner, attribute, original) of the planted bug, in order


def _patch(owner: object, attr: str, value: object) -> None:
    _REPLACED.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, value)


def _flip_lm_head_split() -> None:
    from tripod.parallel.families.spec import OUTPUT_LAYER, FamilySpec

    original = FamilySpec.shard

    def shard(self, arch, name, full, tp, rank):
        if name == OUTPUT_LAYER:
            rank = tp - 1 - rank
        return original(self, arch, name, full, tp, rank)

    _patch(FamilySpec, "shard", shard)  # the one split implementation every loader reads (parallel/families/spec.py)


def _drop_first_stage_grads() -> None:
    from tripod.engine.workers.megatron_worker import MegatronWorker

    original = MegatronWorker.step

    def step(self):
        if self.layout.pp > 1 and self.layout.is_first_stage:
            for p in self.module.parameters():
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.zero_()
        return original(self)

    _patch(MegatronWorker, "step", step)


def _sum_expert_dp_grads() -> None:
    from tripod.engine.workers.megatron_worker import MegatronWorker

    original = MegatronWorker.step

    def step(self):
        edp = self.layout.edp
        if edp > 1:
            for p in self.module.parameters():  # megatron marks expert parameters allreduce=False
                if not getattr(p, "allreduce", True) and getattr(p, "main_grad", None) is not None:
                    p.main_grad.mul_(edp)
        return original(self)

    _patch(MegatronWorker, "step", step)


def _share_adam_step() -> None:
    from tripod.engine.checkpoints import optimizer_state

    _patch(optimizer_state, "_unshare_adam_steps", lambda optimizer: None)


def _zero_exp_avg_sq_on_load() -> None:
    from tripod.engine.checkpoints import optimizer_state

    original = optimizer_state.load_optimizer

    def load(worker, path):
        original(worker, path)
        for inner in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
            for state in inner.optimizer.state.values():
                state["exp_avg_sq"].zero_()

    _patch(optimizer_state, "load_optimizer", load)


def _freeze_expert_bias() -> None:
    import importlib

    # the module, not the function megatron.core.distributed re-exports under the same name; finalize_model_grads
    # looks the helper up in its module globals at call time
    module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    _patch(module, "_update_router_expert_bias", lambda model, config: None)


def _sum_sp_value_grad() -> None:
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    from tripod.parallel.model import ValueHead

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=self.tp_group)
        return F.linear(hidden, self.weight, self.bias), None

    _patch(ValueHead, "forward", forward)


def _drop_first_chunk_grads() -> None:
    import torch

    from tripod.engine.workers.megatron_worker import MegatronWorker

    original = MegatronWorker.step

    def step(self):
        if len(self.model) > 1:
            with torch.no_grad():
                for p in self.model[0].parameters():
                    p.main_grad.zero_()
        return original(self)

    _patch(MegatronWorker, "step", step)


def _record_offload(path: str) -> None:
    import json

    from tripod.runtime import offload

    init, enter = offload.OffloadManager.__init__, offload.OffloadManager.enter

    def all_on(self, flags, movers, execute):
        on = {m: offload.OffloadFlags(True, m != "reference", m != "reference") for m in flags}
        init(self, on, movers, execute)

    def recorded(self, phase):
        enter(self, phase)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(path, "a") as f:
                f.write(json.dumps({"phase": phase, "where": self.where, "execute": self.execute}) + "\n")

    offload.OffloadManager.__init__, offload.OffloadManager.enter = all_on, recorded


def _sum_cp_grad() -> None:
    import torch
    import torch.distributed as dist

    import tripod.engine.workers.megatron_worker as worker

    class SumBoth(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            out = x.contiguous().clone()
            dist.all_reduce(out, group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    _patch(worker, "sum_over_cp", lambda x, group: SumBoth.apply(x, group))


def _version_off_by_one() -> None:
    """The staleness schedule hands every batch after the first the weights one step older than it says."""
    from tripod.engine.async_rollout.schedule import StalenessSchedule

    original = StalenessSchedule.version_for
    _patch(StalenessSchedule, "version_for", lambda self, batch: max(0, original(self, batch) - 1))


def _rollout_dies() -> None:
    """The first rollout rank's process dies while generating batch 2 (after batches 0 and 1 were sent)."""
    import tripod.engine.async_rollout.server as server

    original = server.ScoredBatch.to_wire

    def to_wire(self):
        if self.batch == 2:
            os._exit(17)
        return original(self)
    _patch(server.ScoredBatch, "to_wire", to_wire)


def _routing_rows_not_kept() -> None:
    """Dynamic sampling keeps some groups' rows, but the routed experts of the first rows (R3's record unselected)."""
    from tripod.engine.rollout.rows import Rollout

    original = Rollout.groups

    def groups(self, keep, n):
        out = original(self, keep, n)
        if self.routed_experts is not None:
            out.routed_experts = self.routed_experts[: len(out.responses)]
        return out
    _patch(Rollout, "groups", groups)


def _stale_rollout_weights() -> None:
    """The rollout ranks receive every weight version after the first but never load it (the engine keeps generating
    with the initial weights while the batches say otherwise)."""
    from tripod.engine.async_rollout.weights import WeightReceiver

    original = WeightReceiver.receive

    class Nowhere:
        def weight_buffers(self):
            return None

        def load_weights(self, shard):
            pass

    def receive(self, engine):
        first = not getattr(self, "_planted_loaded", False)
        self._planted_loaded = True
        return original(self, engine if first else Nowhere())
    _patch(WeightReceiver, "receive", receive)


def _slow_decode() -> None:
    """Not a bug: every decode step of the embedded engine sleeps 0.25 s, so a partial rollout's weight version lands
    while a batch is still being generated (tests/multiprocess/test_async.py)."""
    import time

    import tripod.engine.rollout.embedded as embedded

    original = embedded.sample_next_token

    def slow(*args, **kwargs):
        time.sleep(0.25)
        return original(*args, **kwargs)
    _patch(embedded, "sample_next_token", slow)


def _slow_checkpoint_write() -> None:
    """Not a bug: an asynchronous checkpoint write of step 3 or later waits 120 s before it writes, so a test can kill
    the run while the write is in flight (tests/multiprocess/test_trainer.py)."""
    import threading
    import time

    from tripod.engine.checkpoints import manager

    original = manager._InFlight.write

    def slow(self):
        if self.step >= 3 and threading.current_thread() is not threading.main_thread():
            time.sleep(120)
        original(self)
    _patch(manager._InFlight, "write", slow)


def _slow_checkpoint_delete() -> None:
    """Not a bug: deleting an old checkpoint's actor optimizer state (its actor weights already gone) waits 120 s, so a
    test can kill the run half-way through deleting a checkpoint (tests/multiprocess/test_trainer.py)."""
    import time

    from tripod.engine.checkpoints import retention

    original = retention._remove_tree

    def slow(path):
        if path.endswith("actor_optim" + retention.DELETING):
            time.sleep(120)
        original(path)
    _patch(retention, "_remove_tree", slow)


def _shift_replayed_layers() -> None:
    """Replay hands each MoE layer the ids its batch recorded for the layer before (the record's layer axis rolled by
    one); the mismatch is still counted against the record as it is (on every PP stage and virtual chunk alike)."""
    import torch

    from tripod.parallel.router_replay import RoutingReplay

    original = RoutingReplay.before

    def before(self, model, mb, rows, seq, slots):
        ids = mb.tensors.get(self.replay_key) if self.mode == "replay" else None
        if ids is None:
            return original(self, model, mb, rows, seq, slots)
        kept = dict(mb.tensors)
        mb.tensors.setdefault(self.reference_key, ids)
        mb.tensors[self.replay_key] = torch.roll(ids, 1, dims=2)  # [N, S, layers, k]: layer i gets layer i-1's ids
        try:
            original(self, model, mb, rows, seq, slots)
        finally:
            mb.tensors.clear()
            mb.tensors.update(kept)
    _patch(RoutingReplay, "before", before)


def _merge_eagerly() -> None:
    from tripod.parallel.lora import merge

    original = merge.merged_shard

    def merged_shard(*args, **kwargs):
        shard = original(*args, **kwargs)
        return {n: v[:] if isinstance(v, merge.MergedWeight) else v for n, v in shard.items()}
    _patch(merge, "merged_shard", merged_shard)  # read by the hybrid engine at call time


def _double_export_alpha() -> None:
    from tripod.parallel.lora import checkpoint

    original = checkpoint.attach_saved_adapters
    _patch(checkpoint, "attach_saved_adapters",
           lambda chunks, arch, saved: original(chunks, arch, {**saved, "alpha": 2 * float(saved["alpha"])}))


def _count_lora_base_as_trained() -> None:
    from tripod.parallel.memory_plan import ModelMemory

    original = ModelMemory.optimizer_rows

    def optimizer_rows(self, dense, expert, pbytes):
        if self.lora:
            dense, expert = dense + self.numel - self.expert_numel, expert + self.expert_numel
        return original(self, dense, expert, pbytes)
    _patch(ModelMemory, "optimizer_rows", optimizer_rows)


def _scored_batch_loses_token_codes() -> None:
    """The scored batch the rollout's own ranks send loses its token codes on the wire (engine/async_rollout/
    messages.py): the trainer then takes a multi-turn row for a single-turn one and trains its tool and user tokens
    (tests/multiprocess/test_matrix.py)."""
    import dataclasses

    from tripod.engine.async_rollout.messages import ScoredBatch

    original = ScoredBatch.to_wire
    _patch(ScoredBatch, "to_wire", lambda self: original(dataclasses.replace(self, token_codes=None)))


def _async_rows_to_every_rank() -> None:
    """(issue 46) Every trainer rank asks the rollout for every row of the batch instead of the rows it trains (the
    old broadcast of the whole batch): results are the same, the bytes each rank receives are not its plan's."""
    import tripod.engine.async_rollout.source as source

    _patch(source, "_rows_to_request", lambda planned: None)


def _weight_digests(bug: str = "") -> None:
    """(issue 46) Not a bug by itself: buckets of 16 KiB (several a shard) and, in $TRIPOD_TEST_DIGESTS/<name>/, a
    sha256 per tensor of every weight version each trainer rank gathered for its rollout TP slice and of what each
    rollout rank loaded (tests/multiprocess/test_async_scale.py compares them). `bug`: "offset" shifts every received
    bucket by one element; "skip": rollout replica 1 keeps the first weights it loaded (the push never reaches its
    engine)."""
    import hashlib
    import json

    import torch
    import torch.distributed as dist

    import tripod.engine.async_rollout.weights as weights

    out = os.path.join(os.environ["TRIPOD_TEST_DIGESTS"], bug or "clean")
    os.makedirs(out, exist_ok=True)

    def digest(shard):
        return {n: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                  ).hexdigest() for n, t in shard.items()}
    _patch(weights, "BUCKET_BYTES", 16 << 10)
    push, receive, unflatten = weights.WeightPusher.push, weights.WeightReceiver.receive, weights.unflatten_bucket

    def pushed(self, actor_model, version):
        gather = self.hybrid.to_rollout

        def recorded(model):
            shard = gather(model)
            with open(os.path.join(out, f"trainer_v{version}_slice{self.slice}_rank{dist.get_rank()}.json"), "w") as f:
                json.dump(digest(shard), f)
            return shard
        self.hybrid.to_rollout = recorded
        try:
            return push(self, actor_model, version)
        finally:
            del self.hybrid.to_rollout

    class Recording:
        """The engine, recording what it loads; with the "skip" plant, replica 1 receives every version after its
        first but keeps its weights (and records the ones it kept)."""
        last: dict = {}

        def __init__(self, engine, skip: bool):
            self.engine, self.loaded, self.skip = engine, None, skip

        def weight_buffers(self):
            return None if self.skip else self.engine.weight_buffers()

        def load_weights(self, buffers):
            if self.skip and Recording.last:
                self.loaded = Recording.last
                return
            self.loaded = Recording.last = digest(buffers)
            self.engine.load_weights(buffers)

    def received(self, engine):
        wrapped = Recording(engine, bug == "skip" and dist.get_rank() // self.plan.rollout_tp == 1)
        version, idle, sync = receive(self, wrapped)
        tp, rank = self.plan.rollout_tp, dist.get_rank()
        with open(os.path.join(out, f"rollout_v{version}_slice{rank % tp}_replica{rank // tp}.json"), "w") as f:
            json.dump(wrapped.loaded, f)
        return version, idle, sync

    def unflatten_planted(flat, names, shapes, buffers):
        unflatten(flat.roll(1) if bug == "offset" else flat, names, shapes, buffers)
    _patch(weights.WeightPusher, "push", pushed)
    _patch(weights.WeightReceiver, "receive", received)
    _patch(weights, "unflatten_bucket", unflatten_planted)


PLANTS = {"slow_checkpoint_delete": _slow_checkpoint_delete, "routing_rows_not_kept": _routing_rows_not_kept,
          "slow_checkpoint_write": _slow_checkpoint_write, "slow_decode": _slow_decode, "rollout_weights_stale": _stale_rollout_weights, "async_version_off_by_one": _version_off_by_one, "rollout_rank_dies": _rollout_dies,
          "lm_head_tp_split": _flip_lm_head_split, "pp_stage_grads": _drop_first_stage_grads,
          "expert_dp_grads": _sum_expert_dp_grads, "adam_step_shared": _share_adam_step,
          "adam_exp_avg_sq_on_load": _zero_exp_avg_sq_on_load, "expert_bias_frozen": _freeze_expert_bias,
          "sp_value_grad": _sum_sp_value_grad, "vpp_drop_chunk_grad": _drop_first_chunk_grads,
          "cp_sum_grad": _sum_cp_grad, "replay_layer_shift": _shift_replayed_layers, "lora_eager_merge": _merge_eagerly,
          "lora_export_alpha": _double_export_alpha, "lora_plan_base_trained": _count_lora_base_as_trained,
          "scored_batch_loses_token_codes": _scored_batch_loses_token_codes,
          "async_rows_to_every_rank": _async_rows_to_every_rank, "weight_digests": _weight_digests,
          "weight_digests_bucket_offset": lambda: _weight_digests("offset"),
          "weight_digests_replica_skipped": lambda: _weight_digests("skip")}


def plant(bug: str) -> None:
    """Plant one bug of PLANTS in this process (undone by `unplant`)."""
    if bug not in PLANTS:
        raise ValueError(f"unknown planted bug {bug!r}; use one of {sorted(PLANTS)}")
    assert not _REPLACED, "a planted bug is in place already: unplant() it first"
    PLANTS[bug]()


def unplant() -> None:
    """Put back every attribute the planted bug replaced."""
    while _REPLACED:
        owner, attr, original = _REPLACED.pop()
        setattr(owner, attr, original)


if os.environ.get("TRIPOD_TEST_PLANT"):
    plant(os.environ["TRIPOD_TEST_PLANT"])
if os.environ.get("TRIPOD_TEST_OFFLOAD_RECORD"):
    _record_offload(os.environ["TRIPOD_TEST_OFFLOAD_RECORD"])

if __name__ == "__main__":
    from tripod.engine.cli import main

    sys.exit(main(sys.argv[1:]))
