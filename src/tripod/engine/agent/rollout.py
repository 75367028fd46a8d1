"""The agent loop as a rollout generator (engine/rollout/generators.py): what a step's rollout runs when
actor_rollout_ref.rollout.multi_turn.enable is on, on the trainer's ranks or on the rollout's own.

Each rollout replica runs engine/agent/loop.py's `AgentLoop` on its share of the prompts, inside one session of its
engine for all its turns (colocated: the actor's weights loaded once); the group's first rank runs the rows, tools
and interactions, the others make the same engine calls (engine/agent/scheduler.py) and get the finished rows by
one broadcast. The rows then move to the ranks that need them like single-turn rows
(engine/rollout/exchange.py), with one code per token (loop.MODEL / TOOL / USER) from which the batch takes its
response mask (engine/workers/batch.py) and the rollout dump its `turns` (engine/async_rollout/source.py).

Metrics (`take_metrics`, every step, over every replica's rows of the step's generation batches):
multi_turn/turns_mean|max (model, tool and user turns after the prompt), tool/calls_mean (per response), tool/errors
and tool/timeouts (counts), tool/call_rate (the share of rows with at least one tool call), tool/parse_frac (of
those, the share whose every <tool_call> block parsed; absent when no row called), multi_turn/model_token_frac
(trained share of the response tokens), multi_turn/generate_s and multi_turn/tool_s (the slowest replica's seconds
generating, and with a tool / interaction step running: they overlap), multi_turn/generate_idle_frac (the share of the
wall time its engine did not generate), multi_turn/non_append_only_turns and multi_turn/ended_unrenderable
(engine/agent/chat_suffix.py). Validation (engine/validation.py) logs its own rows' under val/.

Rewards: the Rollout of a generation batch (engine/rollout/rows.py) carries the trajectory fields of this replica's rows (`row_fields`,
on every rank of the replica) and whether their rollout rewards join the score (`add_rewards`); the scorer
(engine/rewards/replica_scoring.py) reads both (engine/agent/rewards.py), also when it scores a batch later (the
rollout's own ranks score in a thread while the next batch is generated).

R3 (MoE routing replay): with a routing-recording engine each trajectory's turns are joined into one record per row
(engine/agent/loop.py) and every row's record reaches every rank as a single-turn row's does.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from tripod.engine.agent.chat_suffix import ChatSuffix
from tripod.engine.agent.loop import AgentLoop, Trajectory
from tripod.engine.agent.rewards import reward_fields
from tripod.engine.data.dataset import PromptBatch
from tripod.engine.rollout.base import SamplingParams
from tripod.engine.rollout.exchange import exchange_rollout
from tripod.engine.rollout.generators import RolloutReplicas, Session, replica_bounds, timed
from tripod.engine.rollout.rows import Rollout
from tripod.parallel.moe_arch import MoEArch

SUMMED = ("rows", "turns", "calls", "errors", "timeouts", "model_tokens", "tokens", "non_append_only", "unrenderable",
          "called_rows", "parsed_rows")
MAXED = ("turns_max", "generate_s", "tool_s", "wall_s")


def load_agent_parts(mt: Any) -> tuple[dict, dict]:
    """(tools, interactions) of actor_rollout_ref.rollout.multi_turn: tool_config_path's tools and function_tool_path's
    functions, interaction_config_path's interactions ({} where a path is null)."""
    from tripod.engine.agent import load_interactions
    from tripod.engine.agent.function_tools import load_all_tools

    return (load_all_tools(mt.tool_config_path, mt.function_tool_path),
            load_interactions(mt.interaction_config_path) if mt.interaction_config_path else {})


def check_agent_inputs(cfg: Any, tokenizer: Any, datasets: list) -> None:
    """engine/preflight.py: with multi_turn on, the tools and interactions load, every row's tools_kwargs /
    interaction_kwargs names what they define, and the tokenizer has a chat template (one line each)."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return
    from tripod.engine.agent import validate_agent_inputs

    ChatSuffix(tokenizer)
    tools, interactions = load_agent_parts(mt)
    for ds in datasets:
        validate_agent_inputs(tools, interactions, (ds[i]["extra_info"] for i in range(len(ds))))


def build_agent(cfg: Any, tokenizer: Any, engine: Any, replicas: RolloutReplicas, session: Session,
                routing_of: MoEArch | None = None) -> "AgentRollout | None":
    """The run's agent rollout from actor_rollout_ref.rollout.multi_turn over `engine` (None when it is off)."""
    rollout = cfg.actor_rollout_ref.rollout
    mt = rollout.multi_turn
    if not mt.enable:
        return None
    from tripod.engine.agent import InteractionRunner, ToolRunner, tool_schemas

    tools, found = load_agent_parts(mt)
    runner = ToolRunner(tools, max_parallel_calls=mt.max_parallel_calls,
                        max_tool_response_length=mt.max_tool_response_length,
                        tool_response_truncate_side=mt.tool_response_truncate_side,
                        timeout_s=mt.tool_timeout_s) if tools else None
    interactions = InteractionRunner(found, timeout_s=mt.tool_timeout_s) if found else None
    schemas = tool_schemas(tools) if tools else None
    suffix = ChatSuffix(tokenizer, schemas, dict(cfg.data.apply_chat_template_kwargs or {}))
    loop = AgentLoop(tokenizer, rollout.response_length, suffix, runner, interactions,
                     mt.max_assistant_turns, mt.max_user_turns, mt.scheduling)
    return AgentRollout(loop, engine, replicas, session, routing_of, mt.add_rollout_rewards)


class AgentRollout:
    """The agent loop as a rollout generator (see the module docstring)."""

    def __init__(self, loop: AgentLoop, engine: Any, replicas: RolloutReplicas, session: Session,
                 routing_of: MoEArch | None = None, add_rewards: bool = False) -> None:
        self.loop, self.engine, self.replicas, self.session = loop, engine, replicas, session
        self.routing_of, self.add_rewards = routing_of, bool(add_rewards)
        self.sums: dict[str, float] = {}

    def generate_rows(self, prompts: PromptBatch, params: SamplingParams, timer: Any = None,
                      needs: Callable[[list[int]], list[int] | None] | None = None) -> Rollout:
        """The batch's multi-turn rows: a Rollout whose `token_codes` say who wrote each token, with this replica's
        rows' trajectory fields; each prompt's extra_info (tools_kwargs, interaction_kwargs) goes to its tools and
        interaction. Collective over the world."""
        replicas, mine = self.replicas.ranks, self.replicas.mine
        bounds = replica_bounds(len(prompts), len(replicas))
        share_prompts = prompts.input_ids[bounds[mine]:bounds[mine + 1]]
        infos = (prompts.extra_infos or [{}] * len(prompts))[bounds[mine]:bounds[mine + 1]]
        raw = prompts.raw_prompts[bounds[mine]:bounds[mine + 1]] if prompts.raw_prompts else None
        group = self.replicas.group
        renders = group is None or dist.get_rank(group) == 0
        with self.session(timer) as engine, timed(timer)("gen"):
            rows, sums = self.loop.run(engine, share_prompts, params.n, params, infos, renders,
                                       None if group is None else lambda obj: _share(obj, group), raw)
        fields = [reward_fields(r) for r in rows]
        self._add(sums if renders else dict.fromkeys(sums, 0.0))
        responses, log_probs, finish, lengths, held, codes = trajectory_rows(rows, replicas, mine, needs)
        out = Rollout.generated(prompts, responses, log_probs, finish, lengths, held, token_codes=codes,
                                row_fields=fields,
                                add_rewards=self.add_rewards)
        if self.routing_of is not None:
            from tripod.engine.rollout.routing_record import gather_rollout_routing

            out.routed_experts = gather_rollout_routing([getattr(r, "routed_experts", None) for r in rows],
                                                        replicas, self.routing_of)
        return out

    def _add(self, sums: dict[str, float]) -> None:
        """Adds a generation batch's sums over every replica (collective over the world)."""
        t = torch.tensor([[sums[k] for k in SUMMED], [sums[k] for k in MAXED] + [0.0] * (len(SUMMED) - len(MAXED))],
                         dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            from tripod.runtime.device import current_device

            total, most = t[0].to(current_device()), t[1].to(current_device())
            dist.all_reduce(total)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            t = torch.stack([total.cpu(), most.cpu()])
        for k, v in zip(SUMMED, t[0].tolist()):
            self.sums[k] = self.sums.get(k, 0.0) + v
        for k, v in zip(MAXED, t[1].tolist()):
            self.sums[k] = max(self.sums.get(k, 0.0), v) if k == "turns_max" else self.sums.get(k, 0.0) + v

    def take_metrics(self) -> dict[str, float]:
        """The metrics of the generation batches since the last call (module docstring); {} when none ran."""
        s, self.sums = self.sums, {}
        if not s.get("rows"):
            return {}
        out = {"multi_turn/turns_mean": s["turns"] / s["rows"], "multi_turn/turns_max": s["turns_max"],
               "tool/calls_mean": s["calls"] / s["rows"], "tool/errors": s["errors"], "tool/timeouts": s["timeouts"],
               "tool/call_rate": s["called_rows"] / s["rows"],
               "multi_turn/model_token_frac": s["model_tokens"] / max(s["tokens"], 1.0),
               "multi_turn/generate_s": s["generate_s"], "multi_turn/tool_s": s["tool_s"],
               "multi_turn/generate_idle_frac": max(0.0, 1.0 - s["generate_s"] / s["wall_s"]) if s["wall_s"] else 0.0,
               "multi_turn/non_append_only_turns": s["non_append_only"],
               "multi_turn/ended_unrenderable": s["unrenderable"]}
        if s["called_rows"]:
            out["tool/parse_frac"] = s["parsed_rows"] / s["called_rows"]
        return out


def trajectory_rows(rows: list[Trajectory], replicas: list[list[int]], mine: int,
                    needs: Callable[[list[int]], list[int] | None] | None = None) -> tuple:
    """This replica's trajectories -> the exchange's rows on every rank that needs them: responses, log-probs, finish
    reasons, every row's length, the rows this rank needed (None: all), token codes."""
    responses = [r.response for r in rows]
    log_probs = [torch.tensor(r.log_probs, dtype=torch.float32) for r in rows]
    codes = [torch.tensor(r.codes, dtype=torch.uint8) for r in rows]
    out = exchange_rollout(replicas, mine, responses, log_probs, [r.finish for r in rows], needs, token_codes=codes)
    responses, log_probs, finish, codes, every, wanted = out
    return responses, log_probs, finish, every, wanted, codes


def _share(obj: Any, group: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
