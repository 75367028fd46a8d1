"""Chat rows for `tripod train-sft`: parquet message lists -> token ids + assistant mask, checked up front.

A row is an OpenAI-style conversation (`data.messages_key`: system / user / assistant / tool messages; an assistant
message may carry `tool_calls`, whose `arguments` may be a JSON string) with optional tool schemas
(`data.tools_key`, passed to the chat template as `tools=`). The sequence trained on is the tokenizer's chat template
applied to the whole conversation, tokenized as the template renders it.

The assistant mask is computed from prefix renderings, so it works with every chat template (HF's
`return_assistant_tokens_mask` needs a template marked up with `{% generation %}`, which few ship): assistant
message i owns the tokens between the rendering of messages[:i] with the generation prompt and the rendering of
messages[:i+1], up to and including the last EOS token among them where there is one; that is its content, its tool
calls and the template's end-of-turn tokens up to the EOS (what the model generates before a rollout engine stops),
never the generation prompt (`<|im_start|>assistant\n`), the text a template puts after the EOS (Qwen's and
SmolLM2's newline after <|im_end|>), nor any system, user or tool token. Every such prefix rendering must be a prefix of the whole conversation's tokens; a template that is not
append-only on a row (e.g. one that drops earlier turns' reasoning) is refused on that row, naming it.

Every problem (a missing column, a message without a role, an assistant tool call the template does not render,
a conversation with no assistant token, one longer than data.max_length under truncation=error) raises one
ValueError naming the file, the row and the fix, before any model is built. truncation=left keeps a conversation's
last max_length tokens, right its first (verl's meanings).
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple


class ChatRow(NamedTuple):
    """One conversation: its token ids and, per token, 1 where the loss covers it (assistant tokens), else 0."""

    ids: list[int]
    mask: list[int]


def _tokens(tokenizer: Any, messages: list[dict], tools: list | None, generation_prompt: bool) -> list[int]:
    if not messages and not generation_prompt:
        return []
    out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                        tokenize=True, return_dict=False)
    return list(out)


def render_chat(tokenizer: Any, messages: list[dict], tools: list | None = None) -> ChatRow:
    """The conversation's token ids and assistant mask (module docstring). ValueError where the template is not
    append-only on it or drops an assistant tool call."""
    ids = _tokens(tokenizer, messages, tools, False)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _tokens(tokenizer, messages[:i], tools, True)
        turn = _tokens(tokenizer, messages[:i + 1], tools, False)
        start = len(prompt)
        if turn != ids[:len(turn)] or prompt != turn[:start]:
            raise ValueError(f"the chat template is not append-only at message {i}: rendering the first {i + 1} "
                             f"messages (or the first {i} with the generation prompt) does not give a prefix of the "
                             "whole conversation's tokens; tripod trains on one rendering of the conversation and "
                             "refuses such rows: fix the template (data.tokenizer) or drop the row")
        own = turn[start:]  # the turn's text, decoded and as its tokens' strings (a tokenizer may space them)
        text = tokenizer.decode(own) + "".join(t for t in tokenizer.convert_ids_to_tokens(own) if t)
        for call in m.get("tool_calls") or []:
            name = (call.get("function") or call).get("name", "")
            if name and name not in text:
                raise ValueError(f"message {i}: the chat template does not render its tool call to {name!r} "
                                 "(it drops tool_calls); write the call into the message content, or use a tokenizer "
                                 "whose template renders tool_calls (data.tokenizer)")
        end = len(turn)
        eos = tokenizer.eos_token_id
        if eos is not None and eos in own:  # the model's turn ends at its EOS; the template's text after it is not
            end = start + len(own) - own[::-1].index(eos)  # generated (a rollout engine stops there)
        mask[start:end] = [1] * (end - start)
    return ChatRow(ids, mask)


def truncate(row: ChatRow, max_length: int, truncation: str) -> ChatRow:
    """`row` cut to max_length tokens: left keeps the last ones, right the first (error is checked by the caller)."""
    if len(row.ids) <= max_length:
        return row
    cut = slice(-max_length, None) if truncation == "left" else slice(None, max_length)
    return ChatRow(row.ids[cut], row.mask[cut])


def _clean_message(m: dict) -> dict:
    """A message as the chat template expects it: parquet's struct columns give every message every key (None where
    unset), and tool-call arguments may be stored as JSON strings."""
    out = {k: v for k, v in m.items() if v is not None}
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            call = {k: v for k, v in call.items() if v is not None}
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"])
            calls.append({**call, "function": fn} if fn else call)
        out["tool_calls"] = calls
    return out


def _tools_of(value: Any) -> list | None:
    if value is None:
        return None
    tools = json.loads(value) if isinstance(value, str) else list(value)
    return tools or None


def chat_rows(paths: list[str], tokenizer: Any, cfg) -> list[ChatRow]:
    """Every conversation of the parquet files `paths`, rendered, masked and truncated as `cfg` (SFTDataConfig) says;
    ValueError naming the file, row and fix for the first bad one."""
    import pyarrow.parquet as pq

    rows: list[ChatRow] = []
    for path in paths:
        table = pq.read_table(path)
        if cfg.messages_key not in table.column_names:
            raise ValueError(f"{path}: no column '{cfg.messages_key}' (data.messages_key) among {table.column_names}; "
                             "set data.messages_key to the column of OpenAI-style message lists")
        conversations = table.column(cfg.messages_key).to_pylist()
        tools = table.column(cfg.tools_key).to_pylist() if cfg.tools_key in table.column_names else None
        for i, messages in enumerate(conversations):
            where = f"{path} row {i}"
            if not messages or not all(isinstance(m, dict) and m.get("role") for m in messages):
                raise ValueError(f"{where}: '{cfg.messages_key}' is not a non-empty list of messages with a 'role'; "
                                 "fix or drop the row")
            try:
                row = render_chat(tokenizer, [_clean_message(m) for m in messages],
                                  _tools_of(tools[i]) if tools is not None else None)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{where}: {e}") from None
            if len(row.ids) > cfg.max_length:
                if cfg.truncation == "error":
                    raise ValueError(f"{where}: {len(row.ids)} tokens > data.max_length={cfg.max_length} "
                                     "(data.truncation=error); raise data.max_length, set data.truncation=left|right, "
                                     "or drop the row")
                row = truncate(row, cfg.max_length, cfg.truncation)
            if not any(row.mask[1:]):  # the first token is never predicted
                raise ValueError(f"{where}: no assistant token to train on (after data.truncation="
                                 f"{cfg.truncation}); add an assistant turn or drop the row")
            rows.append(row)
    return rows
