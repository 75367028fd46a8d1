"""The batch agent loop: multi-turn trajectories as ONE token sequence each, token in and token out.

    loop = AgentLoop(tokenizer, response_length, suffix=ChatSuffix(tokenizer, schemas), runner=ToolRunner(...), ...)
    trajectories, stats = loop.run(generate, prompts, n, params, extra_infos)

A trajectory is the prompt, then per turn the model's tokens exactly as the engine generated them (ids and the
engine's log-probs, never decoded and re-encoded), then the tool or user turn's tokens rendered by the chat template
as a suffix of the conversation (engine/agent/chat_suffix.py). Every token carries a code: MODEL (1: trained,
`response_mask` 1) or TOOL / USER (2 / 3: context only, mask 0, log-prob 0).

The batch advances together: one generate call runs a turn of every live row (the first turn generates the n samples
of each prompt, as a single-turn rollout does, with the same seed); then the rows whose turn called tools run them,
all rows' calls at once (asyncio: one row's slow tool does not hold up another's), and the rows an interaction
answers get its reply. A row ends when its model turn has no tool call and no interaction answers (or the interaction
ends it), when it reaches max_assistant_turns or max_user_turns (tool turns count as user turns, as in verl), when a
turn ends for length, or when the response budget (rollout.response_length, over all turns) cannot take the next
tool / user turn (verl: that turn is not appended, so a response always ends with model tokens). A tool's text is
truncated to max_tool_response_length characters by the tool runner.

On a rollout replica of several TP ranks every rank runs the loop (generation is collective) but only the group's
first rank runs tools and interactions and renders the suffixes; `share` hands its per-turn results to the others.

MoE routing replay (R3): when the engine's outputs carry `routed_experts` (it records routing), each trajectory's
`routed_experts` is the row's record, [prompt + response tokens, MoE layers, k] as a single-turn row's, joined from
its turns by engine/rollout/routing_record.py's `join_turn`: every position takes the record of the generate call
that first fed it (a model token but a turn's last: its own turn's decode step; a turn's last model token and the
tool / user tokens after it: the next turn's prefill), the row's last token none. A turn's context is always the
previous context plus the new tokens (earlier tokens are kept as generated, non-append-only templates included:
engine/agent/chat_suffix.py), so the positions line up.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from tripod.engine.agent.chat_suffix import ChatSuffix
from tripod.engine.agent.hermes import parse_tool_calls
from tripod.engine.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams
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
    reward: float = 0.0  # tool step rewards + the tools' calc_reward + interaction turn scores and final score
    tool_rewards: list[float] = field(default_factory=list)  # each tool call's step reward, in order (verl's name)
    turn_scores: list[float] = field(default_factory=list)  # each interaction reply's turn score (verl's name)
    reward_scores: dict[str, float] = field(default_factory=dict)  # calc_reward per tool; "interaction": its final
    # R3: [prompt + response tokens, MoE layers, k] expert ids (module docstring); None when the engine records none
    routed_experts: torch.Tensor | None = None


@dataclass
class EnvStep:
    """What the rendering rank decided for one row after its model turn (shared with the group's other ranks)."""
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
    append_only: bool = True


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of turn `turn` (0: the single-turn rollout's own)."""
    return seed if seed is None or turn == 0 else (seed * 1_000_003 + turn) % (1 << 62)


class AgentLoop:
    """Runs a batch of multi-turn trajectories (see the module docstring). `runner`: engine/agent/tool_runner.py's
    `ToolRunner` (or an object with its async `start` / `call` / `finish`), None without tools; `interactions`: its
    `InteractionRunner` (async `start` / `respond` / `finish`), None without."""

    def __init__(self, tokenizer: Any, response_length: int, suffix: ChatSuffix, runner: Any = None,
                 interactions: Any = None, max_assistant_turns: int | None = None,
                 max_user_turns: int | None = None) -> None:
        self.tokenizer, self.response_length, self.suffix = tokenizer, int(response_length), suffix
        self.runner, self.interactions = runner, interactions
        self.max_assistant_turns, self.max_user_turns = max_assistant_turns, max_user_turns
        self._calls = 0

    # ---- the batch ----------------------------------------------------------------------------------------
    def run(self, generate: Callable[[list[list[int]], SamplingParams], RolloutOutput], prompts: list[list[int]],
            n: int, params: SamplingParams, extra_infos: list[dict] | None = None, renders: bool = True,
            share: Callable[[Any], Any] | None = None) -> tuple[list[Trajectory], dict[str, float]]:
        """(the n trajectories of each prompt, prompt-major; this batch's sums: see `stats`). `renders`: this rank runs
        tools and renders (the TP group's first rank); `share(obj)`: the rendering rank's obj on every rank of the
        group (None: one rank)."""
        self._calls += 1
        return asyncio.run(self._run(generate, prompts, n, params, extra_infos or [{}] * len(prompts), renders,
                                     share or (lambda obj: obj)))

    async def _run(self, generate, prompts, n, params, extra_infos, renders, share):
        rows = [Trajectory() for _ in range(len(prompts) * n)]
        keys = [f"{self._calls}-{i}" for i in range(len(rows))]
        info = lambda i: extra_infos[i // n] or {}  # noqa: E731
        talks = [self.interactions is not None and bool(info(i).get("interaction_kwargs")) for i in range(len(rows))]
        if renders:
            await asyncio.gather(*(self._start(keys[i], info(i), talks[i]) for i in range(len(rows))))
        gen_s = tool_s = 0.0
        turn = 0
        while live := [i for i, r in enumerate(rows) if not r.done]:
            budget = [self.response_length - len(rows[i].response) for i in live]
            start = time.perf_counter()
            if turn == 0:
                out = generate(prompts, replace(params, n=n, max_new_tokens=self.response_length))
            else:
                out = generate([prompts[i // n] + rows[i].response for i in live],
                               replace(params, n=1, max_new_tokens=max(budget), seed=turn_seed(params.seed, turn)))
            gen_s += time.perf_counter() - start
            new: list[list[int]] = []
            generated = out.responses()
            records = out.routed_experts
            if turn > 0 and (records is None) != (rows[live[0]].routed_experts is None):
                raise RuntimeError(f"agent loop: the engine recorded routing in some turns of a batch, not in all "
                                   f"(turn {turn}: {'none' if records is None else 'recorded'})")
            for k, (i, room) in enumerate(zip(live, budget)):
                ids, r = generated[k], rows[i]
                logp = out.log_probs[k, : len(ids)].tolist()
                r.finish = out.finish_reasons[k]
                if records is not None:
                    r.routed_experts = join_turn(r.routed_experts, records[k], len(prompts[i // n]) + len(r.response),
                                                 len(ids), min(len(ids), room))
                if len(ids) > room:
                    ids, logp, r.finish = ids[:room], logp[:room], FINISH_LENGTH
                r.response += ids
                r.codes += [MODEL] * len(ids)
                r.log_probs += logp
                r.assistant_turns += 1
                r.turns.append({"role": "assistant", "text": self.tokenizer.decode(ids, skip_special_tokens=False),
                                "n_tokens": len(ids), "trained": True})
                new.append(ids)
            start = time.perf_counter()
            steps = await asyncio.gather(*(self._env_step(rows[i], keys[i], ids, talks[i])
                                           for i, ids in zip(live, new))) if renders else None
            tool_s += time.perf_counter() - start
            for i, step in zip(live, share(steps)):
                self._apply(rows[i], step)
            turn += 1
        for i, r in enumerate(rows):
            unfed = len(prompts[i // n]) + len(r.response) - (0 if r.routed_experts is None else len(r.routed_experts))
            if r.routed_experts is not None and unfed:  # tool / user tokens after the last model turn: never fed
                r.routed_experts = torch.cat([r.routed_experts, r.routed_experts[-1:].expand(unfed, -1, -1)])
        if renders:
            finals = await asyncio.gather(*(self._finish(keys[i], talks[i]) for i in range(len(rows))))
            for r, scores in zip(rows, finals):
                r.reward_scores = scores
                r.reward += sum(scores.values())
        return rows, stats(rows, gen_s, tool_s, self.suffix.non_append_only if renders else 0)

    @staticmethod
    def _apply(r: Trajectory, step: EnvStep) -> None:
        r.tool_calls += step.calls
        r.tool_errors += step.errors
        r.tool_timeouts += step.timeouts
        r.tool_parse_errors += step.parse_errors
        r.reward += step.reward
        r.tool_rewards += step.tool_rewards
        if step.turn_score is not None:
            r.turn_scores.append(step.turn_score)
        if step.done:
            r.done = True
            return
        r.response += step.ids
        r.codes += [step.code] * len(step.ids)
        r.log_probs += [0.0] * len(step.ids)
        r.user_turns += 1
        r.turns.append({"role": ROLE_OF[step.code], "text": step.text, "n_tokens": len(step.ids), "trained": False})

    # ---- one row's environment step (the rendering rank) --------------------------------------------------
    async def _start(self, key: str, info: dict, talks: bool) -> None:
        if self.runner is not None:
            await self.runner.start(key, info.get("tools_kwargs") or {})
        if talks:
            await self.interactions.start(key, info["interaction_kwargs"])

    async def _finish(self, key: str, talks: bool) -> dict[str, float]:
        """The row's final scores: each tool's calc_reward, and the interaction's final score under "interaction"."""
        scores: dict[str, float] = {}
        if self.runner is not None:
            scores.update(await self.runner.finish_scores(key))
        if talks:
            scores["interaction"] = float(await self.interactions.finish(key))
        return scores

    async def _env_step(self, r: Trajectory, key: str, ids: list[int], talks: bool) -> EnvStep:
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
            results = await self.runner.call(key, calls) if calls else []
            messages = [{"role": "tool", "content": res.text if res.error is None else f"Error: {res.error}"}
                        for res in results] + [{"role": "tool", "content": f"Error: {e}"} for e in errors]
            step.calls = len(calls) + len(errors)
            step.errors = sum(res.error is not None for res in results) + len(errors)
            step.timeouts = sum(bool(res.timed_out) for res in results)
            step.parse_errors = len(errors)
            step.tool_rewards = [float(res.reward) for res in results]
            step.reward = float(sum(step.tool_rewards))
        elif talks:
            stop, reply, score, _ = await self.interactions.respond(key, list(r.history))
            step.reward = step.turn_score = float(score or 0.0)
            if stop:
                step.done = True
                return step
            messages, step.code = [{"role": "user", "content": reply}], USER
        else:
            step.done = True
            return step
        # the template's text after the end-of-turn token the engine stopped at (a special token: <|im_end|>)
        special = r.finish == FINISH_STOP and ids and ids[-1] in set(self.tokenizer.all_special_ids)
        end = self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if special else ""
        step.ids, step.text, step.append_only = self.suffix.suffix_ids(r.history, messages, end)
        if len(r.response) + len(step.ids) >= self.response_length:
            step.done, step.ids = True, []  # no room for the turn and a model answer after it
            return step
        r.history += messages
        return step


def stats(rows: list[Trajectory], gen_s: float, tool_s: float, non_append_only: int) -> dict[str, float]:
    """Sums over a batch's rows (a replica's: the rollout adds them over replicas, engine/agent/rollout.py).
    called_rows: rows with at least one tool call (a malformed <tool_call> block counts); parsed_rows: those of them
    whose every call parsed."""
    turns = [len(r.turns) for r in rows]
    called = [r for r in rows if r.tool_calls]
    model = sum(c == MODEL for r in rows for c in r.codes)
    return {"rows": float(len(rows)), "turns": float(sum(turns)), "turns_max": float(max(turns, default=0)),
            "calls": float(sum(r.tool_calls for r in rows)), "errors": float(sum(r.tool_errors for r in rows)),
            "timeouts": float(sum(r.tool_timeouts for r in rows)), "model_tokens": float(model),
            "tokens": float(sum(len(r.codes) for r in rows)), "generate_s": gen_s, "tool_s": tool_s,
            "non_append_only": float(non_append_only), "called_rows": float(len(called)),
            "parsed_rows": float(sum(not r.tool_parse_errors for r in called))}
