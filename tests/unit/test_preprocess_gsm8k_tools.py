"""scripts/preprocess_gsm8k.py --tools: GSM8K rows in verl's multi-turn layout (gsm8k_multiturn_w_tool.py) for
recipes/qwen3/4b-gsm8k-tool-grpo.yaml. On a few GSM8K-like rows written here: the ground truth reaches reward_model and
every tool's create_kwargs, the rows' tools_kwargs name exactly the tools of the recipe's tool config, and the trainer's
preflight check (engine/agent/rollout.py `check_agent_inputs`: the recipe's tools loaded, every row's extra_info
validated through the prompt dataset the trainer builds) accepts them. Planted: one row whose tools_kwargs names a tool
the config lacks is refused in one line naming the row and the tool."""
from __future__ import annotations

import importlib.util
import json

import pyarrow.parquet as pq
import pytest

from tests.helpers.agent import QWEN3_TEMPLATE, chatml_tokenizer
from tests.helpers.common import REPO_ROOT

RECIPE = "recipes/qwen3/4b-gsm8k-tool-grpo.yaml"
EXAMPLES = [  # GSM8K's answer layout: worked steps, then `#### N` (commas allowed in N)
    ({"question": "Tom has 3 bags of 14 apples. How many apples does he have?",
      "answer": "He has 3 * 14 = <<3*14=42>>42 apples.\n#### 42"}, "42"),
    ({"question": "A car costs $1,000 plus $250 of tax. What does it cost in all?",
      "answer": "1,000 + 250 = <<1000+250=1250>>1,250\n#### 1,250"}, "1250"),
    ({"question": "The temperature was 5 degrees and fell by 8. What is it now?",
      "answer": "5 - 8 = <<5-8=-3>>-3\n#### -3"}, "-3"),
]


def _script():
    spec = importlib.util.spec_from_file_location("preprocess_gsm8k", REPO_ROOT / "scripts" / "preprocess_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def recipe_rows(tmp_path, monkeypatch, tool_configs_load):
    """(the recipe's config, the preprocessed train rows, their parquet path), run from the checkout as the recipe's
    relative paths expect."""
    from tripod.engine.config import load_config

    monkeypatch.chdir(REPO_ROOT)
    cfg = load_config(RECIPE, [])
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "train.jsonl").write_text("".join(json.dumps(ex) + "\n" for ex, _ in EXAMPLES))
    tool_config = cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path
    _script().main(["--input_dir", str(raw), "--output_dir", str(tmp_path / "out"), "--tools", tool_config])
    path = tmp_path / "out" / "train.parquet"
    return cfg, pq.read_table(path).to_pylist(), str(path)


def test_rows_carry_the_ground_truth_and_name_the_recipes_tools(recipe_rows):
    from tripod.engine.agent import load_tools
    from tripod.engine.rewards import get_reward_fn

    cfg, rows, _ = recipe_rows
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and cfg.algorithm.adv_estimator == "grpo"
    tools = list(load_tools(mt.tool_config_path))
    assert tools == ["calculator", "code_interpreter"]
    script = _script()
    assert len(rows) == len(EXAMPLES)
    for i, (row, (example, truth)) in enumerate(zip(rows, EXAMPLES)):
        user = example["question"] + " " + script.INSTRUCTION
        assert row["data_source"] == "openai/gsm8k" and row["reward_model"] == {"style": "rule", "ground_truth": truth}
        assert row["prompt"] == [{"role": "system", "content": script.TOOLS_SYSTEM}, {"role": "user", "content": user}]
        info = row["extra_info"]
        assert info["tools_kwargs"] == {name: {"create_kwargs": {"ground_truth": truth}} for name in tools}
        assert info["interaction_kwargs"] == {"name": "gsm8k", "query": user, "ground_truth": truth}
        assert info["need_tools_kwargs"] is True and info["index"] == i and info["answer"] == example["answer"]
    assert "####" in script.TOOLS_SYSTEM  # the answer format the reward below reads
    reward = get_reward_fn(rows[1]["data_source"])
    assert reward("<tool_call>...</tool_call> so the total is\n#### 1250", "1250") == 1.0
    assert reward("the total is 1250", "1250") == 0.0


def test_the_trainers_preflight_accepts_the_rows_and_refuses_an_unknown_tool(recipe_rows, tmp_path):
    from tripod.engine.agent.rollout import check_agent_inputs
    from tripod.engine.data.dataset import PromptDataset, prompt_tools, write_prompt_parquet

    cfg, rows, path = recipe_rows
    tok = chatml_tokenizer(QWEN3_TEMPLATE)
    tools = prompt_tools(cfg)
    assert [t["function"]["name"] for t in tools] == ["calculator", "code_interpreter"]

    def dataset(file: str) -> PromptDataset:
        ds = PromptDataset(file, tok, max_prompt_length=4096, tools=tools)
        assert len(ds) == len(EXAMPLES)
        return ds

    check_agent_inputs(cfg, tok, [dataset(path)])
    rows[1]["extra_info"]["tools_kwargs"]["search"] = {"create_kwargs": {"ground_truth": "1250"}}  # the plant
    bad = str(tmp_path / "bad.parquet")
    write_prompt_parquet(rows, bad)
    with pytest.raises(ValueError, match=r"^row 1: extra_info\.tools_kwargs names tool 'search', which "
                                         r"tool_config_path does not define \(tools: calculator, code_interpreter\)"):
        check_agent_inputs(cfg, tok, [dataset(bad)])
