"""Prompt files as JSON lines (what the offline GPU check writes, so its bundle needs no pyarrow): the same rows, the
same tokenized prompts as the parquet file, and a missing field named in one line."""
import pytest


def test_jsonl_prompts_equal_parquet_prompts(tmp_path):
    from tripod.engine.data import PromptDataset, make_arithmetic_rows, write_prompt_parquet
    from tripod.engine.data.char_tokenizer import char_tokenizer

    rows = make_arithmetic_rows(12, seed=4, max_digits=2, instruction="Answer as #### N.", split="train")
    write_prompt_parquet(rows, tmp_path / "p.parquet")
    write_prompt_parquet(rows, tmp_path / "p.jsonl")
    tok = char_tokenizer()
    a = PromptDataset(str(tmp_path / "p.parquet"), tok, max_prompt_length=256)
    b = PromptDataset(str(tmp_path / "p.jsonl"), tok, max_prompt_length=256)
    assert len(a.items) == len(b.items) == 12
    assert [x["input_ids"] for x in a.items] == [x["input_ids"] for x in b.items]
    assert [x["ground_truth"] for x in a.items] == [x["ground_truth"] for x in b.items]

    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1", "data_source": "arithmetic"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl has no field 'reward_model\.ground_truth'") as e:
        PromptDataset(str(tmp_path / "bad.jsonl"), tok)
    assert "\n" not in str(e.value)
