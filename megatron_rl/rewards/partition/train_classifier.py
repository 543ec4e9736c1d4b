"""`megatron-rl train-classifier`: fine-tune a pair classifier (the learned partition function,
docs/algorithms.md A.2.2) on labelled pairs, and generate a labelled pair set for our tasks.

    megatron-rl train-classifier --make-pairs pairs.jsonl [--num-pairs 20000] [--seed 0]
    megatron-rl train-classifier --data pairs.jsonl --out runs/pair_clf [--val val.jsonl]
        [--init HF_MODEL_DIR] [--steps 1000] [--batch-size 64] [--lr 1e-3] ...

Data: jsonl rows `{"a": str, "b": str, "same": 0 | 1}` (line numbers counted from 1 in errors).
Without `--val`, a seeded `--val-fraction` of the rows is held out. Training follows A.2.2:
both orders of every training pair, class-weighted cross entropy (weight_c = N / N_c), AdamW,
linear warmup then cosine decay to a tenth of the peak LR. The held-out accuracy, precision,
recall and F1 (class "same", P(same) > 0.5) are printed as one JSON line and saved in
`<out>/train_metrics.json`; `<out>` is an HF folder `serve-classifier` and
`reward.diversity.classifier_path` load.

Without `--init` the model is a tiny BERT built from a config (no download) with a whole-word
vocabulary of the data's most frequent words: what trains on 2 CPU cores in a minute or two.

`make_pairs` draws pairs of responses to one prompt of our synthetic tasks (an arithmetic
problem, or "a number between 10 and 99 whose digits sum to 9"), each response stating an
answer in one of several phrasings, some with working; a pair is the same iff both state the
same final answer, so lexical overlap alone does not decide it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

TEMPLATES = (
    "{n}",
    "the answer is {n}",
    "answer : {n}",
    "my final answer is {n} .",
    "after working it out carefully i get {n} as the result .",
    "i think the number you are looking for is {n} .",
    "{n} is the number that satisfies the condition .",
    "so the result of the computation is {n} and that is final .",
    "let me check : the answer should be {n} , i am confident .",
    "{work} , so the answer is {n} .",
    "we have {work} . therefore {n} .",
)


def _response(rng: random.Random, task: tuple, n: int) -> str:
    kind, x, y = task
    if kind == "arith":
        work = f"{x} + {y} = {n}"
    else:  # digit sum: the working spells out the digits of the stated number
        work = f"{n // 10} + {n % 10} = {n // 10 + n % 10}"
    return rng.choice(TEMPLATES).format(n=n, work=work)


def make_pairs(num_pairs: int, seed: int = 0) -> list[dict]:
    """`num_pairs` labelled pairs `{"a", "b", "same"}`, about half of them the same."""
    rng = random.Random(f"pairs:{seed}")
    digit_sum_9 = [n for n in range(10, 100) if n // 10 + n % 10 == 9]
    rows = []
    while len(rows) < num_pairs:
        if rng.random() < 0.5:
            x, y = rng.randint(0, 99), rng.randint(0, 99)
            task, answers = (
                ("arith", x, y),
                [x + y, x + y + 1, x + y - 1, x + y + 10, rng.randint(0, 198)],
            )
        else:
            task, answers = ("digits", 0, 0), digit_sum_9 + [rng.randint(10, 99)]
        na = rng.choice(answers)
        nb = na if rng.random() < 0.5 else rng.choice([a for a in answers if a != na])
        rows.append(
            {"a": _response(rng, task, na), "b": _response(rng, task, nb), "same": int(na == nb)}
        )
    return rows


def read_pairs(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path} line {lineno}: not JSON ({e})") from e
            if (
                not isinstance(row, dict)
                or not isinstance(row.get("a"), str)
                or not isinstance(row.get("b"), str)
                or row.get("same") not in (0, 1, True, False)
            ):
                raise ValueError(f'{path} line {lineno}: need {{"a": str, "b": str, "same": 0|1}}')
            rows.append({"a": row["a"], "b": row["b"], "same": int(row["same"])})
    if not rows:
        raise ValueError(f"{path}: no pairs")
    return rows


def build_tiny(
    texts: list[str], *, vocab_size: int, hidden: int, layers: int, max_tokens_per_side: int
):
    """A whole-word BERT tokenizer built from `texts` and a randomly initialized tiny BERT pair
    classifier sized to it (positions for `[CLS] a [SEP] b [SEP]`)."""
    from collections import Counter

    from tokenizers import BertWordPieceTokenizer
    from tokenizers.pre_tokenizers import BertPreTokenizer
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    # Whole-word vocabulary, most frequent first, ties by spelling: deterministic (the trained
    # WordPiece of `tokenizers` orders tied pieces differently from run to run); words outside
    # it become [UNK].
    split = BertPreTokenizer().pre_tokenize_str
    counts = Counter(w for t in texts for w, _ in split(t.lower()))
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted(counts, key=lambda w: (-counts[w], w))[: max(0, vocab_size - len(specials))]
    wp = BertWordPieceTokenizer(
        vocab={w: i for i, w in enumerate(specials + words)}, lowercase=True
    )
    tokenizer = BertTokenizerFast(
        tokenizer_object=wp._tokenizer,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
    )
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 16),
        intermediate_size=4 * hidden,
        # From scratch at this size: no dropout, and a wider init than BERT's 0.02, at which
        # attention stays uniform and the model cannot find the answer tokens to compare
        # (measured on make_pairs data: 2 layers at 0.02 stay at chance for 1,000 steps; 1 layer
        # at 0.1 reaches 92% held-out accuracy in 600).
        initializer_range=0.1,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=2 * max_tokens_per_side + 3,
        num_labels=2,
        id2label={0: "distinct", 1: "same"},
        label2id={"distinct": 0, "same": 1},
    )
    return tokenizer, BertForSequenceClassification(config)


def binary_metrics(probs: list[float], labels: list[int], threshold: float = 0.5) -> dict:
    """Accuracy, precision, recall and F1 of the class "same" at P(same) > threshold."""
    pred = [int(p > threshold) for p in probs]
    tp = sum(p == 1 and y == 1 for p, y in zip(pred, labels))
    fp = sum(p == 1 and y == 0 for p, y in zip(pred, labels))
    fn = sum(p == 0 and y == 1 for p, y in zip(pred, labels))
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    acc = sum(p == y for p, y in zip(pred, labels)) / max(len(labels), 1)
    return {"accuracy": acc, "precision": precision, "recall": recall, "f1": f1}


def train(
    train_rows: list[dict],
    val_rows: list[dict],
    out: str,
    *,
    init: str = "",
    steps: int = 1000,
    batch_size: int = 64,
    lr: float = 1e-3,
    warmup_frac: float = 0.1,
    max_tokens_per_side: int = 32,
    vocab_size: int = 1000,
    hidden: int = 64,
    layers: int = 1,
    seed: int = 0,
) -> dict:
    """Fine-tune (or build and train) a pair classifier; save it to `out`; held-out metrics."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from megatron_rl.rewards.partition.classifier import PairEncoder, check_pair_model

    torch.manual_seed(seed)
    if init:
        tokenizer = AutoTokenizer.from_pretrained(init, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(
            init, local_files_only=True, num_labels=2
        )
    else:
        texts = [t for r in train_rows for t in (r["a"], r["b"])]
        tokenizer, model = build_tiny(
            texts,
            vocab_size=vocab_size,
            hidden=hidden,
            layers=layers,
            max_tokens_per_side=max_tokens_per_side,
        )
    encoder = PairEncoder(tokenizer, max_tokens_per_side, "train-classifier")
    check_pair_model(model, encoder, "train-classifier")
    # both orders of every training pair (A.2.2); validation keeps one order
    pairs = [(r["a"], r["b"]) for r in train_rows] + [(r["b"], r["a"]) for r in train_rows]
    labels = torch.tensor([r["same"] for r in train_rows] * 2)
    encoded = encoder.encode(pairs)
    counts = torch.bincount(labels, minlength=2).double()
    if (counts == 0).any():
        raise ValueError(
            "train-classifier: the training pairs need both labels (same and distinct)"
        )
    weight = (counts.sum() / counts).float()  # weight_c = N / N_c
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, int(warmup_frac * steps))

    def lr_at(step: int) -> float:  # linear warmup, then cosine to lr / 10
        if step < warmup:
            return lr * (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    gen = torch.Generator().manual_seed(seed)
    model.train()
    t0 = time.perf_counter()
    recent: list[float] = []  # losses of the last 50 steps, for the report
    for step in range(steps):
        idx = torch.randint(len(encoded), (batch_size,), generator=gen).tolist()
        batch = encoder.collate([encoded[i] for i in idx])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(**batch).logits.float()
        loss = torch.nn.functional.cross_entropy(logits, labels[idx], weight=weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = [*recent[-49:], loss.item()]
    train_s = time.perf_counter() - t0
    model.eval()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    from megatron_rl.rewards.partition.classifier import PairClassifier

    clf = PairClassifier(out, max_tokens_per_side=max_tokens_per_side, batch_size=256)
    probs = clf.probs([(r["a"], r["b"]) for r in val_rows])
    metrics = {
        **binary_metrics(probs, [r["same"] for r in val_rows]),
        "num_train": len(train_rows),
        "num_val": len(val_rows),
        "steps": steps,
        "train_loss_last50": sum(recent) / max(1, len(recent)),
        "train_seconds": round(train_s, 1),
        "max_tokens_per_side": max_tokens_per_side,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    with open(os.path.join(out, "train_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    return metrics


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-rl train-classifier", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--make-pairs", metavar="OUT.jsonl", help="write a generated labelled pair set and exit"
    )
    p.add_argument("--num-pairs", type=int, default=20000, help="pairs to generate (--make-pairs)")
    p.add_argument("--data", help="training pairs, jsonl {a, b, same}")
    p.add_argument("--val", help="held-out pairs (default: --val-fraction of --data)")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--out", help="output folder (an HF model folder)")
    p.add_argument("--init", default="", help="local HF sequence-classification model to fine-tune")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-tokens-per-side", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=1000, help="tiny model only")
    p.add_argument("--hidden", type=int, default=64, help="tiny model only")
    p.add_argument("--layers", type=int, default=1, help="tiny model only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.make_pairs:
        rows = make_pairs(args.num_pairs, args.seed)
        with open(args.make_pairs, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(
            json.dumps(
                {"pairs": len(rows), "same": sum(r["same"] for r in rows), "path": args.make_pairs}
            )
        )
        return 0
    if not args.data or not args.out:
        raise ValueError(
            "train-classifier needs --data PAIRS.jsonl and --out DIR (or --make-pairs OUT)"
        )
    if args.init and any(f"--{k}" in " ".join(argv) for k in ("vocab-size", "hidden", "layers")):
        raise ValueError(
            "train-classifier: --vocab-size/--hidden/--layers size the tiny model; not with --init"
        )
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    rows = read_pairs(args.data)
    if args.val:
        train_rows, val_rows = rows, read_pairs(args.val)
    else:
        if not 0 < args.val_fraction < 1:
            raise ValueError("train-classifier --val-fraction must be in (0, 1)")
        rng = random.Random(args.seed)
        order = list(range(len(rows)))
        rng.shuffle(order)
        k = max(1, int(len(rows) * args.val_fraction))
        val_rows, train_rows = [rows[i] for i in order[:k]], [rows[i] for i in order[k:]]
    metrics = train(
        train_rows,
        val_rows,
        args.out,
        init=args.init,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        max_tokens_per_side=args.max_tokens_per_side,
        vocab_size=args.vocab_size,
        hidden=args.hidden,
        layers=args.layers,
        seed=args.seed,
    )
    print(json.dumps(metrics))
    return 0
