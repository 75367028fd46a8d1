"""Interactions in verl's format: a user simulator that answers the model, chosen per row by name.

    interaction:                                   # the file named by multi_turn.interaction_config_path
      - name: gsm8k                                # optional: default is the class name less "Interaction", lowered
        class_name: tripod.engine.agent.interactions.Gsm8kInteraction
        config: {}                                 # handed to the constructor, with `name` added (as verl does)

A row picks one with `extra_info.interaction_kwargs = {"name": "gsm8k", ...}`; the whole dict (name included) goes
to `start_interaction(instance_id, **kwargs)` and `generate_response(instance_id, messages, **kwargs)`, as in verl.
A class needs verl's constructor `(config)` and async `start_interaction`, `generate_response -> (should_terminate,
text, turn_score, extra)`; `calculate_score` and `finalize_interaction` are called at the end with as much of
`(instance_id, **kwargs)` as their signatures take (verl's base class declares them without arguments).

`generate_response` gets the whole conversation, as verl's earlier rollouts handed it: the prompt's messages, then
the trajectory's turns (the agent loop passes both). verl 0.9.1's agent loop has no interactions (its multi_turn has
no interaction_config_path); tripod keeps the format of the verl releases that had them.
"""
from __future__ import annotations

import inspect
import math
from typing import Any
from uuid import uuid4

from tripod.engine.agent.tool_runner import ErrorRecord, run_guarded
from tripod.engine.agent.tools import import_class, load_yaml_list


class BaseInteraction:
    """Optional base class with verl's defaults."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id or str(uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        return None


class Gsm8kInteraction(BaseInteraction):
    """verl's GSM8K interaction: tells the model whether its last answer (`#### N`, strict) equals the row's
    `ground_truth` (from interaction_kwargs); ends the conversation when it does. Turn score 1 or 0."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None,
                                **kwargs) -> str:
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = last
        score = await self.calculate_score(instance_id)
        if score == 1.0:
            return True, "Your response is correct!", score, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", score, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        from tripod.engine.rewards.gsm8k import compute_score

        state = self._instances[instance_id]
        return compute_score(state["response"], str(state["ground_truth"]), method="strict")

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        self._instances.pop(instance_id, None)


def load_interactions(interaction_config_path: str) -> dict[str, object]:
    """Build every interaction of a verl `interaction:` YAML: name -> instance."""
    interactions: dict[str, object] = {}
    for i, entry in enumerate(load_yaml_list(interaction_config_path, "interaction")):
        where = f"{interaction_config_path}: interaction[{i}]"
        cls = import_class(entry.get("class_name"), where)
        config = dict(entry.get("config") or {})
        name = entry.get("name")
        if name is None:
            simple = cls.__name__
            name = (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()
        if name in interactions:
            raise ValueError(f"{where}: duplicate interaction name {name!r}; each interaction needs a unique name")
        config["name"] = name
        missing = [m for m in ("start_interaction", "generate_response") if not callable(getattr(cls, m, None))]
        if missing:
            raise ValueError(f"{where}: {entry['class_name']} lacks {missing} (verl's BaseInteraction API)")
        try:
            interactions[name] = cls(config=config)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{where}: {entry['class_name']}(config) raised {type(e).__name__}: {e}") from None
    return interactions


def _call_with_what_fits(fn: Any, instance_id: str, kwargs: dict) -> tuple[tuple, dict]:
    """The (args, kwargs) of `fn(instance_id, **kwargs)` that its signature accepts."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return (instance_id,), kwargs
    for args, kw in (((instance_id,), kwargs), ((instance_id,), {}), ((), {})):
        try:
            sig.bind(*args, **kw)
            return args, kw
        except TypeError:
            continue
    return (instance_id,), kwargs


class InteractionRunner(ErrorRecord):
    """One interaction instance per row key; no method raises (a failure ends the row's conversation). Failures are
    counted in `error_count`, the last few kept in `recent_errors`."""

    def __init__(self, interactions: dict[str, object], *, timeout_s: float = 60.0):
        self.interactions = interactions
        self.timeout_s = timeout_s
        self._rows: dict[str, tuple[object, str, dict]] = {}  # row -> (interaction, instance id, kwargs)
        super().__init__()

    async def start(self, row_key: str, interaction_kwargs: dict) -> None:
        kwargs = dict(interaction_kwargs or {})
        interaction = self.interactions.get(kwargs.get("name"))
        if interaction is None:
            return self._record(row_key, f"interaction_kwargs.name {kwargs.get('name')!r} is not one of "
                                         f"{sorted(self.interactions)}")
        value, error, *_ = await run_guarded("start_interaction", self.timeout_s, interaction.start_interaction,
                                             row_key, **kwargs)
        if error is not None:
            return self._record(row_key, error)
        self._rows[row_key] = (interaction, value if isinstance(value, str) and value else row_key, kwargs)

    async def respond(self, row_key: str, messages: list[dict]) -> tuple[bool, str, float, dict]:
        """(should_terminate, user text, turn score, extra) for the whole conversation `messages` (the prompt's
        messages, then the trajectory's); on failure (True, an error text, 0.0, {"error", "timed_out"})."""
        row = self._rows.get(row_key)
        if row is None:
            error, timed_out = "the interaction did not start for this row", False
        else:
            interaction, instance_id, kwargs = row
            value, error, timed_out, _ = await run_guarded("generate_response", self.timeout_s,
                                                           interaction.generate_response, instance_id, messages,
                                                           **kwargs)
            if error is None:
                if isinstance(value, (tuple, list)) and len(value) == 4 and isinstance(value[1], str):
                    terminate, text, score, extra = value
                    score = 0.0 if score is None else score
                    if isinstance(score, (int, float)) and not isinstance(score, bool) and math.isfinite(score):
                        return bool(terminate), text, float(score), dict(extra or {})
                error = f"generate_response returned {value!r:.200}, not (bool, str, score, dict)"
        self._record(row_key, error)
        return True, f"Error in the interaction: {error}", 0.0, {"error": error, "timed_out": timed_out}

    async def finish(self, row_key: str) -> float:
        """The interaction's final `calculate_score` (0.0 on failure), then `finalize_interaction`."""
        row = self._rows.pop(row_key, None)
        if row is None:
            return 0.0
        interaction, instance_id, kwargs = row
        score = 0.0
        if callable(getattr(interaction, "calculate_score", None)):
            args, kw = _call_with_what_fits(interaction.calculate_score, instance_id, kwargs)
            value, error, *_ = await run_guarded("calculate_score", self.timeout_s, interaction.calculate_score,
                                                 *args, **kw)
            if error is None and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                score = float(value)
            else:
                self._record(row_key, error or f"calculate_score returned {value!r:.200}, not a number")
        if callable(getattr(interaction, "finalize_interaction", None)):
            args, kw = _call_with_what_fits(interaction.finalize_interaction, instance_id, kwargs)
            _, error, *_ = await run_guarded("finalize_interaction", self.timeout_s,
                                             interaction.finalize_interaction, *args, **kw)
            if error is not None:
                self._record(row_key, error)
        return score
