"""Offline pieces for the agent-loop tests: a ChatML character tokenizer (SmolLM2's chat template) with one token
whose text is two other tokens' texts ("ab": a decode-and-re-encode of the ids of "a", "b" gives it, so token drift
shows), a scripted rollout engine, and a deterministic tool with verl's signatures."""
from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import torch

from tripod.engine.agent.hermes import format_tool_call
from tripod.engine.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"


def chat_template(name: str) -> str:
    """The published chat template tests/data/chat_templates/<name>.jinja, byte for byte (SOURCES.md there)."""
    return (TEMPLATES / f"{name}.jinja").read_bytes().decode("utf-8")


SMOLLM2_TEMPLATE = chat_template("SmolLM2-135M-Instruct")
# Qwen3's published template (thinking variant): an assistant turn renders its <think> block only when it is the last
# message or has reasoning, and loses it before the last real user message
QWEN3_TEMPLATE = chat_template("Qwen3-0.6B")

# A simplified Qwen2.5: its tool handling (consecutive tool messages share one user turn of <tool_response> blocks),
# the tools in a short system turn (tests/unit/test_prompt_tools.py reads that turn); the published one is
# chat_template("Qwen2.5-7B-Instruct")
QWEN25_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n"
    "{%- elif messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen.<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def chatml_tokenizer(template: str = SMOLLM2_TEMPLATE):
    """tripod's character tokenizer plus <|im_start|> / <|im_end|> (EOS) and the merged token "ab"."""
    from tokenizers import decoders

    from tripod.engine.data.char_tokenizer import char_tokenizer

    tok = char_tokenizer()
    tok.backend_tokenizer.decoder = decoders.Fuse()  # characters joined as they are (not with spaces)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["ab"])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template
    return tok


def char_ids(tok, text: str) -> list[int]:
    """`text` one token per character (never the merged "ab")."""
    return [tok.convert_tokens_to_ids(c) for c in text]


class ScriptedEngine:
    """A rollout engine whose row answers by the number of model turns it has had (`turns`): a calculator call `a`+`b` first, then "ab #### <sum>"; every call is recorded (prompts, responses,
    log-probs). Log-probs are distinct per position so misplaced ones show."""

    def __init__(self, tok, calls_per_row: int = 1) -> None:
        self.tok, self.calls_per_row, self.log = tok, calls_per_row, []
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    def turns(self, prompt_len: int, seq: list[int]) -> int:
        """Model turns the row has had: the generation prompts ('<|im_start|>assistant') after its prompt."""
        start, a = self.tok.convert_tokens_to_ids("<|im_start|>"), self.tok.convert_tokens_to_ids("a")
        return sum(1 for i in range(prompt_len, len(seq) - 1) if seq[i] == start and seq[i + 1] == a)

    def answer(self, prompt_len: int, seq: list[int]) -> list[int]:
        turns = self.turns(prompt_len, seq)
        if turns < self.calls_per_row:
            text = "ab" + format_tool_call("add", {"a": 2 + turns, "b": 3})
        else:
            text = f"ab #### {5 + turns}"
        return char_ids(self.tok, text) + [self.end]

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 row_seeds: list[int] | None = None) -> RolloutOutput:
        rows, logps, finish = [], [], []
        for p in prompts:
            for _ in range(params.n):
                ids = self.answer(self.prompt_len_of(p), p)
                cut = ids[: params.max_new_tokens]
                rows.append(cut)
                # float32 values, as an engine reports them
                logps.append(torch.tensor([-0.001 * (len(p) + k + 1) for k in range(len(cut))]).tolist())
                finish.append(FINISH_STOP if len(cut) == len(ids) else FINISH_LENGTH)
        self.log.append({"prompts": [list(p) for p in prompts for _ in range(params.n)], "responses": rows,
                         "log_probs": logps})
        return RolloutOutput.from_rows(rows, logps, finish, len(prompts), params.n, 0)

    def prompt_len_of(self, seq: list[int]) -> int:
        """The prompt ends at its last '<|im_start|>assistant\\n' before any model turn: the prompts used here hold
        no <|im_end|> after that point."""
        start = self.tok.convert_tokens_to_ids("<|im_start|>")
        marks = [i for i, t in enumerate(seq) if t == start]
        first_gen = next(i for i in marks if self.tok.decode(seq[i + 1: i + 11]) == "assistant\n")
        return first_gen + 11


class ToyAdd:
    """A deterministic tool with verl's signatures (no tripod base class): adds `a` and `b` after sleeping
    config['delay'] seconds; its reward is 1.0 once it was called."""

    def __init__(self, config: dict, tool_schema=None) -> None:
        self.config, self.delay, self.calls = config, float(config.get("delay", 0.0)), {}

    async def create(self, instance_id=None, **kwargs):
        instance_id = instance_id or uuid.uuid4().hex  # verl 0.9.1 passes none
        self.calls[instance_id] = 0
        return instance_id, "ok"

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(self.delay)
        self.calls[instance_id] += 1
        return str(int(parameters["a"]) + int(parameters["b"])), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 1.0 if self.calls.get(instance_id) else 0.0

    async def release(self, instance_id, **kwargs):
        self.calls.pop(instance_id, None)


class Replies:
    """An interaction with the InteractionRunner's methods: `reply` after each model turn (it checks it is one), the
    row ended once the conversation holds `until` user messages (that reply appended too), `score` per reply and
    `final` at the end."""

    def __init__(self, until: int, reply: str = "again", score: float = 0.0, final: float = 0.0) -> None:
        self.until, self.reply, self.score, self.final = until, reply, score, final

    async def start(self, key, kwargs):
        pass

    async def respond(self, key, messages):
        assert messages[-1]["role"] == "assistant"
        return sum(m["role"] == "user" for m in messages) >= self.until, self.reply, self.score, {}

    async def finish(self, key):
        return self.final


def model_segments(codes: torch.Tensor | list[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of model tokens (code 1)."""
    codes = [int(c) for c in codes]
    out, start = [], None
    for k, c in enumerate(codes + [0]):
        if c == 1 and start is None:
            start = k
        elif c != 1 and start is not None:
            out.append((start, k))
            start = None
    return out
