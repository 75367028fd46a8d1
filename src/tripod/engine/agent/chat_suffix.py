"""A tool or user turn's tokens, rendered by the chat template as a suffix of the conversation.

The trajectory is one token sequence (engine/agent/loop.py): the model's tokens are kept exactly as the engine
generated them, and what follows a model turn is the template's rendering of the new messages and of the generation
prompt after them. The text the template puts after the model's end-of-turn token (ChatML's "\\n" after <|im_end|>;
nothing after Llama 3's <|eot_id|> or gpt-oss's <|call|> / <|return|>) opens the suffix, since the engine stopped at
that token: it is the whitespace that follows the last occurrence of `end_text` in the rendering of the conversation
so far (none when the template does not end the turn with that token, e.g. a Llama model that stopped at <|eom_id|>
where the template writes <|eot_id|>).

The conversation rendered is the trajectory's own (its assistant turns, its earlier tool and user turns) behind a
placeholder user message standing for the prompt, whose tokens are fixed already: the prompt's system message and
tool list appear in every rendering and cancel. Two ways to cut the new messages out of it, in order:

1. Append-only: render the conversation without the new messages (no generation prompt) and with them (generation
   prompt on); when the second starts with the first, the suffix is the rest. It is exactly what the template
   appends, and it holds for most turns of most templates (for every turn tests/unit/test_chat_templates.py renders
   with SmolLM2's, Qwen2.5's and Llama 3.1's / 3.2's, and for gpt-oss's tool turns).
2. Prefix cut (verl's way, checked): when a template rewrites earlier turns once a message follows them, the
   difference is not a suffix. Qwen3's published template renders an assistant turn's <think> block only when the
   turn is the last message or has reasoning, and drops it before the last user message, so its tool turn after a
   turn without reasoning and its user turn after any turn are not append-only; gpt-oss's renders the last answer
   with <|return|> and its reasoning, both gone once a user message follows. Then the new messages are rendered
   behind a short reference conversation and the reference's own rendering is cut off the front: first the
   placeholder and the last assistant turn (for templates that read the turn before a message: the call a tool
   message answers, a strict user / assistant alternation), then the placeholder alone (verl's reference, which
   suits Qwen3's and gpt-oss's). The cut is kept only when it is clean (the rendering with the new messages starts
   with the reference's) and the template's rendering of the whole conversation with the new messages ends with it,
   so the text is what the template renders for the new messages in that conversation, not merely behind the
   reference. The turn counts in `non_append_only` (multi_turn/non_append_only_turns): earlier tokens stay as
   generated, so the model sees earlier turns as it wrote them rather than as a re-rendering would show them (a
   dropped <think> block stays).

The alternative, rendering behind a minimal assistant turn (what this module did before), fails for exactly these
templates: the minimal turn is itself the last assistant message and is rewritten once the new message follows it.

A turn neither way renders (the template raises on the conversation, or no clean cut matches its rendering) is not an
error: `suffix_ids` returns None, counts it in `ended_unrenderable`, and the loop ends the row there.

Assistant messages are cleaned before rendering: special tokens the engine stopped at are dropped from the end of the
content (the template writes its own end of turn), and a gpt-oss (harmony) turn, decoded with its special tokens
(<|channel|>analysis<|message|>...<|end|><|start|>assistant to=functions.add<|channel|>commentary json<|message|>
{...}<|call|>), becomes the fields gpt-oss's template reads (`thinking`, `content`, `tool_calls`): it refuses channel
tags in the content, and renders a tool message only after an assistant message with a tool call (for its name).
"""
from __future__ import annotations

import json
import re
from typing import Any

PLACEHOLDER_PROMPT = {"role": "user", "content": "(prompt)"}
HARMONY_CHANNEL = "<|channel|>"
_HARMONY_END = re.compile(r"<\|(?:end|call|return)\|>")
_HARMONY_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")
_HARMONY_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class ChatSuffix:
    """Renders new messages as token ids that follow a model turn (see the module docstring). `tools`: the tool
    schemas the prompt was rendered with; `chat_template_kwargs`: extra template variables (verl's
    data.apply_chat_template_kwargs, e.g. {"enable_thinking": False}), given to every rendering."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("actor_rollout_ref.rollout.multi_turn.enable needs a tokenizer with a chat template "
                             "(data.tokenizer or the model's): tool and user turns are rendered by it")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.non_append_only = 0  # turns rendered by the prefix cut
        self.ended_unrenderable = 0  # turns no way rendered (suffix_ids returned None)
        # longest first, so that a token whose text ends with a shorter one's is stripped whole
        self._specials = sorted((t for t in getattr(tokenizer, "all_special_tokens", []) if t), key=len,
                                reverse=True)

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        """The template's text of `messages` (with the tools and chat_template_kwargs)."""
        kwargs = dict(self.chat_template_kwargs)
        if self.tools:
            kwargs["tools"] = self.tools
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)

    def _try_render(self, messages: list[dict], generation_prompt: bool) -> str | None:
        """`render`, None where the template refuses the conversation: templates raise what they like
        (raise_exception's TemplateError, a TypeError from a filter on a missing field), and a refused turn must end
        its row, not the run."""
        try:
            return self.render(messages, generation_prompt)
        except Exception:  # noqa: BLE001 - any template failure means "cannot render this turn"
            return None

    def suffix_text(self, history: list[dict], new: list[dict], end_text: str) -> tuple[str, bool] | None:
        """(the text after the model's last token up to the next model turn, whether it rendered append-only), None
        when no way renders it. `history`: the conversation after the prompt, ending with the model's turn (its
        content as decoded); `end_text`: the decoded token that ended it (its end-of-turn token), '' when the turn
        did not end with one."""
        history = [self.clean(m) for m in history]
        base = [PLACEHOLDER_PROMPT, *history]
        before = self._try_render(base, False)
        after = self._try_render([*base, *new], True)
        if before is None or after is None:
            self.ended_unrenderable += 1
            return None
        tail = end_tail(before, end_text)
        if after.startswith(before):
            return tail + after[len(before):], True
        for reference in ([PLACEHOLDER_PROMPT, *history[-1:]], [PLACEHOLDER_PROMPT]):
            text = self._cut(reference, new)
            if text and after.endswith(text):
                self.non_append_only += 1
                return tail + text, False
        self.ended_unrenderable += 1
        return None

    def _cut(self, reference: list[dict], new: list[dict]) -> str | None:
        """The rendering of `new` and the generation prompt behind `reference`, None when it is not a clean suffix
        of the reference's own rendering."""
        ref = self._try_render(reference, False)
        full = self._try_render([*reference, *new], True)
        if ref is None or full is None or not full.startswith(ref):
            return None
        return full[len(ref):]

    def suffix_ids(self, history: list[dict], new: list[dict], end_text: str) -> tuple[list[int], str, bool] | None:
        """(token ids, their text, append-only) of `suffix_text`; None when the turn cannot be rendered (the row
        ends)."""
        out = self.suffix_text(history, new, end_text)
        if out is None:
            return None
        text, ok = out
        return list(self.tokenizer.encode(text, add_special_tokens=False)), text, ok

    def clean(self, message: dict) -> dict:
        """An assistant message as the template expects it (module docstring); other messages as they are."""
        content = message.get("content")
        if message.get("role") != "assistant" or not isinstance(content, str):
            return message
        content = self._strip_end(content)
        if HARMONY_CHANNEL in content:
            return harmony_message(content)
        return {**message, "content": content}

    def _strip_end(self, text: str) -> str:
        while True:
            end = next((t for t in self._specials if text.endswith(t)), None)
            if end is None:
                return text
            text = text[: -len(end)]


def end_tail(before: str, end_text: str) -> str:
    """The text the template puts after the model's end-of-turn token `end_text`: what follows its last occurrence
    in `before` (the conversation ending with the model's turn), when that is whitespace. Anything else means the
    template does not end the turn with that token (the occurrence is an earlier turn's): nothing then."""
    at = before.rfind(end_text) if end_text else -1
    tail = before[at + len(end_text):] if at >= 0 else ""
    return tail if not tail.strip() else ""


def harmony_message(text: str) -> dict:
    """A gpt-oss assistant turn in harmony format (decoded with its special tokens, from after the generation
    prompt's <|start|>assistant) as the message gpt-oss's chat template reads: analysis channels -> `thinking`,
    messages to functions.<name> -> `tool_calls`, the rest (final, commentary preambles) -> `content`. Its template
    refuses content and thinking together on a tool-call message, so a preamble joins the thinking there."""
    thinking: list[str] = []
    content: list[str] = []
    calls: list[dict] = []
    for part in text.split("<|start|>"):
        head, sep, body = part.partition("<|message|>")
        if not sep:
            continue
        body = _HARMONY_END.split(body, 1)[0]
        channel = _HARMONY_CHANNEL_NAME.search(head)
        recipient = _HARMONY_RECIPIENT.search(head)
        if recipient:
            name = recipient.group(1).removeprefix("functions.")
            try:
                arguments: Any = json.loads(body)
            except json.JSONDecodeError:
                arguments = body
            calls.append({"type": "function", "function": {"name": name, "arguments": arguments}})
        elif channel and channel.group(1) == "analysis":
            thinking.append(body)
        else:
            content.append(body)
    if calls and thinking and content:
        thinking, content = [*thinking, *content], []
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(content)}
    if thinking:
        message["thinking"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message
