"""Official GSM8K jsonl (question / answer ending in `#### N`) -> verl-layout prompt parquet files.

    python scripts/preprocess_gsm8k.py --input_dir GSM8K_DIR --output_dir data/gsm8k   # GSM8K_DIR: the official jsonl files
    python scripts/preprocess_gsm8k.py --input_dir GSM8K_DIR --output_dir data/gsm8k-tools \
        --tools recipes/qwen3/gsm8k-tools.yaml                                            # multi-turn with tools

Reads train.jsonl and test.jsonl (whichever exist) and writes train.parquet / test.parquet with the columns of verl's
examples/data_preprocess/gsm8k.py: data_source "openai/gsm8k", prompt [{role: user, content: question + instruction}],
ability "math", reward_model {style: rule, ground_truth: N without commas}, extra_info {split, index, answer,
question}.

With `--tools TOOL_YAML` (a multi_turn.tool_config_path file) the rows are those of verl's
examples/data_preprocess/gsm8k_multiturn_w_tool.py for the tools that file defines: a system message asking the model
to compute with the tools and end with `#### N`, and extra_info gains need_tools_kwargs, tools_kwargs {tool_name:
{create_kwargs: {ground_truth}}} for every tool of the YAML (tripod's built-in tools ignore the ground truth; a verl
reward tool reads it) and interaction_kwargs {name: gsm8k, query, ground_truth} (what the GSM8K interaction of
src/tripod/engine/agent/configs/gsm8k_interaction.yaml reads).
"""
from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

from tripod.engine.data.dataset import write_prompt_parquet

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TOOLS_SYSTEM = ("You are a math expert. Solve the problem step by step. Do every calculation with the tools you are "
                "given instead of in your head: call a tool, read its result, and call again when needed. When you "
                "are done, write the final answer on its own line as `#### <number>`: the number only, without units "
                "or a $ sign.")
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def ground_truth_of(answer: str, where: str) -> str:
    """The number after `#### ` in an official answer, commas removed."""
    match = _ANSWER.search(answer)
    if match is None:
        raise ValueError(f"{where}: the answer has no '#### N' line: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def tool_names_of(tool_config_path: str) -> list[str]:
    """The tool names (their schemas' function names) a `tools:` YAML defines, loaded as the trainer loads them."""
    from tripod.engine.agent import load_tools

    names = list(load_tools(tool_config_path))
    if not names:
        raise ValueError(f"--tools {tool_config_path} defines no tools")
    return names


def tool_fields(prompt_text: str, ground_truth: str, tool_names: list[str]) -> dict[str, Any]:
    """verl's multi-turn extra_info columns for one row."""
    return {"need_tools_kwargs": True,
            "tools_kwargs": {name: {"create_kwargs": {"ground_truth": ground_truth}} for name in tool_names},
            "interaction_kwargs": {"name": "gsm8k", "query": prompt_text, "ground_truth": ground_truth}}


def convert_split(path: str, split: str, limit: int | None = None,
                  tool_names: list[str] | None = None) -> list[dict[str, Any]]:
    """The rows of one split; with `tool_names`, the multi-turn layout (module docstring)."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(rows) >= limit:
                break
            example = json.loads(line)
            missing = [k for k in ("question", "answer") if k not in example]
            if missing:
                raise ValueError(f"{path} line {line_no}: missing {missing}; GSM8K jsonl has 'question' and 'answer'")
            user = example["question"] + " " + INSTRUCTION
            truth = ground_truth_of(example["answer"], f"{path} line {line_no}")
            info = {"split": split, "index": len(rows), "answer": example["answer"], "question": example["question"]}
            prompt = [{"role": "user", "content": user}]
            if tool_names is not None:
                prompt = [{"role": "system", "content": TOOLS_SYSTEM}, *prompt]
                info.update(tool_fields(user, truth, tool_names))
            rows.append({"data_source": DATA_SOURCE, "prompt": prompt, "ability": "math",
                         "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": info})
    if not rows:
        raise ValueError(f"{path} has no examples")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input_dir", required=True, help="folder with the official train.jsonl / test.jsonl")
    parser.add_argument("--output_dir", required=True, help="writes train.parquet / test.parquet here")
    parser.add_argument("--limit", type=int, default=None, help="only the first N examples of each split")
    parser.add_argument("--tools", default=None, metavar="TOOL_YAML",
                        help="multi-turn rows with tools_kwargs for the tools of this multi_turn.tool_config_path file")
    args = parser.parse_args(argv)
    tool_names = tool_names_of(args.tools) if args.tools else None
    found = [s for s in ("train", "test") if os.path.isfile(os.path.join(args.input_dir, f"{s}.jsonl"))]
    if not found:
        raise SystemExit(f"--input_dir {args.input_dir} has neither train.jsonl nor test.jsonl")
    for split in found:
        rows = convert_split(os.path.join(args.input_dir, f"{split}.jsonl"), split, args.limit, tool_names)
        out = os.path.join(args.output_dir, f"{split}.parquet")
        write_prompt_parquet(rows, out)
        print(f"{split}: {len(rows)} examples -> {out}")


if __name__ == "__main__":
    main()
