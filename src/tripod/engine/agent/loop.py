"""The agent loop: multi-turn trajectories as ONE token sequence each, token in and token out, one loop per row.

    loop = AgentLoop(tokenizer, response_length, suffix=ChatSuffix(tokenizer, schemas), runner=ToolRunner(...), ...)
    trajectories, stats = loop.run(engine, prompts, n, params, extra_infos)

A trajectory is the prompt, then per turn the model's tokens exactly as the engine generated them (ids and the
engine's log-probs, never decoded and re-encoded), then the tool or user turn's tokens rendered by the chat template
as a suffix of the conversation (engine/agent/chat_suffix.py). Every token carries a code: MODEL (1: trained,
`response_mask` 1) or TOOL / USER (2 / 3: context only, mask 0, log-prob 0).

Each row advances on its own (a coroutine per row): it asks the turn scheduler (engine/agent/scheduler.py) for its
next model turn, then runs that turn's tool calls or gets the interaction's reply, then asks again; while one row
waits for a tool, the others generate. Tool calls of different rows run concurrently (each tool's max_concurrency
bounds its own, engine/agent/tool_runner.py). A row's first turn generates sample j of its prompt, as a single-turn
rollout does; every turn samples from the row's own seed (scheduler.row_turn_seed). A row ends when its model turn
has no tool call and no interaction answers (or the interaction ends it: its final reply is appended, as verl does),
when it reaches max_assistant_turns or max_user_turns (tool turns count as user turns, as in verl), when a turn ends
for length, when the response budget (rollout.response_length, over all turns) cannot take the next tool / user turn
(verl: that turn is not appended), or when the chat template cannot render the next turn as a suffix of the tokens so
far (counted in multi_turn/ended_unrenderable; the run goes on). A tool's text is what engine/agent/tool_runner.py
gives the model (truncated to max_tool_response_length characters).

On a rollout replica of several TP ranks the group's first rank runs the rows, the tools and the interactions; the
other ranks make the same engine calls (`TurnScheduler.follow`) and receive the finished trajectories.

MoE routing replay (R3): when the engine's outputs carry `routed_experts` (it records routing), each trajectory's
`routed_experts` is the row's record, [prompt + response tokens, MoE layers, k] as a single-turn row's, joined from
its turns by engine/rollout/routing_record.py's `join_turn`: every position takes the record of the generate call
that first fed it (a model token but a turn's last: its own turn's decode step; a turn's last model token and the
tool / user tokens after it: the next turn's prefill), the row's last token none. A turn's context is always the
previous context plus the new tokens (earlier tokens are kept as generated: engine/agent/chat_suffix.py), so the
positions line up.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tripod.engine.agent.chat_suffix import ChatSuffix
from tripod.engine.agent.hermes import parse_tool_calls
from tripod.engine.agent.scheduler import TurnOutput, TurnScheduler, row_turn_seed
from tripod.engine.agent.tool_runner import run_abandoning
from tripod.engine.agent.tools import AgentData
from tripod.engine.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from tripod.engine.rollout.routing_record import join_turn

MODEL, TOOL, USER = 1, 2, 3  # per-token codes; response_mask = (code == MODEL)
ROLE_OF = {MODEL: "assistant", TOOL: "tool", USER: "user"}


@dataclass
class Trajectory:
    """One row: everything after the prompt (its routing record: the prompt's too)."""
    response: list[int] = field(default_factory=list)
    codes: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)  # {role, text, n_tokens, trained}
    finish: str = FINISH_STOP
    done: bool = False
    assistant_turns: int = 0
    user_turns: int = 0  # tool and interaction turns
    history: list[dict] = field(default_factory=list)  # the messages after the prompt (the rendering rank only)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_parse_errors: int = 0  # <tool_call> blocks that did not parse (they count in tool_calls and tool_errors)
    unrenderable: bool = False  # ended because the chat template could not render its next turn as a suffix
    reward: float = 0.0  # tool step rewards + the tools' calc_reward + interaction turn scores and final score
    tool_rewards: list[float] = field(default_factory=list)  # each tool call's step reward, in order (verl's name)
    turn_scores: list[float] = field(default_factory=list)  # each interaction reply's turn score (verl's name)
    reward_scores: dict[str, float] = field(default_factory=dict)  # calc_reward per tool; "interaction": its final
    # R3: [prompt + response tokens, MoE layers, k] expert ids (module docstring); None when the engine records none
    routed_experts: torch.Tensor | None = None
    turn_times: list[tuple[float, float]] = field(default_factory=list)  # each model turn's (asked, answered) clock


@dataclass
class EnvStep:
    """What the environment made of a row's model turn: the next tool / user turn's tokens, or the row's end (a
    terminating interaction reply is appended first)."""
    done: bool
    ids: list[int] = field(default_factory=list)
    text: str = ""
    code: int = TOOL
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    parse_errors: int = 0
    reward: float = 0.0
    tool_rewards: list[float] = field(default_factory=list)
    turn_score: float | None = None
    unrenderable: bool = False


class _Busy:
    """Wall time during which at least one row was in its environment step."""

    def __init__(self) -> None:
        self.inside, self.since, self.total = 0, 0.0, 0.0

    def __enter__(self) -> None:
        if not self.inside:
            self.since = time.perf_counter()
        self.inside += 1

    def __exit__(self, *exc: Any) -> None:
        self.inside -= 1
        if not self.inside:
            self.total += time.perf_counter() - self.since


class AgentLoop:
    """Runs a batch of multi-turn trajectories (see the module docstring). `runner`: engine/agent/tool_runner.py's
    `ToolRunner`, None without tools; `interactions`: its `InteractionRunner`, None without; `scheduling`: per_row or
    lockstep (engine/agent/scheduler.py)."""

    def __init__(self, tokenizer: Any, response_length: int, suffix: ChatSuffix, runner: Any = None,
                 interactions: Any = None, max_assistant_turns: int | None = None,
                 max_user_turns: int | None = None, scheduling: str = "per_row") -> None:
        self.tokenizer, self.response_length, self.suffix = tokenizer, int(response_length), suffix
        self.runner, self.interactions = runner, interactions
        self.max_assistant_turns, self.max_user_turns = max_assistant_turns, max_user_turns
        self.scheduling = scheduling
        self._calls = 0

    # ---- the batch ----------------------------------------------------------------------------------------
    def run(self, engine: Any, prompts: list[list[int]], n: int, params: SamplingParams,
            extra_infos: list[dict] | None = None, renders: bool = True, share: Callable[[Any], Any] | None = None,
            raw_prompts: list[list[dict]] | None = None) -> tuple[list[Trajectory], dict[str, float]]:
        """(the n trajectories of each prompt, prompt-major; this batch's sums: see `stats`). `engine`: a rollout
        engine (`generate(prompts, params, row_seeds)`); `renders`: this rank runs the rows (the TP group's first
        rank); `share(obj)`: the rendering rank's obj on every rank of the group (None: one rank); `raw_prompts`:
        each prompt's chat messages (the interaction and the tools' agent_data see the whole conversation)."""
        self._calls += 1
        scheduler = TurnScheduler(engine, params, self.scheduling, len(prompts) * n, share)
        if not renders:
            assert share is not None, "a rank that does not render follows the rendering rank's calls"
            scheduler.follow()
            return share(None)
        rows, sums = run_abandoning(self._run(scheduler, prompts, n, params, extra_infos or [{}] * len(prompts),
                                              raw_prompts))
        if share is not None:
            share((rows, sums))
        return rows, sums

    async def _run(self, scheduler: TurnScheduler, prompts, n, params, extra_infos, raw_prompts):
        rows = [Trajectory() for _ in range(len(prompts) * n)]
        busy, non_append_only, start = _Busy(), self.suffix.non_append_only, time.perf_counter()
        work = [self._row(i, rows[i], f"{self._calls}-{i}", prompts[i // n], extra_infos[i // n] or {},
                          (raw_prompts or [None] * len(prompts))[i // n] or [], params, scheduler, busy)
                for i in range(len(rows))]
        await asyncio.gather(scheduler.drive(), *work)
        wall = time.perf_counter() - start
        return rows, stats(rows, scheduler.busy_s, busy.total, wall, self.suffix.non_append_only - non_append_only)

    async def _row(self, i: int, r: Trajectory, key: str, prompt: list[int], info: dict, raw: list[dict],
                   params: SamplingParams, scheduler: TurnScheduler, busy: _Busy) -> None:
        """Row `i` from its first model turn to its end, then its final scores."""
        talks = self.interactions is not None and bool(info.get("interaction_kwargs"))
        agent_data = AgentData(messages=list(raw), request_id=key, tools_kwargs=info.get("tools_kwargs") or {})
        try:
            with busy:
                await self._start(key, info, talks)
            turn = 0
            while not r.done:
                room = self.response_length - len(r.response)
                asked = time.perf_counter()
                out = await scheduler.generate(i, prompt + r.response, room, row_turn_seed(params.seed, i, turn))
                r.turn_times.append((asked, time.perf_counter()))
                ids = self._model_turn(r, out, len(prompt), room)
                agent_data.prompt_ids, agent_data.response_ids = prompt + r.response, ids
                agent_data.assistant_turns = r.assistant_turns
                with busy:
                    step = await self._env_step(r, key, ids, talks, raw, agent_data)
                self._apply(r, step)
                agent_data.messages = [*raw, *r.history]
                agent_data.response_mask = [int(c == MODEL) for c in r.codes]
                agent_data.user_turns, agent_data.tool_rewards = r.user_turns, list(r.tool_rewards)
                agent_data.turn_scores = list(r.turn_scores)
                turn += 1
        finally:
            scheduler.finished(i)
        unfed = len(prompt) + len(r.response) - (0 if r.routed_experts is None else len(r.routed_experts))
        if r.routed_experts is not None and unfed:  # tool / user tokens after the last model turn: never fed
            r.routed_experts = torch.cat([r.routed_experts, r.routed_experts[-1:].expand(unfed, -1, -1)])
        with busy:
            r.reward_scores = await self._finish(key, talks)
        r.reward += sum(r.reward_scores.values())

    def _model_turn(self, r: Trajectory, out: TurnOutput, prompt_len: int, room: int) -> list[int]:
        """Append a model turn (cut to the row's room) to `r`; its ids."""
        ids, logp = out.token_ids, out.log_probs
        if r.assistant_turns and (out.routed_experts is None) != (r.routed_experts is None):
            raise RuntimeError("agent loop: the engine recorded routing in some turns of a row, not in all")
        if out.routed_experts is not None:
            r.routed_experts = join_turn(r.routed_experts, out.routed_experts, prompt_len + len(r.response), len(ids),
                                         min(len(ids), room))
        r.finish = out.finish
        if len(ids) > room:
            ids, logp, r.finish = ids[:room], logp[:room], FINISH_LENGTH
        r.response += ids
        r.codes += [MODEL] * len(ids)
        r.log_probs += logp
        r.assistant_turns += 1
        r.turns.append({"role": "assistant", "text": self.tokenizer.decode(ids, skip_special_tokens=False),
                        "n_tokens": len(ids), "trained": True})
        return ids

    @staticmethod
    def _apply(r: Trajectory, step: EnvStep) -> None:
        r.tool_calls += step.calls
        r.tool_errors += step.errors
        r.tool_timeouts += step.timeouts
        r.tool_parse_errors += step.parse_errors
        r.reward += step.reward
        r.tool_rewards += step.tool_rewards
        r.unrenderable = step.unrenderable
        if step.turn_score is not None:
            r.turn_scores.append(step.turn_score)
        if step.ids:
            r.response += step.ids
            r.codes += [step.code] * len(step.ids)
            r.log_probs += [0.0] * len(step.ids)
            r.user_turns += 1
            r.turns.append({"role": ROLE_OF[step.code], "text": step.text, "n_tokens": len(step.ids),
                            "trained": False})
        r.done = step.done

    # ---- one row's environment step -----------------------------------------------------------------------
    async def _start(self, key: str, info: dict, talks: bool) -> None:
        if self.runner is not None:
            await self.runner.start(key, info.get("tools_kwargs") or {}, info.get("tool_selection"))
        if talks:
            await self.interactions.start(key, info["interaction_kwargs"])

    async def _finish(self, key: str, talks: bool) -> dict[str, float]:
        """The row's final scores: the calc_reward of the tools that opt in, the interaction's final score under
        "interaction"."""
        scores: dict[str, float] = {}
        if self.runner is not None:
            scores.update(await self.runner.finish_scores(key))
        if talks:
            scores["interaction"] = float(await self.interactions.finish(key))
        return scores

    async def _env_step(self, r: Trajectory, key: str, ids: list[int], talks: bool, raw: list[dict],
                        agent_data: AgentData) -> EnvStep:
        """After row `r`'s model turn `ids`: end it, or the next tool / user turn's tokens."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        r.history.append({"role": "assistant", "content": text})
        if (r.finish == FINISH_LENGTH or len(r.response) >= self.response_length
                or (self.max_assistant_turns and r.assistant_turns >= self.max_assistant_turns)
                or (self.max_user_turns and r.user_turns >= self.max_user_turns)):
            return EnvStep(done=True)
        step = EnvStep(done=False)
        calls, errors = parse_tool_calls(text) if self.runner is not None else ([], [])
        if calls or errors:
            agent_data.messages = [*raw, *r.history]
            agent_data.tool_calls = list(calls)
            results = await self.runner.call(key, calls, agent_data) if calls else []
            messages = [{"role": "tool", "content": res.text} for res in results] + \
                       [{"role": "tool", "content": f"Error: {e}"} for e in errors]
            step.calls = len(calls) + len(errors)
            step.errors = sum(res.error is not None for res in results) + len(errors)
            step.timeouts = sum(bool(res.timed_out) for res in results)
            step.parse_errors = len(errors)
            step.tool_rewards = [float(res.reward) for res in results if res.reward is not None]
            step.reward = float(sum(step.tool_rewards))
        elif talks:
            stop, reply, score, extra = await self.interactions.respond(key, [*raw, *r.history])
            step.reward = step.turn_score = float(score or 0.0)
            if stop and (extra.get("error") or not reply):
                step.done = True
                return step
            step.done = bool(stop)  # a final reply is appended, then the row ends (verl)
            messages, step.code = [{"role": "user", "content": reply}], USER
        else:
            step.done = True
            return step
        # the template's text after the end-of-turn token the engine stopped at (a special token: <|im_end|>)
        special = r.finish == FINISH_STOP and ids and ids[-1] in set(self.tokenizer.all_special_ids)
        end = self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if special else ""
        rendered = self.suffix.suffix_ids(r.history, messages, end)
        if rendered is None:
            step.done = step.unrenderable = True
            return step
        step.ids, step.text, _ = rendered
        if len(r.response) + len(step.ids) >= self.response_length:
            step.done, step.ids = True, []  # no room for the turn and a model answer after it
            return step
        r.history += messages
        return step


def stats(rows: list[Trajectory], generate_s: float, tool_s: float, wall_s: float,
          non_append_only: int) -> dict[str, float]:
    """Sums over a batch's rows (a replica's: the rollout adds them over replicas, engine/agent/rollout.py).
    called_rows: rows with at least one tool call (a malformed <tool_call> block counts); parsed_rows: those of them
    whose every call parsed; generate_s: the engine's busy time, tool_s: time with a tool or interaction running,
    wall_s: the batch's wall time (they overlap: rows generate while others run tools)."""
    turns = [len(r.turns) for r in rows]
    called = [r for r in rows if r.tool_calls]
    model = sum(c == MODEL for r in rows for c in r.codes)
    return {"rows": float(len(rows)), "turns": float(sum(turns)), "turns_max": float(max(turns, default=0)),
            "calls": float(sum(r.tool_calls for r in rows)), "errors": float(sum(r.tool_errors for r in rows)),
            "timeouts": float(sum(r.tool_timeouts for r in rows)), "model_tokens": float(model),
            "tokens": float(sum(len(r.codes) for r in rows)), "generate_s": generate_s, "tool_s": tool_s,
            "wall_s": wall_s, "non_append_only": float(non_append_only), "unrenderable": float(sum(r.unrenderable for r in rows)),
            "called_rows": float(len(called)), "parsed_rows": float(sum(not r.tool_parse_errors for r in called))}
