"""Prompt parquet datasets, the resumable loader, token-budget batching, pad/unpad, and the data scripts."""
import importlib.util
import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tripod.engine.data import (
    PromptDataLoader,
    PromptDataset,
    balanced_partition,
    make_arithmetic_rows,
    packed_position_ids,
    pad_input,
    pad_sequences,
    split_by_token_budget,
    unpad_input,
    write_prompt_parquet,
)
from tripod.engine.rewards import check_data_sources, get_reward_fn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GSM8K_DIR = os.path.join(REPO, "..", "shared", "data", "gsm8k")  # ../shared beside the checkout
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    """A character-level tokenizer with a chat template, built offline."""
    chars = [chr(c) for c in range(32, 127)] + ["\n", "’", "\u2013"]
    vocab = {"<unk>": 0, "<bos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>",
                                   chat_template=CHAT_TEMPLATE)


def _rows(texts, source="arithmetic"):
    return [{"data_source": source, "prompt": [{"role": "user", "content": t}],
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}}
            for i, t in enumerate(texts)]


# ------------------------------------------------------------------------------------------------ scripts
def _script(name):
    """Import scripts/<name>.py as a module (its main(argv) is the CLI) without a subprocess start-up."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_preprocess_gsm8k_first_rows(tmp_path, tokenizer):
    if not os.path.isfile(os.path.join(GSM8K_DIR, "test.jsonl")):
        pytest.skip("GSM8K data not present")
    src = tmp_path / "raw"
    src.mkdir()
    with open(os.path.join(GSM8K_DIR, "test.jsonl")) as f:
        official = [json.loads(next(f)) for _ in range(12)]
    (src / "test.jsonl").write_text("".join(json.dumps(ex) + "\n" for ex in official))
    out = tmp_path / "pq"
    _script("preprocess_gsm8k").main(["--input_dir", str(src), "--output_dir", str(out)])
    rows = pq.read_table(out / "test.parquet").to_pylist()
    assert len(rows) == 12
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    for i, (row, ex) in enumerate(zip(rows, official)):
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": ex["question"] + " " + instruction}]
        assert row["reward_model"] == {"style": "rule",
                                       "ground_truth": ex["answer"].split("#### ")[-1].replace(",", "")}
        assert row["extra_info"] == {"split": "test", "index": i, "answer": ex["answer"], "question": ex["question"]}
    ds = PromptDataset(str(out / "test.parquet"), tokenizer, max_prompt_length=2048)
    assert len(ds) == 12 and ds.data_sources == {"openai/gsm8k"}
    first = ds[0]
    rendered = tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(first["input_ids"]) .replace(" ", "") == rendered.replace(" ", "")
    assert len(first["input_ids"]) == len(rendered)  # one token per character
    assert get_reward_fn(first["data_source"])(official[0]["answer"], first["ground_truth"]) == 1.0


def test_make_arithmetic_data(tmp_path, tokenizer):
    _script("make_arithmetic_data").main(["--output_dir", str(tmp_path), "--train_count", "40", "--test_count", "10",
                                          "--ops", "+", "-", "*", "/", "--num_operands", "3", "--max_digits", "2",
                                          "--seed", "3"])
    ds = PromptDataset([str(tmp_path / "train.parquet"), str(tmp_path / "test.parquet")], tokenizer,
                       max_prompt_length=512)
    assert len(ds) == 50 and ds.data_sources == {"arithmetic"}
    for item in ds.items:
        expression = item["extra_info"]["expression"]
        assert eval(expression) == int(item["ground_truth"])  # Python's own arithmetic as the reference
        assert get_reward_fn("arithmetic")(f"so... #### {item['ground_truth']}", item["ground_truth"]) == 1.0
    assert [r["extra_info"]["expression"] for r in make_arithmetic_rows(5, seed=3)] == \
           [r["extra_info"]["expression"] for r in make_arithmetic_rows(5, seed=3)]
    non_negative = make_arithmetic_rows(200, seed=1, allow_negative=False)
    assert all(int(r["reward_model"]["ground_truth"]) >= 0 for r in non_negative)
    with pytest.raises(ValueError, match="ops"):
        make_arithmetic_rows(3, ops=["%"])


# ------------------------------------------------------------------------------------------------ dataset errors
def test_dataset_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="nothere.parquet does not exist"):
        PromptDataset(str(tmp_path / "nothere.parquet"), tokenizer)
    empty = tmp_path / "empty.parquet"
    schema = pa.Table.from_pylist(_rows(["x"])).schema
    pq.write_table(schema.empty_table(), empty)
    with pytest.raises(ValueError, match=r"empty\.parquet is empty \(0 rows\)"):
        PromptDataset(str(empty), tokenizer)
    no_col = tmp_path / "nocol.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "hi", "data_source": "arithmetic",
                                          "reward_model": {"ground_truth": "1"}}]), no_col)
    with pytest.raises(ValueError, match=r"nocol\.parquet has no column 'prompt'; its columns are "
                                         r"\['question', 'data_source', 'reward_model'\]"):
        PromptDataset(str(no_col), tokenizer)
    no_gt = tmp_path / "nogt.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "data_source": "a", "reward_model": {"style": "r"}}]),
                   no_gt)
    with pytest.raises(ValueError, match=r"nogt\.parquet: column 'reward_model' must be a struct with field "
                                         r"'ground_truth'"):
        PromptDataset(str(no_gt), tokenizer)
    long_file = tmp_path / "long.parquet"
    write_prompt_parquet(_rows(["a" * 50, "b" * 60]), long_file)
    with pytest.raises(ValueError, match=r"every prompt is longer than data.max_prompt_length=20 tokens"):
        PromptDataset(str(long_file), tokenizer, max_prompt_length=20)
    with pytest.raises(ValueError, match="data.filter_overlong_prompts=true"):
        PromptDataset(str(long_file), tokenizer, max_prompt_length=55, filter_overlong_prompts=False)
    plain = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="<unk>")
    with pytest.raises(ValueError, match="no chat template; set data.apply_chat_template=false"):
        PromptDataset(str(long_file), plain, max_prompt_length=100)
    unknown = tmp_path / "unknown.parquet"
    write_prompt_parquet(_rows(["hello"], source="my/unknown_task"), unknown)
    with pytest.raises(ValueError, match=r"no reward function for data source\(s\) \['my/unknown_task'\]"):
        check_data_sources(PromptDataset(str(unknown), tokenizer).data_sources)


def test_overlong_filtering_and_plain_text(tmp_path, tokenizer):
    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefgh 0123") for _ in range(rng.randint(1, 80))) for _ in range(60)]
    path = tmp_path / "mixed.parquet"
    write_prompt_parquet(_rows(texts), path)
    ds = PromptDataset(str(path), tokenizer, max_prompt_length=60)
    rendered = [len(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  tokenize=False)) for t in texts]
    kept = [i for i, n in enumerate(rendered) if n <= 60]
    assert 0 < len(kept) < 60 and ds.num_filtered == 60 - len(kept)
    assert [it["index"] for it in ds.items] == kept
    assert [len(it["input_ids"]) for it in ds.items] == [rendered[i] for i in kept]
    assert [it["ground_truth"] for it in ds.items] == [str(i) for i in kept]
    raw = PromptDataset(str(path), tokenizer, max_prompt_length=100, apply_chat_template=False)
    assert [len(it["input_ids"]) for it in raw.items] == [len(t) for t in texts]


# ------------------------------------------------------------------------------------------------ loader
def test_loader_is_deterministic_and_resumable(tmp_path, tokenizer):
    path = tmp_path / "p.parquet"
    write_prompt_parquet(_rows([f"q{i}" for i in range(23)]), path)
    ds = PromptDataset(str(path), tokenizer)

    def run(loader, epochs):
        seen = []
        for _ in range(loader.epoch, epochs):
            seen += [tuple(b.indices) for b in loader]
        return seen

    full = run(PromptDataLoader(ds, 5, seed=7), 3)
    assert len(full) == 3 * 4  # 23 // 5 batches per epoch, the remainder dropped
    for epoch in range(3):
        flat = [i for b in full[epoch * 4:(epoch + 1) * 4] for i in b]
        assert len(set(flat)) == 20  # no repeats inside an epoch
    assert full[:4] != full[4:8]  # every epoch has its own order
    assert full == run(PromptDataLoader(ds, 5, seed=7), 3)  # same seed, same batches
    assert full != run(PromptDataLoader(ds, 5, seed=8), 3)
    for stop_after in (3, 4, 6):  # interrupt mid-epoch, at an epoch boundary, and in the next epoch
        first = PromptDataLoader(ds, 5, seed=7)
        head, it = [], iter(first)
        while len(head) < stop_after:
            try:
                head.append(tuple(next(it).indices))
            except StopIteration:
                it = iter(first)
        state = first.state_dict()
        resumed = PromptDataLoader(ds, 5, seed=7)
        resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a checkpoint round trip
        assert head + run(resumed, 3) == full
    with pytest.raises(ValueError, match="data.seed"):
        PromptDataLoader(ds, 5, seed=9).load_state_dict(state)
    ordered = PromptDataLoader(ds, 10, shuffle=False, drop_last=False)
    assert [b.indices for b in ordered] == [list(range(10)), list(range(10, 20)), [20, 21, 22]]
    with pytest.raises(ValueError, match="data.train_batch_size=30 is larger than the 23 prompts"):
        PromptDataLoader(ds, 30)


# ------------------------------------------------------------------------------------------------ batching
@pytest.mark.parametrize("seed", range(6))
def test_split_by_token_budget_invariants(seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 64))]
    budget = rng.randint(300, 1200)
    min_micro = rng.randint(1, min(4, len(lens)))
    groups = split_by_token_budget(lens, budget, min_num_micro_batches=min_micro)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))  # a partition
    loads = [sum(lens[i] for i in g) for g in groups]
    assert max(loads) <= budget and all(groups)
    assert len(groups) >= max(min_micro, -(-sum(lens) // budget))
    assert max(loads) - min(loads) <= max(lens)  # LPT balance bound
    assert all(g == sorted(g) for g in groups) and [g[0] for g in groups] == sorted(g[0] for g in groups)


def test_split_by_token_budget_errors_and_edges():
    assert split_by_token_budget([], 10) == []
    assert split_by_token_budget([9, 1, 8, 2], 10) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="sequence 1 has 11 tokens.*ppo_max_token_len_per_gpu"):
        split_by_token_budget([3, 11, 2], 10)
    with pytest.raises(ValueError, match="min_num_micro_batches=4 exceeds the 3 sequences"):
        split_by_token_budget([1, 2, 3], 10, min_num_micro_batches=4)


@pytest.mark.parametrize("seed", range(4))
def test_balanced_partition_is_an_equal_count_partition_of_balanced_tokens(seed):
    rng = random.Random(seed)
    parts = rng.choice([2, 3, 4])
    lens = [rng.randint(1, 300) for _ in range(parts * rng.randint(1, 12))]
    groups = balanced_partition(lens, parts)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert {len(g) for g in groups} == {len(lens) // parts} and all(g == sorted(g) for g in groups)
    loads = [sum(lens[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= max(lens)
    assert balanced_partition([50, 49, 1, 2], 2) == [[0, 2], [1, 3]]  # 51 / 51 tokens, where halves give 99 / 3
    with pytest.raises(ValueError, match="cannot split 3 sequences into 2 equal parts"):
        balanced_partition([1, 2, 3], 2)


@pytest.mark.parametrize("side", ["left", "right"])
def test_pad_unpad_round_trip(side):
    gen = torch.Generator().manual_seed(1 if side == "left" else 2)
    lengths = torch.randint(1, 12, (5,), generator=gen).tolist()
    seqs = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in lengths]
    ids, mask = pad_sequences(seqs, pad_value=0, side=side)
    assert ids.shape == (5, max(lengths)) and mask.sum(1).tolist() == lengths
    packed, indices, cu_seqlens, max_seqlen = unpad_input(ids, mask)
    assert packed.shape == (1, sum(lengths)) and packed[0].tolist() == [t for s in seqs for t in s]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0] + list(torch.tensor(lengths).cumsum(0))
    assert max_seqlen == max(lengths)
    assert torch.equal(pad_input(packed, indices, 5, ids.shape[1]), ids)
    hidden = torch.randn(5, ids.shape[1], 7, generator=gen, dtype=torch.float64)
    packed_h, idx_h, _, _ = unpad_input(hidden, mask)
    restored = pad_input(packed_h, idx_h, 5, ids.shape[1], pad_value=float("nan"))
    assert torch.equal(restored[mask.bool()], hidden[mask.bool()]) and restored[~mask.bool()].isnan().all()
    positions = packed_position_ids(cu_seqlens)
    assert positions[0].tolist() == [p for n in lengths for p in range(n)]


def test_arithmetic_splits_hold_out_the_validation_problems():
    from tripod.engine.data import make_arithmetic_splits

    problem = dict(min_digits=1, max_digits=1, ops=("+", "-"), allow_negative=False)
    train, test = make_arithmetic_splits(512, 64, seed=0, **problem)
    held_out = [r["extra_info"]["expression"] for r in test]
    assert len(set(held_out)) == 64  # distinct
    assert not set(held_out) & {r["extra_info"]["expression"] for r in train}  # none seen in training
    with pytest.raises(ValueError, match="problem space is too small"):
        make_arithmetic_splits(8, 200, seed=0, **problem)  # only 155 one-digit problems exist
