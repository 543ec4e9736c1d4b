"""Tokenizers: the built-in character tokenizer, loading from a folder, prompt rendering.

- `CharTokenizer`: one token per printable ASCII character plus <pad> <bos> <eos>; used by the
  tiny built-in model on the synthetic arithmetic task. Saved as `char_tokenizer.json` so a
  checkpoint folder carries it.
- `load_tokenizer(folder)`: our JSON, or an HF tokenizer folder (offline, local files only).
- `render_prompt(tokenizer, prompt)`: chat messages through the chat template, or a string as is,
  to token ids.
"""

from __future__ import annotations

import json
import os
import string
from typing import Any

CHAR_TOKENIZER_FILE = "char_tokenizer.json"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")

# Printable ASCII without the rarely useful \t \r \x0b \x0c: digits, + - * = ?, space, letters,
# punctuation and newline -- enough for the arithmetic prompts and for short chat transcripts.
DEFAULT_CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")


class CharTokenizer:
    """Character-level tokenizer with an HF-like surface (encode/decode/apply_chat_template).

    >>> tok = CharTokenizer()
    >>> tok.decode(tok.encode("12+7=") + [tok.eos_token_id], skip_special_tokens=True)
    '12+7='
    """

    def __init__(self, chars: str = DEFAULT_CHARS):
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer chars must be unique")
        self.chars = chars
        self._itos = list(SPECIAL_TOKENS) + list(chars)
        self._stoi = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self.pad_token, self.bos_token, self.eos_token = SPECIAL_TOKENS

    @property
    def vocab_size(self) -> int:
        return len(self._itos)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with add_special_tokens a leading <bos>."""
        try:
            ids = [self._stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"CharTokenizer cannot encode character {e.args[0]!r}") from None
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Ids past the table (a model vocabulary padded beyond the tokenizer's, as HF models
        often are) decode to nothing, as HF tokenizers do for ids they do not hold."""
        ids = [int(i) for i in ids]
        n_special, n = len(SPECIAL_TOKENS), len(self._itos)
        return "".join(self._itos[i] for i in ids
                       if i < n and not (skip_special_tokens and i < n_special))

    def apply_chat_template(
        self,
        messages: list[dict],
        tokenize: bool = True,
        add_generation_prompt: bool = True,
        **_: Any,
    ) -> list[int] | str:
        """Minimal template: <bos> then the message contents joined by newlines (the tiny model
        has no roles). `add_generation_prompt` is accepted for HF compatibility; the model
        continues right after the last message."""
        text = self.bos_token + "\n".join(m["content"] for m in messages)
        if not tokenize:
            return text
        return [self.bos_token_id] + self.encode(text[len(self.bos_token) :])

    def save_pretrained(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, CHAR_TOKENIZER_FILE), "w") as f:
            json.dump(
                {"type": "CharTokenizer", "specials": list(SPECIAL_TOKENS), "chars": self.chars}, f
            )

    @classmethod
    def from_file(cls, path: str) -> CharTokenizer:
        with open(path) as f:
            data = json.load(f)
        if data.get("type") != "CharTokenizer" or data.get("specials") != list(SPECIAL_TOKENS):
            raise ValueError(f"{path} is not a megatron-rl CharTokenizer file")
        return cls(data["chars"])


def load_tokenizer(folder: str):
    """The tokenizer saved in `folder`: our char tokenizer JSON, else an HF tokenizer
    (tokenizer.json / tokenizer_config.json, loaded offline with its chat template)."""
    if not os.path.isdir(folder):
        raise ValueError(f"tokenizer folder {folder!r} does not exist")
    char_path = os.path.join(folder, CHAR_TOKENIZER_FILE)
    if os.path.exists(char_path):
        return CharTokenizer.from_file(char_path)
    if any(os.path.exists(os.path.join(folder, f)) for f in HF_TOKENIZER_FILES):
        from transformers import AutoTokenizer  # slow import; only when an HF folder is used

        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    raise ValueError(
        f"no tokenizer in {folder!r}: looked for {CHAR_TOKENIZER_FILE}, "
        f"{' and '.join(HF_TOKENIZER_FILES)}"
    )


def render_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of a prompt: chat messages ([{role, content}]) go through the tokenizer's chat
    template with the generation prompt appended; a plain string is encoded as is (with the
    tokenizer's own special tokens, e.g. BOS)."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    if isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
        # transformers 5 returns a BatchEncoding for tokenize=True; older versions a list.
        if hasattr(ids, "keys") and "input_ids" in ids:
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    raise ValueError(
        f"prompt must be a string or a list of {{role, content}} messages, got {type(prompt).__name__}"
    )
