"""The learned partition function in process: a local HF sequence-classification pair model
(docs/algorithms.md A.2.1-A.2.3).

Input of one pair: `[CLS] enc(a)[:h] [SEP] enc(b)[:h] [SEP]`, each side encoded without special
tokens and cut to h = `max_tokens_per_side` tokens (A.2.2); `token_type_ids` 0 up to and
including the first SEP and 1 after, for models that take them (BERT-style). Tokenizers without
CLS/SEP (Qwen) use `<|im_start|>` / `<|im_end|>`, as DARLING's Qwen3 classifier does. The
verdict is P(same) = softmax(logits)[1] (class 1 = "similar", A.2.1); `same iff P > threshold`.
`PairEncoder` builds these inputs for serving and for `train_classifier` alike.

Usage:
    clf = PairClassifier("runs/pair_clf", max_tokens_per_side=512)
    clf.probs([("the answer is 27", "27")])          # -> [0.98]
    same = thresholded(clf.probs, 0.5)                  # an EquivalenceFn

`probs_reference` scores one pair at a time without padding: the slow path tests compare the
batched, length-sorted, padded `probs` against.
"""

from __future__ import annotations

import os
import threading

QWEN_CLS, QWEN_SEP = "<|im_start|>", "<|im_end|>"


class PairEncoder:
    """Tokenizer-side half of the pair model: texts -> padded `[CLS] a [SEP] b [SEP]` batches."""

    def __init__(self, tokenizer, max_tokens_per_side: int, name: str = "pair classifier"):
        if max_tokens_per_side < 1:
            raise ValueError(f"{name}: max_tokens_per_side must be >= 1")
        self.tokenizer, self.max_tokens_per_side = tokenizer, max_tokens_per_side
        self.cls_id, self.sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
        if self.cls_id is None or self.sep_id is None:
            vocab = tokenizer.get_vocab()
            if QWEN_CLS not in vocab or QWEN_SEP not in vocab:
                raise ValueError(
                    f"{name}: its tokenizer has no CLS/SEP tokens (nor {QWEN_CLS}/{QWEN_SEP}) to "
                    "build `[CLS] a [SEP] b [SEP]`"
                )
            self.cls_id, self.sep_id = vocab[QWEN_CLS], vocab[QWEN_SEP]
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError(f"{name}: its tokenizer has no pad or eos token")
        self.use_token_types = "token_type_ids" in tokenizer.model_input_names

    @property
    def max_length(self) -> int:
        return 2 * self.max_tokens_per_side + 3

    def pair_ids(self, ids_a: list[int], ids_b: list[int]) -> tuple[list[int], list[int]]:
        """(input_ids, token_type_ids) of `[CLS] a [SEP] b [SEP]`."""
        ids = [self.cls_id, *ids_a, self.sep_id, *ids_b, self.sep_id]
        types = [0] * (len(ids_a) + 2) + [1] * (len(ids_b) + 1)
        return ids, types

    def encode(self, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
        """Input ids and token types of each pair; each distinct text is tokenized once."""
        texts = list(dict.fromkeys(t for p in pairs for t in p))
        index = {t: i for i, t in enumerate(texts)}
        h = self.max_tokens_per_side
        sides = self.tokenizer(texts, add_special_tokens=False, truncation=True, max_length=h)
        sides = [ids[:h] for ids in sides["input_ids"]]
        return [self.pair_ids(sides[index[a]], sides[index[b]]) for a, b in pairs]

    def collate(self, encoded: list[tuple[list[int], list[int]]], device=None) -> dict:
        """Right-padded model inputs (input_ids, attention_mask[, token_type_ids])."""
        import torch

        T = max(len(ids) for ids, _ in encoded)
        input_ids = torch.full((len(encoded), T), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(encoded), T), dtype=torch.long)
        mask = torch.zeros((len(encoded), T), dtype=torch.long)
        for r, (ids, tt) in enumerate(encoded):
            input_ids[r, : len(ids)] = torch.tensor(ids)
            types[r, : len(tt)] = torch.tensor(tt)
            mask[r, : len(ids)] = 1
        batch = {"input_ids": input_ids, "attention_mask": mask}
        if self.use_token_types:
            batch["token_type_ids"] = types
        return {k: v.to(device) for k, v in batch.items()} if device is not None else batch


def check_pair_model(model, encoder: PairEncoder, name: str) -> None:
    """The model is a 2-class classifier whose positions fit `[CLS] a [SEP] b [SEP]`."""
    if model.config.num_labels != 2:
        raise ValueError(
            f"{name}: needs num_labels=2 (0 distinct, 1 same), has {model.config.num_labels}"
        )
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and encoder.max_length > max_pos:
        raise ValueError(
            f"{name}: max_tokens_per_side={encoder.max_tokens_per_side} makes pairs of up to "
            f"{encoder.max_length} tokens, the model takes {max_pos}; use <= {(max_pos - 3) // 2}"
        )


class PairClassifier:
    """A frozen pairwise classifier loaded from a local HF folder (no download)."""

    def __init__(
        self,
        path: str,
        *,
        max_tokens_per_side: int = 512,
        device: str = "cpu",
        batch_size: int = 64,
    ):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not path or not os.path.isdir(path):
            raise ValueError(
                f"pair classifier path {path!r} is not a folder (a local HF sequence-classification "
                "model; train one with `megatron-rl train-classifier`)"
            )
        if batch_size < 1:
            raise ValueError("pair classifier: batch_size must be >= 1")
        name = f"pair classifier {path}"
        self.path, self.batch_size = path, batch_size
        self.device = torch.device(device)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.encoder = PairEncoder(tokenizer, max_tokens_per_side, name)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
        self.model.to(self.device).eval()
        check_pair_model(self.model, self.encoder, name)
        # One forward at a time: the server's batcher and the reward threads may share a model.
        self._lock = threading.Lock()

    @property
    def max_tokens_per_side(self) -> int:
        return self.encoder.max_tokens_per_side

    def _forward(self, encoded: list[tuple[list[int], list[int]]]) -> list[float]:
        import torch

        batch = self.encoder.collate(encoded, self.device)
        with self._lock, torch.inference_mode():
            logits = self.model(**batch).logits.float()
        return torch.softmax(logits, dim=-1)[:, 1].tolist()

    def probs(self, pairs: list[tuple[str, str]]) -> list[float]:
        """P(same) of each pair: batches of `batch_size`, pairs sorted by length so a batch
        pads little; results in the input order."""
        if not pairs:
            return []
        encoded = self.encoder.encode(pairs)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
        out = [0.0] * len(encoded)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, p in zip(chunk, self._forward([encoded[i] for i in chunk])):
                out[i] = p
        return out

    def probs_reference(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Slow reference: one unpadded forward per pair."""
        return [self._forward(self.encoder.encode([p]))[0] for p in pairs]
