"""The rollout ranks' loop: for each batch the staleness schedule admits, take the weights it needs, generate, score,
send it to the trainer's queue.

    start message (trainer rank 0): the resumed step, the first batch to generate, the loader's position, the run
    for i in first .. total - 1:
        receive weight versions until the one schedule.version_for(i) names is loaded  (rollout idle, weight sync)
        draw the batch's prompts (dynamic sampling: as many generation batches as it takes), generate them over the
        rollout replicas (TP groups of actor_rollout_ref.rollout.tensor_model_parallel_size); the scorer thread
        scores them with the rule rewards while the next batch is generated, rollout rank 0 posts the scored batch
        to trainer rank 0
    the trainer's end header: done (an end message tells trainer rank 0); a RESTART header instead (a divergence-guard
    rollback): wait for the next start message

The rollout world is its own torch.distributed world (engine/async_rollout/bridge.py). Its parts are the trainer's
(engine/components.py): the same generator (single-turn, or the agent loop with the prompts' tools), so the rows move
between its replicas and the rule scores are shared exactly as in a colocated rollout (engine/rollout/generators.py,
engine/rewards/scorer.py); a reward model scores on the trainer's ranks when the batch arrives. The engine keeps its
weights and KV cache between batches: nothing here trains.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tripod.engine.async_rollout.bridge import Placement, recv
from tripod.engine.async_rollout.messages import ScoredBatch, send_batch, send_end
from tripod.engine.async_rollout.rows import RowServer
from tripod.engine.async_rollout.schedule import StalenessSchedule
from tripod.engine.async_rollout.weights import Restart, WeightReceiver


class RolloutServer:
    """One rollout rank of a run whose rollout has ranks of its own (see the module docstring)."""

    def __init__(self, cfg, placement: Placement):
        from tripod.engine.components import build_components
        from tripod.engine.rollout.generators import RolloutReplicas
        from tripod.parallel.hybrid_engine.plan import reshard_plan_from_config
        from tripod.runtime.device import current_device

        self.cfg, self.placement = cfg, placement
        if cfg.trainer.threads_per_rank > 0:
            torch.set_num_threads(cfg.trainer.threads_per_rank)
        self.rank, self.world, self.device = dist.get_rank(), dist.get_world_size(), current_device()
        tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        self.parts = parts = build_components(cfg, "rollout")
        self.arch, self.tokenizer, self.loader, self.sampler = parts.arch, parts.tokenizer, parts.loader, parts.sampler
        self.replicas = RolloutReplicas.of_world(self.world, self.rank, tp)
        self.score_group = dist.new_group(list(range(self.world)))  # the scorer thread's own: never beside another op
        # the engine keeps the weights the receiver loads between batches; the reward model, if any, is the trainer's
        parts.build_rollout(self.replicas, self.device, score_group=self.score_group)
        self.engine, self.generator, self.scorer = parts.engine, parts.generator, parts.scorer
        self.mine, self.tp_group = self.replicas.mine, self.replicas.group
        plan = reshard_plan_from_config(cfg, placement.trainer_ranks, self.arch)
        self.weights = WeightReceiver(placement, plan, self.rank % tp, self.device)
        total = cfg.trainer.total_training_steps or len(self.loader) * cfg.trainer.total_epochs
        a = cfg.async_training
        self.schedule = StalenessSchedule(a.staleness_threshold, a.trigger_parameter_sync_step, total)
        self.version: int | None = None
        self.run = 0  # the trainer's count of starts (a rollback starts the rollout again)
        self.partial = a.partial_rollout

    def _agreed_arrival(self) -> bool:
        """Whether the next weight version has reached every rank of this replica (they switch at the same token)."""
        flag = torch.tensor([1 if self.weights.arrived() else 0], dtype=torch.int32, device=self.device)
        if self.tp_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.tp_group)
        return bool(flag.item())

    def _take_weights(self, spent: dict[str, float]) -> None:
        self.version, idle, sync = self.weights.receive(self.engine)
        spent["rollout_idle_s"] = spent.get("rollout_idle_s", 0.0) + idle
        spent["weight_sync_s"] = spent.get("weight_sync_s", 0.0) + sync

    def _segments(self, num_prompts: int, n: int, lengths: list[int], start: int,
                  switches: list[tuple[int, int]]) -> list[list[list[int]]]:
        """Every row's weight versions as [[first token, version], ...]: one segment without partial rollouts, else
        each replica's switches (gathered from every rollout rank) cut at the row's length."""
        if not self.partial:
            return [[[0, start]] for _ in lengths]
        from tripod.engine.rollout.generators import replica_bounds

        every: list = [None] * self.world
        dist.all_gather_object(every, (self.mine, start, switches))
        by_replica = {r: (v, sw) for r, v, sw in every}
        replicas = len(self.replicas.ranks)
        bounds = replica_bounds(num_prompts, replicas)
        out = []
        for row, length in enumerate(lengths):
            r = next(k for k in range(replicas) if bounds[k] * n <= row < bounds[k + 1] * n)
            v, sw = by_replica[r]
            out.append([[0, v]] + [[t, w] for t, w in sw if t < length])
        return out

    def _timer(self, spent: dict[str, float]):
        import contextlib

        @contextlib.contextmanager
        def timed(name: str):
            start = time.perf_counter()
            yield
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return timed

    def serve(self) -> None:
        """Runs until the trainer closes the weight stream; a divergence-guard rollback on the trainer (a RESTART
        header, met by every rollout rank at its next wait for weights) starts it again from the rolled-back step."""
        from concurrent.futures import ThreadPoolExecutor

        self.engine.resume_memory()
        self.outbox: list = []
        self.row_server = RowServer(self.placement, self.rank, self.device)  # each trainer rank's rows, in a thread
        on_device = (lambda: torch.cuda.set_device(self.device)) if self.device.type == "cuda" else None
        # scores and sends each batch, in order, while the next is generated (NCCL: on this rank's device)
        self.scoring_thread = ThreadPoolExecutor(1, initializer=on_device)
        self._futures: list = []
        while True:
            try:
                self._serve_run()
                break
            except Restart:
                self.engine.between_tokens = None
                for f in self._futures:  # what was scored goes out; the trainer drops the abandoned run's batches
                    f.result()
                self._futures, self.version = [], None
        self.scoring_thread.shutdown()
        if self.rank == 0:
            self._wait_sent()
            send_end(self.placement.data, 0)
        self.row_server.join()  # until trainer rank 0's STOP, after its last step
        self.parts.pool.close()

    def _serve_run(self) -> None:
        """One start of the rollout: from the start message's batch to the last, then the trainer's end header."""
        start = recv(self.placement.data, torch.zeros(5, dtype=torch.int64), 0).tolist()
        first, self.run = int(start[1]), int(start[4])  # start[0]: the trainer's step, whose weights come first
        state = self.loader.state_dict()
        state.update(epoch=int(start[2]), offset=int(start[3]))
        self.loader.load_state_dict(state)
        for i in range(first, self.schedule.total_batches):
            spent: dict[str, float] = {}
            want = self.schedule.version_for(i)
            while self.version is None or self.version < want:  # (the batches it needs are on their way: the scorer)
                self._take_weights(spent)
            switches: list[tuple[int, int]] = []  # (first token generated with it, version) of a partial rollout
            if self.partial:  # the freshest weights here now, and any that land while tokens are generated
                while self._agreed_arrival():
                    self._take_weights(spent)

                def switch(step: int) -> bool:
                    if not self._agreed_arrival():
                        return False
                    self._take_weights(spent)
                    switches.append((step + 1, self.version))
                    return True
                self.engine.between_tokens = switch
            elif self.version != want:
                raise RuntimeError(f"batch {i} needs weight version {want}, the trainer sent {self.version}")
            if self.sampler.enable:  # dynamic sampling decides on the scores: the batch is scored before the next
                self._dynamic_batch(i, spent, self.version, switches)
            else:
                self._generate(i, spent, self.version, switches)
        for f in self._futures:
            f.result()
        self.weights.finish()  # the end header, or RESTART: a rollback after the last batch was made

    def _generate_rows(self, batch: int, prompts, gen_batch: int = 0):
        from tripod.engine.rollout.factory import step_sampling_params

        params = step_sampling_params(self.cfg, False, batch, gen_batch, self.mine)
        return self.generator.generate_rows(prompts, params)

    def _generate(self, i: int, spent: dict[str, float], start: int, switches: list) -> None:
        """Generate batch i; the scorer thread scores it (the pool's workers, or a remote judge, wait while the next
        batch is generated) and sends it."""
        prompts = next(iter(self.loader))
        loader_state = self.loader.state_dict()  # after this batch's prompts
        began = time.perf_counter()
        generated = self._generate_rows(i, prompts)
        spent["rollout_gen_s"] = time.perf_counter() - began
        self.engine.between_tokens = None
        n = self.cfg.actor_rollout_ref.rollout.n
        versions = self._segments(len(prompts.input_ids), n, [len(r) for r in generated.responses], start, switches)
        self._submit(self._score_and_send, i, prompts, generated, spent, versions, loader_state,
                     self.generator.take_metrics())

    def _submit(self, fn, *args) -> None:
        """Queue `fn(*args)` on the scorer thread; a failure of its earlier work is raised here."""
        for f in self._futures:
            if f.done():
                f.result()
        self._futures = [f for f in self._futures if not f.done()] + [self.scoring_thread.submit(fn, *args)]

    def _score_and_send(self, i: int, prompts, generated, spent: dict[str, float], versions: list,
                        loader_state: dict, agent_metrics: dict[str, float]) -> None:
        """(scorer thread) this replica's rows scored in the pool, every replica's scores summed on the scorer's own
        group, shaped, and rank 0 posts the batch."""
        began = time.perf_counter()
        scores, counts = self.scorer.rules(prompts, generated)
        spent["rollout_reward_s"] = time.perf_counter() - began
        rollout, metrics = self.sampler.metrics_of(self.sampler.scored(prompts, generated, scores, counts))
        self._send(i, rollout, {**metrics, **agent_metrics}, versions, spent, loader_state)

    def _dynamic_batch(self, i: int, spent: dict[str, float], start: int, switches: list) -> None:
        """Batch i under dynamic sampling: generation batches scored one by one until enough groups are kept (on the
        world: dynamic sampling with a reward model is refused, its scores are the trainer's)."""
        n = self.cfg.actor_rollout_ref.rollout.n
        timer = self._timer(spent)
        with timer("rollout_gen_s"):
            rollout, metrics = self.sampler.collect(next(iter(self.loader)), lambda p, k: self._generate_rows(i, p, k),
                                                    lambda p, generated: self.scorer.rules(p, generated, True), timer)
        metrics.update(self.generator.take_metrics())
        self.engine.between_tokens = None
        versions = self._segments(len(rollout.prompts.input_ids), n, [len(r) for r in rollout.responses], start,
                                  switches)
        self._submit(self._send, i, rollout, metrics, versions, spent, self.loader.state_dict())

    def _wait_sent(self) -> None:
        """The previous batch's sends: long received (the trainer's rank 0 always listens)."""
        for works, _, _ in self.outbox:
            for w in works:
                w.wait()
        self.outbox = []

    def _send(self, i: int, rollout, metrics: dict, versions: list, spent: dict, loader_state: dict) -> None:
        """(scorer thread) every rollout rank keeps batch i's rows for the trainer ranks it serves (rows.py); rollout
        rank 0 posts its head to trainer rank 0."""
        batch = ScoredBatch(i, versions, list(rollout.prompts.indices), rollout.responses,
                            rollout.rollout_log_probs, rollout.finish_reasons, rollout.scores, rollout.rewards,
                            rollout.penalties, metrics, loader_state,
                            {("rollout_reward_s" if k == "reward" else k): v for k, v in spent.items()}, self.run,
                            rollout.routed_experts, rollout.token_codes)
        buf, body = batch.to_wire()
        self.row_server.put(self.run, i, body)
        if self.rank != 0:
            return
        self._wait_sent()
        works, size = send_batch(self.placement.data, buf, 0)
        self.outbox = [(works, buf, size)]
