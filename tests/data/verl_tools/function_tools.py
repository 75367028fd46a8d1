"""multi_turn.function_tool_path of verl 0.9.1 function tools: decorated with verl's own `@function_tool`, schemas
inferred from the signatures and docstrings, return values in the shapes verl's normalize_function_tool_return takes
(a str, a dict, a (response, reward) tuple with verl's ToolResponse; a plain and an async function)."""
from __future__ import annotations

import asyncio

from verl.tools.function_tool import function_tool
from verl.tools.schemas import ToolResponse


@function_tool
def reverse_word(word: str) -> str:
    """Reverse a word.

    Args:
        word: The word to reverse.
    """
    return word[::-1]


@function_tool("letter_stats")
async def stats(word: str, letter: str) -> dict:
    """Count a letter in a word, and the word's length.

    Args:
        word: The word.
        letter: The letter to count.
    """
    await asyncio.sleep(0)
    return {"count": word.count(letter), "length": len(word)}


@function_tool
def check_answer(answer: int, expected: int) -> tuple:
    """Check an answer; a step reward of 1 when it is right.

    Args:
        answer: The model's answer.
        expected: The right answer.
    """
    if answer == expected:
        return ToolResponse(text="correct"), 1.0
    raise ValueError(f"{answer} is not {expected}")
