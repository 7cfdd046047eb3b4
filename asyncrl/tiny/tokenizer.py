"""A character-level tokenizer for the tiny model, built locally with `tokenizers`.

Why characters: the tiny task's strings are a handful of symbols, so one token per character
keeps the vocabulary under 100 and makes every token's meaning obvious when reading logprobs.
The vocabulary is printable ASCII plus newline, so any ASCII prompt encodes without unknowns.

It is a BPE model with no merges (each character stays its own token) and a `Fuse` decoder, so
`decode(encode(s)) == s` with no spaces inserted. It is saved as a plain
`PreTrainedTokenizerFast` (tokenizer.json + tokenizer_config.json), which transformers'
AutoTokenizer and vLLM both load. The chat template concatenates message contents, so the
prompt source can apply a chat template uniformly and get the raw task prompt back.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.compat import hide_broken_torch_extras

hide_broken_torch_extras()  # before transformers caches what is installed: see asyncrl/compat.py

from tokenizers import Tokenizer, decoders, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
"""Special tokens take ids 0, 1, 2 in this order."""

CHARACTERS = "\n" + "".join(chr(code) for code in range(32, 127))
"""Newline plus printable ASCII (space to tilde), ids 3.. in this order; anything else is unknown."""

CHAT_TEMPLATE = "{%- for message in messages %}{{- message['content'] }}{%- endfor %}"
"""No role markers: the tiny model is trained on raw prompts, so the template must be the identity."""


def build_tokenizer(model_max_length: int = 128) -> PreTrainedTokenizerFast:
    """The character tokenizer as a transformers fast tokenizer (in memory; see save_tokenizer)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN, ignore_merges=True))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(directory: str | Path, model_max_length: int = 128) -> PreTrainedTokenizerFast:
    """Build the tokenizer and write its files into ``directory`` (which must exist)."""
    tokenizer = build_tokenizer(model_max_length)
    tokenizer.save_pretrained(str(directory))
    # Name the class by its long-standing alias so transformers 4.x (GPU images) loads it too.
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer
