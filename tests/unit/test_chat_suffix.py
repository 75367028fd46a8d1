"""Tool and user turns rendered as a suffix by the chat template (engine/agent/chat_suffix.py): SmolLM2's template and
Qwen2.5 / Qwen3-style ones (tests/helpers/agent.py) are append-only for tool turns; Qwen3's is not for a user turn
after a reasoning turn (it drops the earlier <think> block), which the check catches and the fallback renders."""
from __future__ import annotations

import pytest

from tests.helpers.agent import QWEN3_TEMPLATE, QWEN25_TEMPLATE, SMOLLM2_TEMPLATE, chatml_tokenizer
from tripod.engine.agent.chat_suffix import PLACEHOLDER_PROMPT, ChatSuffix

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
GEN = "<|im_end|>\n<|im_start|>assistant\n"


def test_smollm2_tool_turn_is_the_templates_text_after_the_models_end_of_turn():
    tok = chatml_tokenizer(SMOLLM2_TEMPLATE)
    suffix = ChatSuffix(tok)
    ids, text, ok = suffix.suffix_ids([{"role": "assistant", "content": CALL}], [{"role": "tool", "content": "5"}],
                                      "<|im_end|>")
    assert ok and text == "\n<|im_start|>tool\n5" + GEN
    assert tok.decode(ids) == text
    # the whole conversation as the template renders it == the prompt, the model's turn, then this suffix
    history = [PLACEHOLDER_PROMPT, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "5"}]
    full = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert full.endswith(CALL + "<|im_end|>" + text)


def test_qwen25_tool_turn_holds_every_call_of_the_turn_in_one_user_message():
    tok = chatml_tokenizer(QWEN25_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {
        "type": "object", "properties": {}, "required": []}}}]
    suffix = ChatSuffix(tok, tools)
    new = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}]
    _, text, ok = suffix.suffix_ids([{"role": "assistant", "content": CALL + CALL}], new, "<|im_end|>")
    assert ok and text == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n" \
                          "</tool_response>" + GEN
    # one message at a time would not be append-only: the first tool message's <|im_end|> moves behind the second
    one = suffix.render([PLACEHOLDER_PROMPT, {"role": "assistant", "content": CALL}, new[0]], False)
    two = suffix.render([PLACEHOLDER_PROMPT, {"role": "assistant", "content": CALL}, *new], False)
    assert not two.startswith(one)


def test_qwen3_tool_turns_are_append_only_but_a_user_turn_after_reasoning_is_not():
    tok = chatml_tokenizer(QWEN3_TEMPLATE)
    suffix = ChatSuffix(tok)
    thought = "<think>\nadd them\n</think>\n\n" + CALL
    _, text, ok = suffix.suffix_ids([{"role": "assistant", "content": thought}], [{"role": "tool", "content": "5"}],
                                    "<|im_end|>")
    assert ok and text == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>" + GEN
    assert suffix.non_append_only == 0
    history = [{"role": "assistant", "content": thought}, {"role": "tool", "content": "5"},
               {"role": "assistant", "content": "<think>\nok\n</think>\n\n#### 5"}]
    user = [{"role": "user", "content": "again"}]
    before = suffix.render([PLACEHOLDER_PROMPT, *history], False)
    after = suffix.render([PLACEHOLDER_PROMPT, *history, *user], True)
    assert not after.startswith(before)  # the earlier <think> blocks are gone from `after`
    _, text, ok = suffix.suffix_ids(history, user, "<|im_end|>")
    assert not ok and suffix.non_append_only == 1
    assert text == "\n<|im_start|>user\nagain" + GEN  # rendered behind the minimal conversation


def test_a_template_without_chat_template_is_refused_in_one_line():
    tok = chatml_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        ChatSuffix(tok)
