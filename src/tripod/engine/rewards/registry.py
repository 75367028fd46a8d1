"""Reward functions by data source: `register_reward("name")` to add one, `get_reward_fn(data_source)` to look it up.

A reward function has the signature `fn(solution_str: str, ground_truth: str, extra_info: dict | None = None)
-> float` and must be a module-level function (the reward pool ships it to worker processes by reference).
The built-in rule rewards (GSM8K, arithmetic) register themselves when `tripod.engine.rewards` is imported.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

RewardFn = Callable[..., float]
_REGISTRY: dict[str, RewardFn] = {}


def register_reward(*names: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under one or more data-source names."""
    if not names:
        raise ValueError("register_reward needs at least one data-source name, e.g. @register_reward('my_task')")

    def decorator(fn: RewardFn) -> RewardFn:
        for name in names:
            existing = _REGISTRY.get(name)
            if existing is not None and existing is not fn:
                raise ValueError(f"data source {name!r} already has reward function "
                                 f"{existing.__module__}.{existing.__qualname__}; pick another name")
            _REGISTRY[name] = fn
        return fn

    return decorator


def registered_data_sources() -> list[str]:
    return sorted(_REGISTRY)


def get_reward_fn(data_source: str) -> RewardFn:
    """The reward function of `data_source`; a clear error naming the registered ones otherwise."""
    fn: Optional[RewardFn] = _REGISTRY.get(data_source)
    if fn is None:
        raise ValueError(f"no reward function for data_source={data_source!r}; registered data sources are "
                         f"{registered_data_sources()}. Fix the data's data_source column (data.reward_fn_key) or "
                         "register one with @tripod.engine.rewards.register_reward(...)")
    return fn


def check_data_sources(data_sources: Iterable[str]) -> None:
    """Fail before training if any data source has no reward function (all unknown ones in one message)."""
    unknown = sorted({s for s in data_sources if s not in _REGISTRY})
    if unknown:
        raise ValueError(f"no reward function for data source(s) {unknown}; registered data sources are "
                         f"{registered_data_sources()}. Fix the data's data_source column (data.reward_fn_key) or "
                         "register one with @tripod.engine.rewards.register_reward(...)")
