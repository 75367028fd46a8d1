"""Tool and user turns rendered by the PUBLISHED chat templates (tests/data/chat_templates, byte for byte) through
engine/agent/chat_suffix.py, on simulated trajectories three model turns deep: the prompt as the template renders it,
then per turn the model's tokens (a tool call or an answer, with or without reasoning, ended by the template's
end-of-turn token) and the suffix ChatSuffix renders for the tool result or the user's reply.

Checked per turn: nothing raises and a suffix comes back; its ids decode to its text; the text is the template's
(against a hand-written expectation of each template's markup, and against the template's own rendering of the whole
conversation: equal to it where the turn is append-only, its ending otherwise); whether the turn was append-only is
what the template implies. Checked per trajectory: the model's tokens are kept as generated and are exactly the
tokens coded as the model's."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest

from tests.helpers.agent import chat_template
from tripod.engine.agent.chat_suffix import ChatSuffix

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
CALLS = [(2, 3), (5, 4)]  # the arguments of the model's tool calls, turn by turn
PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]
MODEL, ENV = 1, 2

CHATML = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
LLAMA3 = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
          "<|python_tag|>")
HARMONY = ("<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>",
           "<|return|>", "<|endoftext|>")


def think(reasoning: bool, text: str) -> str:
    return f"<think>\n{text}\n</think>\n\n" if reasoning else ""


def hermes_call(reasoning: bool, a: int, b: int) -> str:
    return think(reasoning, f"Add {a} and {b}.") + \
        f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def llama_call(reasoning: bool, a: int, b: int) -> str:
    return think(reasoning, f"Add {a} and {b}.") + f'{{"name": "add", "parameters": {{"a": {a}, "b": {b}}}}}'


def plain_answer(reasoning: bool, k: int) -> str:
    return think(reasoning, "Done.") + f"The sum is {5 + k}."


def harmony_call(reasoning: bool, a: int, b: int) -> str:
    """After the generation prompt <|start|>assistant; the recipient in the header, as gpt-oss's template writes it."""
    head = f"<|channel|>analysis<|message|>Add {a} and {b}.<|end|><|start|>assistant" if reasoning else ""
    return head + f' to=functions.add<|channel|>commentary json<|message|>{{"a": {a}, "b": {b}}}'


def harmony_answer(reasoning: bool, k: int) -> str:
    head = "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant" if reasoning else ""
    return head + f"<|channel|>final<|message|>The sum is {5 + k}."


def harmony_fields(kind: str, reasoning: bool, turn: int) -> dict:
    """A gpt-oss model turn as the message its template reads (for the template's own rendering)."""
    if kind == "tool" and turn < len(CALLS):
        a, b = CALLS[turn]
        message = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]}
        return {**message, "thinking": f"Add {a} and {b}."} if reasoning else message
    message = {"role": "assistant", "content": f"The sum is {5 + turn}."}
    return {**message, "thinking": "Done."} if reasoning else message


@dataclass(frozen=True)
class Template:
    """A published template and what a model writes under it. `tool` / `user`: the template's text for a tool result
    / a user message and the generation prompt after it (the expectation, written from the template by hand); `tail`:
    its text after the model's end-of-turn token; `appends`: (kind, reasoning) -> whether the turn is append-only."""
    name: str
    special: tuple[str, ...]
    end: str
    call_end: str
    call: Callable[[bool, int, int], str]
    answer: Callable[[bool, int], str]
    tool: str
    user: str
    tail: str = ""
    plain: tuple[str, ...] = ()  # added tokens that are not special (Qwen's)
    bos: str | None = None
    fields: Callable[[str, bool, int], dict] | None = None  # gpt-oss: the message of a model turn
    appends: dict = field(default_factory=dict)


QWEN_TOOL = "<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
CHATML_USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
LLAMA_TOOL = '<|start_header_id|>ipython<|end_header_id|>\n\n"{}"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
LLAMA_USER = "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
QWEN_PLAIN = ("<think>", "</think>", "<tool_call>", "</tool_call>")
ALWAYS = {(k, r): True for k in ("tool", "user") for r in (True, False)}

TEMPLATES = [
    # an assistant turn keeps its <think> block when it is the last message or has reasoning, and loses it before
    # the last user message: only a tool turn after reasoning is append-only
    Template("Qwen3-0.6B", CHATML, "<|im_end|>", "<|im_end|>", hermes_call, plain_answer, QWEN_TOOL, CHATML_USER,
             tail="\n", plain=QWEN_PLAIN, appends={("tool", True): True, ("tool", False): False,
                                                   ("user", True): False, ("user", False): False}),
    Template("Qwen2.5-7B-Instruct", CHATML, "<|im_end|>", "<|im_end|>", hermes_call, plain_answer, QWEN_TOOL,
             CHATML_USER, tail="\n", plain=QWEN_PLAIN, appends=ALWAYS),
    Template("SmolLM2-135M-Instruct", CHATML, "<|im_end|>", "<|im_end|>", hermes_call, plain_answer,
             "<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n", CHATML_USER, tail="\n", appends=ALWAYS),
    Template("Llama-3.1-8B-Instruct", LLAMA3, "<|eot_id|>", "<|eot_id|>", llama_call, plain_answer, LLAMA_TOOL,
             LLAMA_USER, bos="<|begin_of_text|>", appends=ALWAYS),
    Template("Llama-3.2-3B-Instruct", LLAMA3, "<|eot_id|>", "<|eot_id|>", llama_call, plain_answer, LLAMA_TOOL,
             LLAMA_USER, bos="<|begin_of_text|>", appends=ALWAYS),
    # the last answer renders with its reasoning and <|return|>, both gone once a user message follows
    Template("gpt-oss-120b", HARMONY, "<|return|>", "<|call|>", harmony_call, harmony_answer,
             '<|start|>functions.add to=assistant<|channel|>commentary<|message|>"{}"<|end|><|start|>assistant',
             "<|start|>user<|message|>{}<|end|><|start|>assistant", bos="<|startoftext|>", fields=harmony_fields,
             appends={("tool", True): True, ("tool", False): True, ("user", True): False, ("user", False): False}),
]


def template_tokenizer(t: Template):
    """tripod's character tokenizer plus the template's special tokens (and Qwen's non-special added ones)."""
    from tokenizers import Regex, decoders, pre_tokenizers

    from tripod.engine.data.char_tokenizer import char_tokenizer

    tok = char_tokenizer()
    tok.backend_tokenizer.decoder = decoders.Fuse()  # characters joined as they are
    # one piece per character, newlines included (char_tokenizer's "." leaves "\n\n" whole: an unknown piece)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.add_special_tokens({"additional_special_tokens": list(t.special)})
    if t.plain:
        tok.add_tokens(list(t.plain))
    if t.bos:
        tok.bos_token = t.bos
    tok.eos_token = t.end
    tok.chat_template = chat_template(t.name)
    return tok


@dataclass
class Trajectory:
    ids: list[int] = field(default_factory=list)
    codes: list[int] = field(default_factory=list)
    generated: list[list[int]] = field(default_factory=list)  # each model turn's ids as "generated"
    append_only: list[bool] = field(default_factory=list)


def simulate(t: Template, kind: str, reasoning: bool) -> tuple[Trajectory, ChatSuffix]:
    """Three model turns with a tool result (kind "tool") or a user reply ("user") after each of the first two,
    checking every suffix on the way (module docstring)."""
    tok = template_tokenizer(t)
    tools = TOOLS if kind == "tool" else None
    suffix = ChatSuffix(tok, tools)
    render = lambda messages: tok.apply_chat_template(messages, tools=tools, tokenize=False,  # noqa: E731
                                                      add_generation_prompt=True)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    out = Trajectory(ids=encode(render(PROMPT)))
    out.codes = [0] * len(out.ids)
    history: list[dict] = []  # as the loop keeps it: the model's text decoded with its special tokens
    conversation = list(PROMPT)  # as the template reads it
    for turn in range(3):
        calls = kind == "tool" and turn < len(CALLS)
        text = t.call(reasoning, *CALLS[turn]) if calls else t.answer(reasoning, turn)
        end = t.call_end if calls else t.end
        ids = encode(text) + [tok.convert_tokens_to_ids(end)]
        assert tok.decode(ids, skip_special_tokens=False) == text + end
        out.ids += ids
        out.codes += [MODEL] * len(ids)
        out.generated.append(ids)
        history.append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=False)})
        conversation.append(t.fields(kind, reasoning, turn) if t.fields else {"role": "assistant", "content": text})
        if turn == 2:  # the last model turn: nothing follows it
            break
        content = str(sum(CALLS[turn])) if calls else f"And plus {turn + 1}?"
        new = [{"role": "tool" if calls else "user", "content": content}]
        got = suffix.suffix_ids(history, new, end)
        assert got is not None, f"{t.name} {kind} turn {turn}: not rendered"
        ids, text, append_only = got
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert text == t.tail + (t.tool if calls else t.user).format(content)
        assert append_only == t.appends[(kind, reasoning)]
        whole = render(conversation + new)  # the template's own rendering of the conversation so far
        if append_only:  # the trajectory so far is exactly it
            assert tok.decode(out.ids + ids, skip_special_tokens=False) == whole
        else:  # its earlier turns differ from what was generated; the new message's text is its ending
            assert whole.endswith(text[len(t.tail):])
        out.ids += ids
        out.codes += [ENV] * len(ids)
        out.append_only.append(append_only)
        history += new
        conversation += new
    return out, suffix


def segments(codes: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of model tokens."""
    runs, start = [], None
    for k, c in enumerate([*codes, 0]):
        if c == MODEL and start is None:
            start = k
        elif c != MODEL and start is not None:
            runs.append((start, k))
            start = None
    return runs


@pytest.mark.parametrize("reasoning", [True, False], ids=["reasoning", "no_reasoning"])
@pytest.mark.parametrize("kind", ["tool", "user"])
@pytest.mark.parametrize("t", TEMPLATES, ids=[t.name for t in TEMPLATES])
def test_a_published_template_renders_each_turn_after_the_models_tokens_as_generated(t, kind, reasoning):
    out, suffix = simulate(t, kind, reasoning)
    # tokens trained = tokens generated: the model-coded tokens are each turn's ids, unchanged and in place
    assert [out.ids[a:b] for a, b in segments(out.codes)] == out.generated
    assert len(out.append_only) == 2
    assert suffix.non_append_only == out.append_only.count(False) and suffix.ended_unrenderable == 0


def test_qwen3s_template_gets_the_chat_template_kwargs():
    """enable_thinking=False (verl's data.apply_chat_template_kwargs): Qwen3's generation prompt holds an empty
    think block, in the suffix of a tool turn and of a user turn (both are cut, not appended: the model's turn has no
    reasoning)."""
    t = TEMPLATES[0]
    tok = template_tokenizer(t)
    suffix = ChatSuffix(tok, TOOLS, {"enable_thinking": False})
    history = [{"role": "assistant", "content": hermes_call(False, 2, 3)}]
    for new, expected in (([{"role": "tool", "content": "5"}], QWEN_TOOL.format("5")),
                          ([{"role": "user", "content": "again"}], CHATML_USER.format("again"))):
        _, text, append_only = suffix.suffix_ids(history, new, "<|im_end|>")
        assert text == "\n" + expected + "<think>\n\n</think>\n\n" and not append_only
    _, text, _ = ChatSuffix(tok, TOOLS).suffix_ids(history, [{"role": "tool", "content": "5"}], "<|im_end|>")
    assert text == "\n" + QWEN_TOOL.format("5")  # without the kwarg: no think block

