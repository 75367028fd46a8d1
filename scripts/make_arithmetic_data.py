"""Write random arithmetic problems as train/test prompt parquet files (data_source "arithmetic", `#### N` answers).

    python scripts/make_arithmetic_data.py --output_dir outputs/data/arithmetic --train_count 2048 --test_count 256 \
        --min_digits 1 --max_digits 2 --ops + - --seed 0
"""
from __future__ import annotations

import argparse
import os

from tripod.engine.data.arithmetic import INSTRUCTION, OPERATORS, make_arithmetic_splits
from tripod.engine.data.dataset import write_prompt_parquet


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True, help="writes train.parquet and test.parquet here")
    parser.add_argument("--train_count", type=int, default=2048)
    parser.add_argument("--test_count", type=int, default=256)
    parser.add_argument("--min_digits", type=int, default=1)
    parser.add_argument("--max_digits", type=int, default=2)
    parser.add_argument("--ops", nargs="+", default=["+", "-"], choices=list(OPERATORS))
    parser.add_argument("--num_operands", type=int, default=2)
    parser.add_argument("--no_negative", action="store_true", help="only problems with a non-negative answer")
    parser.add_argument("--instruction", default=INSTRUCTION, help="appended to every question")
    parser.add_argument("--seed", type=int, default=0, help="the test split uses seed + 1")
    parser.add_argument("--train_format_score", type=float, default=0.0,
                        help="reward for a well-formed wrong answer in the train split (test is exact match)")
    args = parser.parse_args(argv)
    common = dict(min_digits=args.min_digits, max_digits=args.max_digits, ops=args.ops,
                  num_operands=args.num_operands, allow_negative=not args.no_negative, instruction=args.instruction)
    train, test = make_arithmetic_splits(args.train_count, args.test_count, seed=args.seed,
                                         train_format_score=args.train_format_score, **common)
    for name, rows in (("train", train), ("test", test)):
        write_prompt_parquet(rows, os.path.join(args.output_dir, f"{name}.parquet"))
    print(f"wrote {len(train)} train / {len(test)} test problems to {args.output_dir} "
          f"(the {len(test)} test problems are distinct and none occurs in train)")


if __name__ == "__main__":
    main()
