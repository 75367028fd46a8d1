"""Chat rows for the `tripod train-sft` tests: a char-tokenizer chat template that renders tools and tool calls and
marks assistant turns with {% generation %} (so transformers' return_assistant_tokens_mask gives an independent
assistant mask), and small calculator conversations (a tool call, the tool's answer, `#### N`; some multi-turn,
some with a system message) written to parquet as a preprocessing script writes them (tool-call arguments and the
tool list as JSON strings)."""
from __future__ import annotations

import json
import os
import random

TOOL_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{{ '\\n' }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}}]


def tool_call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


CONVERSATION = [
    {"role": "system", "content": "You can use tools."},
    {"role": "user", "content": "What is 12*7?"},
    {"role": "assistant", "content": "", "tool_calls": [tool_call("12*7")]},
    {"role": "tool", "content": "84"},
    {"role": "assistant", "content": "12*7 = 84. #### 84"},
    {"role": "user", "content": "Thanks. And 2+2?"},
    {"role": "assistant", "content": "#### 4"},
]


def calculator_conversation(rng: random.Random) -> list[dict]:
    """A short conversation of one of three shapes (lengths ~30 to ~200 characters): a direct answer, a tool call
    then the answer, or that with a system message and a second question."""
    a, b, op = rng.randint(1, 99), rng.randint(1, 99), rng.choice("+-*")
    expr, value = f"{a}{op}{b}", eval(f"{a}{op}{b}")  # noqa: S307 (two integers and an operator)
    shape = rng.randrange(3)
    if shape == 0:
        return [{"role": "user", "content": f"{expr}?"}, {"role": "assistant", "content": f"#### {value}"}]
    turns = [{"role": "user", "content": f"What is {expr}?"},
             {"role": "assistant", "content": "", "tool_calls": [tool_call(expr)]},
             {"role": "tool", "content": str(value)},
             {"role": "assistant", "content": f"#### {value}"}]
    if shape == 2:
        c = rng.randint(1, 9)
        turns = [{"role": "system", "content": "Use the calculator."}, *turns,
                 {"role": "user", "content": f"Add {c}."}, {"role": "assistant", "content": f"#### {value + c}"}]
    return turns


def stored(message: dict) -> dict:
    """A message as parquet holds it: tool-call arguments as a JSON string, tool_calls None when there are none."""
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
             for c in message.get("tool_calls", [])]
    return {**message, "tool_calls": calls or None}


def write_chat_parquet(path, conversations: list[list[dict]], key: str = "messages", tools: list | None = None) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {key: [[stored(m) for m in c] for c in conversations]}
    if tools is not None:
        columns["tools"] = [json.dumps(tools)] * len(conversations)
    pq.write_table(pa.table(columns), str(path))
    return str(path)


def make_sft_files(tmp_path, n_train: int = 16, n_val: int = 4) -> dict:
    """{'train': parquet, 'val': parquet, 'train_conversations': [...], 'val_conversations': [...]} of calculator
    conversations (no tools column: the tiny model's 256 positions hold the conversations, not the schema)."""
    out: dict = {}
    for split, n, seed in (("train", n_train, 0), ("val", n_val, 1)):
        rng = random.Random(seed)
        out[f"{split}_conversations"] = [calculator_conversation(rng) for _ in range(n)]
        out[split] = write_chat_parquet(os.path.join(str(tmp_path), f"sft_{split}.parquet"),
                                        out[f"{split}_conversations"])
    return out
