"""`tripod train-sft`'s chat rows without a model: the assistant mask from prefix renderings equals transformers'
`return_assistant_tokens_mask` on a template marked up with {% generation %} (multi-turn, tools, tool calls, tool
turns) and is 0 on every system, user and tool token; templates that are not append-only or drop tool calls are
refused; truncation; and bad input (a missing messages column, a row longer than data.max_length under
truncation=error) is one line naming the key and file before any model is built."""
import pytest

from tests.helpers.sft_data import CONVERSATION, TOOL_TEMPLATE, TOOLS, write_chat_parquet
from tripod.engine.data.char_tokenizer import char_tokenizer
from tripod.engine.sft.config import SFTDataConfig
from tripod.engine.sft.data import ChatRow, chat_rows, render_chat, truncate


def _tokenizer(template=TOOL_TEMPLATE):
    tok = char_tokenizer()
    tok.chat_template = template
    return tok


def test_assistant_mask_equals_transformers_generation_mask():
    tok = _tokenizer()
    row = render_chat(tok, CONVERSATION, TOOLS)
    hf = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert row.ids == list(hf["input_ids"])
    assert row.mask == list(hf["assistant_masks"]) and sum(row.mask) > 0
    text = "".join(tok.convert_ids_to_tokens([t for t, m in zip(row.ids, row.mask) if m]))
    assert text == '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>\n' \
                   "12*7 = 84. #### 84\n#### 4\n"


def test_system_user_and_tool_tokens_are_never_in_the_mask():
    """Each message's own tokens (its rendering minus the rendering of the messages before it): 0 everywhere for a
    system, user or tool message; for an assistant message 0 exactly on the generation prompt `<assistant>`."""
    tok = _tokenizer()
    row = render_chat(tok, CONVERSATION, TOOLS)
    before = 0
    for i, m in enumerate(CONVERSATION):
        upto = len(tok.apply_chat_template(CONVERSATION[:i + 1], tools=TOOLS, tokenize=True, return_dict=False))
        own = row.mask[before:upto]
        if m["role"] == "assistant":
            prompt = len("<assistant>")
            assert own == [0] * prompt + [1] * (len(own) - prompt), i
        else:
            assert own == [0] * len(own), (i, m["role"])
        before = upto
    assert before == len(row.ids)


def test_templates_that_are_not_append_only_or_drop_tool_calls_are_refused():
    # earlier assistant turns rendered shorter than the last one (as templates that strip old reasoning do)
    shrinking = ("{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' and not loop.last %}"
                 "{{ m['content'][:3] }}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
    with pytest.raises(ValueError, match="not append-only at message 2"):
        render_chat(_tokenizer(shrinking), [m for m in CONVERSATION if "tool_calls" not in m and m["role"] != "tool"])
    with pytest.raises(ValueError, match="does not render its tool call to 'calculator'"):
        render_chat(char_tokenizer(), CONVERSATION, TOOLS)  # the plain template ignores tool_calls


def test_truncation_keeps_the_last_or_the_first_tokens():
    row = ChatRow(list(range(10)), [0, 0, 0, 1, 1, 1, 0, 0, 1, 1])
    assert truncate(row, 4, "left") == ChatRow([6, 7, 8, 9], [0, 0, 1, 1])
    assert truncate(row, 4, "right") == ChatRow([0, 1, 2, 3], [0, 0, 0, 1])
    assert truncate(row, 10, "right") == row


def _write_rows(path, conversations, key="messages"):
    return write_chat_parquet(path, conversations, key, TOOLS)


def test_chat_rows_read_parquet_and_name_the_bad_input(tmp_path):
    tok = _tokenizer()
    path = _write_rows(tmp_path / "ok.parquet", [CONVERSATION, CONVERSATION[:3]])
    rows = chat_rows([path], tok, SFTDataConfig(max_length=512))
    assert rows[0] == render_chat(tok, CONVERSATION, TOOLS) and len(rows) == 2

    wrong = _write_rows(tmp_path / "wrong.parquet", [CONVERSATION], key="conversation")
    with pytest.raises(ValueError, match=r"wrong\.parquet: no column 'messages' \(data\.messages_key\)"):
        chat_rows([wrong], tok, SFTDataConfig())
    assert len(chat_rows([wrong], tok, SFTDataConfig(messages_key="conversation", max_length=512))) == 1

    n = len(rows[0].ids)
    with pytest.raises(ValueError, match=rf"ok\.parquet row 0: {n} tokens > data\.max_length={n - 1} "
                                         r"\(data\.truncation=error\)"):
        chat_rows([path], tok, SFTDataConfig(max_length=n - 1))
    cut = chat_rows([path], tok, SFTDataConfig(max_length=n - 1, truncation="left"))[0]
    assert cut == truncate(rows[0], n - 1, "left")

    no_assistant = _write_rows(tmp_path / "user_only.parquet", [CONVERSATION[:2]])
    with pytest.raises(ValueError, match=r"user_only\.parquet row 0: no assistant token"):
        chat_rows([no_assistant], tok, SFTDataConfig())


def test_the_mask_ends_at_the_eos_of_a_turn():
    """What a template writes after the EOS that ends an assistant turn (a newline here, as Qwen's and SmolLM2's
    templates do after <|im_end|>) is not generated by the model: 0 in the mask; the EOS itself is trained."""
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>"
                "{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = _tokenizer(template)
    row = render_chat(tok, [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "#### 2"}])
    trained = tok.convert_ids_to_tokens([t for t, m in zip(row.ids, row.mask) if m])
    assert trained == list("#### 2") + ["<eos>"] and tok.convert_ids_to_tokens(row.ids[-2:]) == ["<eos>", "\n"]
