"""engine/agent/interactions.py: verl's `interaction:` YAML, the built-in GSM8K interaction, a class written against
verl's base signatures (calculate_score / finalize_interaction without arguments), and failures that end the row's
conversation with a metric instead of raising."""
import asyncio

import pytest
import yaml

from tripod.engine.agent import InteractionRunner, load_interactions

HERE = "tests.unit.test_agent_interactions"


class VerlBaseStyleInteraction:
    """verl's BaseInteraction signatures, not inheriting tripod's: the last two take no instance id."""
    finalized = 0

    def __init__(self, config: dict):
        self.config, self.name = config, config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id=None, **kwargs) -> str:
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        if kwargs.get("fail"):
            raise RuntimeError("simulator down")
        return False, f"try again ({len(messages)} messages, topic {kwargs['topic']})", None, {"k": 1}

    async def calculate_score(self) -> float:
        return 0.25

    async def finalize_interaction(self) -> None:
        VerlBaseStyleInteraction.finalized += 1


def _write(tmp_path, entries) -> str:
    path = tmp_path / "interaction.yaml"
    path.write_text(yaml.safe_dump({"interaction": entries}))
    return str(path)


def test_gsm8k_and_a_verl_written_interaction_run_per_row(tmp_path):
    path = _write(tmp_path, [
        {"class_name": "tripod.engine.agent.interactions.Gsm8kInteraction", "config": {}},
        {"name": "coach", "class_name": f"{HERE}.VerlBaseStyleInteraction", "config": {"x": 1}}])
    interactions = load_interactions(path)
    assert sorted(interactions) == ["coach", "gsm8k"] and interactions["coach"].config == {"x": 1, "name": "coach"}
    runner = InteractionRunner(interactions, timeout_s=5.0)
    wrong = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "so #### 71"}]
    right = wrong + [{"role": "user", "content": "no"}, {"role": "assistant", "content": "#### 72"}]

    async def episode():
        await runner.start("a", {"name": "gsm8k", "query": "q", "ground_truth": "72"})
        await runner.start("b", {"name": "coach", "topic": "math"})
        replies = [await runner.respond("a", wrong), await runner.respond("a", right), await runner.respond("b", right)]
        return replies, await runner.finish("a"), await runner.finish("b")

    replies, score_a, score_b = asyncio.run(episode())
    assert replies[0] == (False, "Your response is incorrect! You need to reflect on your answer and try again.",
                          0.0, {})
    assert replies[1] == (True, "Your response is correct!", 1.0, {})
    assert replies[2] == (False, "try again (4 messages, topic math)", 0.0, {"k": 1})
    assert score_a == 1.0 and score_b == 0.25 and VerlBaseStyleInteraction.finalized == 1
    assert interactions["gsm8k"]._instances == {} and runner.error_count == 0 and not runner.recent_errors


def test_a_failing_interaction_ends_the_row_with_a_metric(tmp_path):
    runner = InteractionRunner(load_interactions(_write(tmp_path, [
        {"name": "coach", "class_name": f"{HERE}.VerlBaseStyleInteraction", "config": {}}])), timeout_s=5.0)

    async def episode():
        await runner.start("a", {"name": "coach", "fail": True})
        await runner.start("b", {"name": "nobody"})
        return await runner.respond("a", []), await runner.respond("b", [])

    failed, never_started = asyncio.run(episode())
    assert failed[0] is True and failed[3]["error"] == "generate_response: RuntimeError: simulator down"
    assert failed[1] == "Error in the interaction: generate_response: RuntimeError: simulator down"
    assert never_started[0] is True and "did not start" in never_started[3]["error"]
    assert any("'nobody' is not one of ['coach']" in e for e in runner.recent_errors)
    assert runner.error_count == 3  # b's start, a's reply, b's reply

    async def many():  # a long run's failures: all counted, only the last few kept
        for i in range(30):
            await runner.respond("a", [{"role": "user", "content": str(i)}])

    asyncio.run(many())
    assert runner.error_count == 33 and len(runner.recent_errors) == 20


@pytest.mark.parametrize("entries, expected", [
    ([{"class_name": "nowhere.Sim", "config": {}}], r"interaction\[0\]\.class_name 'nowhere\.Sim': cannot import"),
    ([{"class_name": "tripod.engine.agent.interactions.Gsm8kInteraction"}] * 2,
     r"interaction\[1\]: duplicate interaction name 'gsm8k'"),
])
def test_a_bad_interaction_config_is_one_line(tmp_path, entries, expected):
    path = _write(tmp_path, entries)
    with pytest.raises(ValueError, match=expected) as info:
        load_interactions(path)
    assert "\n" not in str(info.value) and str(info.value).startswith(path)
