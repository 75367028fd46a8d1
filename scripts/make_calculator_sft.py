"""Write synthetic calculator transcripts as `tripod train-sft` chat rows (train.parquet, val.parquet).

Each row is one conversation: a system message naming the `calculator` tool and the hermes call syntax, an
arithmetic question, the assistant's hermes `<tool_call>` to `calculator` with {"expression": ...}, the tool's answer
(role `tool`), and the final assistant turn `#### N`; with --word_fraction some questions are word problems whose
expression the model has to write. Operands have 2 to 3 digits, so the model cannot do without the
tool. Columns: `messages` (data.messages_key) and `tools` (data.tools_key: the calculator's OpenAI function schema,
as a JSON string). The validation questions are distinct from the training ones.

--call_format content (default) writes the call as the assistant message's text, exactly what a model emits in the
hermes format: every chat template renders it, including those that ignore `tool_calls` (SmolLM2's). --call_format
tool_calls writes OpenAI `tool_calls` (arguments as a JSON string) for templates that render them (Qwen2.5, Qwen3).

    python scripts/make_calculator_sft.py --output_dir outputs/data/calculator_sft --train_count 512 --val_count 64
"""
from __future__ import annotations

import argparse
import json
import os
import random

TOOL_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (integers, + - * and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                   "description": "e.g. 12*(3+4)"}},
                   "required": ["expression"]}}}
SYSTEM_PROMPT = ("You are a helpful assistant with one tool, calculator, which evaluates an arithmetic expression. "
                 "To use it, reply with only\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": "
                 "\"...\"}}\n</tool_call>\nYou will get its result; then end your answer with #### followed by the "
                 "number.")
QUESTIONS = ("What is {e}?", "Compute {e}.", "Calculate {e}.", "What does {e} equal?")
WORD_PROBLEMS = {  # the expression is the model's to write: "{a}{op}{b}"
    "+": "{name} has {a} marbles and finds {b} more. How many marbles does {name} have now?",
    "-": "{name} had {a} stickers and gave away {b} of them. How many stickers are left?",
    "*": "Each box holds {a} pencils. How many pencils are in {b} boxes?",
}
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana")


def hermes_call(expression: str) -> str:
    """A hermes tool call as a model writes it (Qwen2.5's template renders OpenAI tool_calls the same way)."""
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "\n</tool_call>"


def problem(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    op = rng.choice("+-*")
    expression = f"{a}{op}{b}"
    return expression, {"+": a + b, "-": a - b, "*": a * b}[op]


def question(expression: str, value: int, rng: random.Random, word: bool) -> str:
    """The question: a template naming the expression, or (`word`, when the answer is not negative) a word problem."""
    if word and value >= 0:
        op = next(c for c in "+-*" if c in expression[1:])
        a, b = expression.split(op, 1)
        return WORD_PROBLEMS[op].format(name=rng.choice(NAMES), a=a, b=b)
    return rng.choice(QUESTIONS).format(e=expression)


def conversation(expression: str, value: int, rng: random.Random, call_format: str, word: bool = False) -> list[dict]:
    text = question(expression, value, rng, word)
    if call_format == "content":
        call = {"role": "assistant", "content": hermes_call(expression)}
    else:
        call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": expression})}}]}
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}, call,
            {"role": "tool", "content": str(value)}, {"role": "assistant", "content": f"#### {value}"}]


def make_splits(train_count: int, val_count: int, seed: int, call_format: str,
                word_fraction: float = 0.0) -> tuple[list, list]:
    """(train conversations, validation conversations): distinct expressions, none of validation's in train; about
    `word_fraction` of the questions are word problems."""
    rng, seen, splits = random.Random(seed), set(), ([], [])
    for split, count in ((1, val_count), (0, train_count)):
        while len(splits[split]) < count:
            expression, value = problem(rng)
            if expression not in seen:
                seen.add(expression)
                word = word_fraction > 0 and rng.random() < word_fraction  # the default draws as before
                splits[split].append(conversation(expression, value, rng, call_format, word))
    return splits


def write_rows(conversations: list[list[dict]], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    messages = [[{**m, "tool_calls": m.get("tool_calls")} for m in c] for c in conversations]
    pq.write_table(pa.table({"messages": messages, "tools": [json.dumps([TOOL_SCHEMA])] * len(messages)}), path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True, help="writes train.parquet and val.parquet here")
    parser.add_argument("--train_count", type=int, default=512)
    parser.add_argument("--val_count", type=int, default=64)
    parser.add_argument("--call_format", choices=("content", "tool_calls"), default="content")
    parser.add_argument("--word_fraction", type=float, default=0.0,
                        help="share of word problems ('Each box holds 36 pencils...'): the model writes the expression")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, val = make_splits(args.train_count, args.val_count, args.seed, args.call_format, args.word_fraction)
    for name, rows in (("train", train), ("val", val)):
        write_rows(rows, os.path.join(args.output_dir, f"{name}.parquet"))
    print(f"wrote {len(train)} train / {len(val)} val calculator transcripts to {args.output_dir}")


if __name__ == "__main__":
    main()
