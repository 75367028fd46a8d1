"""Tool and user turns rendered as a suffix by the chat template (engine/agent/chat_suffix.py): the append-only diff
(SmolLM2's and Qwen2.5's published templates), the checked prefix cut where a template rewrites earlier turns
(Qwen3's published one), and the turns no way renders, which come back as None instead of raising.
tests/unit/test_chat_templates.py runs every published template through whole trajectories."""
from __future__ import annotations

import pytest

from tests.helpers.agent import QWEN3_TEMPLATE, SMOLLM2_TEMPLATE, chat_template, chatml_tokenizer
from tests.unit.test_chat_templates import LLAMA_TOOL, TEMPLATES, TOOLS, llama_call, template_tokenizer
from tripod.engine.agent.chat_suffix import PLACEHOLDER_PROMPT, ChatSuffix, harmony_message

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
    tok = chatml_tokenizer(chat_template("Qwen2.5-7B-Instruct"))
    suffix = ChatSuffix(tok, TOOLS)
    new = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}]
    _, text, ok = suffix.suffix_ids([{"role": "assistant", "content": CALL + CALL}], new, "<|im_end|>")
    assert ok and text == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n" \
                          "</tool_response>" + GEN
    # one message at a time would not be append-only: the first tool message's <|im_end|> moves behind the second
    one = suffix.render([PLACEHOLDER_PROMPT, {"role": "assistant", "content": CALL}, new[0]], False)
    two = suffix.render([PLACEHOLDER_PROMPT, {"role": "assistant", "content": CALL}, *new], False)
    assert not two.startswith(one)


def test_qwen3_tool_turns_after_reasoning_append_and_a_user_turn_is_cut_behind_the_prompt():
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
    assert not ok and suffix.non_append_only == 1 and suffix.ended_unrenderable == 0
    assert text == "\n<|im_start|>user\nagain" + GEN and after.endswith(text[1:])


# Not append-only (the last assistant turn is marked) and each user message numbered by its place in the
# conversation: the user message cut behind the placeholder prompt is "2:", the conversation's own rendering says "3:".
NUMBERED = ("{%- for m in messages %}{%- if m.role == 'user' %}"
            "{{- '<|im_start|>user\n' ~ loop.index ~ ': ' ~ m.content ~ '<|im_end|>\n' }}"
            "{%- else %}{{- '<|im_start|>' ~ m.role ~ '\n' ~ m.content ~ (' (last)' if loop.last else '')"
            " ~ '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def test_a_cut_that_is_not_the_conversations_own_rendering_is_refused_without_raising():
    tok = chatml_tokenizer(NUMBERED)
    suffix = ChatSuffix(tok)
    history = [{"role": "assistant", "content": "hi"}]
    assert suffix.suffix_ids(history, [{"role": "user", "content": "again"}], "<|im_end|>") is None
    assert suffix.ended_unrenderable == 1 and suffix.non_append_only == 0
    after = suffix.render([PLACEHOLDER_PROMPT, *history, {"role": "user", "content": "again"}], True)
    assert after.endswith("<|im_start|>user\n3: again" + GEN)  # what a cut behind the prompt would miss


def test_a_template_that_refuses_the_conversation_ends_the_turn_without_raising():
    """gpt-oss's template renders a tool message only after an assistant message with a tool call: a turn decoded
    without its special tokens (no channel tags left to read the call from) cannot be rendered."""
    t = TEMPLATES[-1]
    tok = template_tokenizer(t)
    suffix = ChatSuffix(tok, TOOLS)
    call = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>'
    ids = tok.encode(call, add_special_tokens=False)
    lost = [{"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)}]
    assert suffix.suffix_ids(lost, [{"role": "tool", "content": "5"}], "<|call|>") is None
    assert suffix.ended_unrenderable == 1
    kept = [{"role": "assistant", "content": tok.decode(ids, skip_special_tokens=False)}]
    _, text, ok = suffix.suffix_ids(kept, [{"role": "tool", "content": "5"}], "<|call|>")
    assert ok and text.startswith("<|start|>functions.add to=assistant<|channel|>commentary<|message|>\"5\"<|end|>")


def test_a_gpt_oss_turn_with_a_preamble_and_a_constrained_call_reads_as_its_template_wants():
    """The model writes the recipient after the channel and a commentary preamble besides its analysis; gpt-oss's
    template refuses content and thinking on one tool-call message, so the preamble joins the thinking."""
    text = ("<|channel|>analysis<|message|>Add them.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Calling add.<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}'
            "<|call|>")
    assert harmony_message(text) == {
        "role": "assistant", "content": "", "thinking": "Add them.\nCalling add.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    suffix = ChatSuffix(template_tokenizer(TEMPLATES[-1]), TOOLS)
    _, rendered, ok = suffix.suffix_ids([{"role": "assistant", "content": text}], [{"role": "tool", "content": "5"}],
                                        "<|call|>")
    assert ok and rendered.startswith("<|start|>functions.add to=assistant")
    assert harmony_message("<|channel|>final<|message|>5<|return|>") == {"role": "assistant", "content": "5"}


def test_llama_3_1s_tool_turns_after_calls_ended_with_eom_id():
    """A Llama 3.1 model may end a tool call with <|eom_id|> (it expects a tool result) where the template writes
    <|eot_id|>: each suffix is the ipython turn right after the model's <|eom_id|>, no end of turn added, also with
    the model's turns decoded with their special tokens (an earlier <|eom_id|> in the text)."""
    t = TEMPLATES[3]
    assert t.name == "Llama-3.1-8B-Instruct"
    tok = template_tokenizer(t)
    suffix = ChatSuffix(tok, TOOLS)
    history: list[dict] = []
    for turn in range(2):
        ids = tok.encode(llama_call(False, 2, 3 + turn), add_special_tokens=False)
        ids.append(tok.convert_tokens_to_ids("<|eom_id|>"))
        history.append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=False)})
        new = [{"role": "tool", "content": str(5 + turn)}]
        _, text, ok = suffix.suffix_ids(history, new, "<|eom_id|>")
        assert text == LLAMA_TOOL.format(5 + turn) and ok
        history += new


def test_a_tokenizer_without_chat_template_is_refused_in_one_line():
    tok = chatml_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        ChatSuffix(tok)
