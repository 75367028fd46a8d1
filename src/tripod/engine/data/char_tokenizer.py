"""A character-level tokenizer with a chat template and EOS, built offline: what tiny random models (tests, the tiny
MoE recipe) are trained and sampled with when no pretrained tokenizer can be downloaded."""
from __future__ import annotations

from typing import Sequence

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
PRINTABLE = tuple(chr(c) for c in range(32, 127)) + ("\n",)


def char_tokenizer(extra_chars: Sequence[str] = ()):
    """A `PreTrainedTokenizerFast` with ids <pad>=0, <bos>=1, <eos>=2, then one id per printable ASCII character
    (and `extra_chars`); unknown characters map to <pad>."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(PRINTABLE) + [c for c in extra_chars if c not in PRINTABLE]
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    # [\s\S], not ".": "." skips newlines, so a run of them ("\n\n") was one unknown piece
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", chat_template=CHAT_TEMPLATE)
