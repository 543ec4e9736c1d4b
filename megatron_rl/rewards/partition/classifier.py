"""The learned partition function in process: a local HF sequence-classification pair model
(docs/algorithms.md A.2.1-A.2.3).

Input of one pair: `[CLS] enc(a)[:h] [SEP] enc(b)[:h] [SEP]`, each side encoded without special
tokens and cut to h = `max_tokens_per_side` tokens (A.2.2); `token_type_ids` 0 up to and
including the first SEP and 1 after, for models that take them (BERT-style). Tokenizers without
CLS/SEP (Qwen) use `<|im_start|>` / `<|im_end|>`, as DARLING's Qwen3 classifier does. The
verdict is P(same) = softmax(logits)[1] (class 1 = "similar", A.2.1); `same iff P > threshold`.

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
        if max_tokens_per_side < 1 or batch_size < 1:
            raise ValueError("pair classifier: max_tokens_per_side and batch_size must be >= 1")
        self.path, self.max_tokens_per_side, self.batch_size = path, max_tokens_per_side, batch_size
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
        self.model.to(self.device).eval()
        if self.model.config.num_labels != 2:
            raise ValueError(
                f"pair classifier {path}: needs num_labels=2 (0 distinct, 1 same), "
                f"has {self.model.config.num_labels}"
            )
        tok = self.tokenizer
        self.cls_id, self.sep_id = tok.cls_token_id, tok.sep_token_id
        if self.cls_id is None or self.sep_id is None:
            vocab = tok.get_vocab()
            if QWEN_CLS not in vocab or QWEN_SEP not in vocab:
                raise ValueError(
                    f"pair classifier {path}: its tokenizer has no CLS/SEP tokens (nor "
                    f"{QWEN_CLS}/{QWEN_SEP}) to build `[CLS] a [SEP] b [SEP]`"
                )
            self.cls_id, self.sep_id = vocab[QWEN_CLS], vocab[QWEN_SEP]
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if self.pad_id is None:
            raise ValueError(f"pair classifier {path}: its tokenizer has no pad or eos token")
        self.use_token_types = "token_type_ids" in tok.model_input_names
        max_pos = getattr(self.model.config, "max_position_embeddings", None)
        if max_pos is not None and 2 * max_tokens_per_side + 3 > max_pos:
            raise ValueError(
                f"pair classifier {path}: max_tokens_per_side={max_tokens_per_side} makes pairs of "
                f"up to {2 * max_tokens_per_side + 3} tokens, the model takes {max_pos}; use "
                f"<= {(max_pos - 3) // 2}"
            )
        # One forward at a time: the server's batcher and the reward threads may share a model.
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------ encoding
    def _encode_sides(self, texts: list[str]) -> list[list[int]]:
        enc = self.tokenizer(
            texts,
            add_special_tokens=False,
            truncation=True,
            max_length=self.max_tokens_per_side,
        )["input_ids"]
        return [ids[: self.max_tokens_per_side] for ids in enc]

    def encode_pair(self, ids_a: list[int], ids_b: list[int]) -> tuple[list[int], list[int]]:
        """(input_ids, token_type_ids) of `[CLS] a [SEP] b [SEP]`."""
        ids = [self.cls_id, *ids_a, self.sep_id, *ids_b, self.sep_id]
        types = [0] * (len(ids_a) + 2) + [1] * (len(ids_b) + 1)
        return ids, types

    def _encode(self, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
        texts = list(dict.fromkeys(t for p in pairs for t in p))  # each text encoded once
        index = {t: i for i, t in enumerate(texts)}
        sides = self._encode_sides(texts)
        return [self.encode_pair(sides[index[a]], sides[index[b]]) for a, b in pairs]

    # ------------------------------------------------------------------------------ scoring
    def _forward(self, encoded: list[tuple[list[int], list[int]]]) -> list[float]:
        import torch

        T = max(len(ids) for ids, _ in encoded)
        input_ids = torch.full((len(encoded), T), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(encoded), T), dtype=torch.long)
        mask = torch.zeros((len(encoded), T), dtype=torch.long)
        for r, (ids, tt) in enumerate(encoded):
            input_ids[r, : len(ids)] = torch.tensor(ids)
            types[r, : len(tt)] = torch.tensor(tt)
            mask[r, : len(ids)] = 1
        kwargs = {"input_ids": input_ids, "attention_mask": mask}
        if self.use_token_types:
            kwargs["token_type_ids"] = types
        kwargs = {k: v.to(self.device) for k, v in kwargs.items()}
        with self._lock, torch.inference_mode():
            logits = self.model(**kwargs).logits.float()
        return torch.softmax(logits, dim=-1)[:, 1].tolist()

    def probs(self, pairs: list[tuple[str, str]]) -> list[float]:
        """P(same) of each pair: batches of `batch_size`, pairs sorted by length so a batch
        pads little; results in the input order."""
        if not pairs:
            return []
        encoded = self._encode(pairs)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
        out = [0.0] * len(encoded)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, p in zip(chunk, self._forward([encoded[i] for i in chunk])):
                out[i] = p
        return out

    def probs_reference(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Slow reference: one unpadded forward per pair."""
        return [self._forward(self._encode([p]))[0] for p in pairs]
