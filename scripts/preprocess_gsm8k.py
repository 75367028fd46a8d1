"""Official GSM8K jsonl (question / answer ending in `#### N`) -> verl-layout prompt parquet files.

    python scripts/preprocess_gsm8k.py --input_dir GSM8K_DIR --output_dir data/gsm8k   # GSM8K_DIR: the official jsonl files

Reads train.jsonl and test.jsonl (whichever exist) and writes train.parquet / test.parquet with the columns of verl's
examples/data_preprocess/gsm8k.py: data_source "openai/gsm8k", prompt [{role: user, content: question + instruction}],
ability "math", reward_model {style: rule, ground_truth: N without commas}, extra_info {split, index, answer,
question}.
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
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def ground_truth_of(answer: str, where: str) -> str:
    """The number after `#### ` in an official answer, commas removed."""
    match = _ANSWER.search(answer)
    if match is None:
        raise ValueError(f"{where}: the answer has no '#### N' line: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def convert_split(path: str, split: str, limit: int | None = None) -> list[dict[str, Any]]:
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
            rows.append({
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": example["question"] + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule",
                                 "ground_truth": ground_truth_of(example["answer"], f"{path} line {line_no}")},
                "extra_info": {"split": split, "index": len(rows), "answer": example["answer"],
                               "question": example["question"]},
            })
    if not rows:
        raise ValueError(f"{path} has no examples")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input_dir", required=True, help="folder with the official train.jsonl / test.jsonl")
    parser.add_argument("--output_dir", required=True, help="writes train.parquet / test.parquet here")
    parser.add_argument("--limit", type=int, default=None, help="only the first N examples of each split")
    args = parser.parse_args(argv)
    found = [s for s in ("train", "test") if os.path.isfile(os.path.join(args.input_dir, f"{s}.jsonl"))]
    if not found:
        raise SystemExit(f"--input_dir {args.input_dir} has neither train.jsonl nor test.jsonl")
    for split in found:
        rows = convert_split(os.path.join(args.input_dir, f"{split}.jsonl"), split, args.limit)
        out = os.path.join(args.output_dir, f"{split}.parquet")
        write_prompt_parquet(rows, out)
        print(f"{split}: {len(rows)} examples -> {out}")


if __name__ == "__main__":
    main()
