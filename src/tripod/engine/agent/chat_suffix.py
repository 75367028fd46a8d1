"""A tool or user turn's tokens, rendered by the chat template as a suffix of the conversation.

The trajectory is one token sequence (engine/agent/loop.py): the model's tokens are kept exactly as the engine
generated them, and what follows a model turn is the template's rendering of the new messages, obtained as the
difference of two renderings of the conversation: without the new messages (no generation prompt) and with them
(generation prompt on, so the suffix ends where the model's next turn begins). The text the template puts after the
model's end-of-turn token (Qwen's and SmolLM2's "\\n" after <|im_end|>) opens the suffix, since the engine stopped at
that token.

The conversation rendered is the trajectory's own (its assistant turns as decoded text, its earlier tool and user
turns) behind a placeholder user message standing for the prompt, whose tokens are fixed already. That is exact for
templates that render a message from the messages before it only through what follows the prompt (Qwen2.5, Qwen3,
SmolLM2, Llama 3: the prompt's system message and tool list appear in both renderings and cancel).

Append-only check: the rendering with the new messages must start with the one without. A template that rewrites
earlier turns when a message is added is not append-only: Qwen3's drops the <think> blocks of the assistant turns
before the last user message, so adding an interaction's user message changes them (tool messages do not count as
user messages there, so tool turns stay append-only). Then tripod renders the new messages behind a minimal
conversation (the placeholder user message and an assistant turn without reasoning), keeps every earlier token as
generated, and counts the turn in multi_turn/non_append_only_turns: the trajectory stays what the engine saw, at the
cost of the model seeing earlier turns as they were generated rather than as a re-rendering would show them.
"""
from __future__ import annotations

from typing import Any

PLACEHOLDER_PROMPT = {"role": "user", "content": "(prompt)"}


class ChatSuffix:
    """Renders new messages as token ids that follow a model turn (see the module docstring)."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("actor_rollout_ref.rollout.multi_turn.enable needs a tokenizer with a chat template "
                             "(data.tokenizer or the model's): tool and user turns are rendered by it")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.non_append_only = 0  # turns rendered behind the minimal conversation

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        kwargs = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)

    def suffix_text(self, history: list[dict], new: list[dict], end_text: str) -> tuple[str, bool]:
        """(the text after the model's last token up to the next model turn, whether `history` + `new` rendered
        append-only). `history`: the conversation after the prompt, ending with the model's turn; `end_text`: the
        decoded token that ended it (its end-of-turn token), '' when the turn did not end with one."""
        before = self.render([PLACEHOLDER_PROMPT, *history], False)
        after = self.render([PLACEHOLDER_PROMPT, *history, *new], True)
        ok = after.startswith(before)
        if not ok:
            self.non_append_only += 1
            before = self.render([PLACEHOLDER_PROMPT, {"role": "assistant", "content": "."}], False)
            after = self.render([PLACEHOLDER_PROMPT, {"role": "assistant", "content": "."}, *new], True)
            if not after.startswith(before):
                raise ValueError("the chat template renders a conversation differently once a "
                                 f"{new[0]['role']} message is added even behind a minimal one; tripod cannot cut the "
                                 "new turn out of it: use a template whose rendering of a message does not depend on "
                                 "the messages after it (data.tokenizer)")
        tail = ""
        if end_text:
            at = before.rfind(end_text)
            tail = before[at + len(end_text):] if at >= 0 else ""
        return tail + after[len(before):], ok

    def suffix_ids(self, history: list[dict], new: list[dict], end_text: str) -> tuple[list[int], str, bool]:
        """(token ids, their text, append-only) of `suffix_text`."""
        text, ok = self.suffix_text(history, new, end_text)
        return list(self.tokenizer.encode(text, add_special_tokens=False)), text, ok
