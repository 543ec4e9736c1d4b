"""The rollout store: every RL step's rollouts appended to `<output_dir>/rollouts.zarr` (zarr 3).

Per sample it records the prompt (token ids, text, ground truth), the response (token ids,
text, engine log-probs, the actor's old log-probs), reward and reward terms, advantage, finish
reason, policy version, metadata, and extra per-sample fields the step adds (DARLING partition
class, DARTS end, ...). `megatron-rl report` and `megatron-rl inspect` read it through
`megatron_rl.data.store_reader.RolloutReader`.

Why this file passes 450 lines: the writer's layout, its crash-safe commit record and its
resume truncation are one invariant (every array's length after the last complete step); split
across files, the rule that keeps them in step would live in none of them.

Layout: 1-D arrays, each in one row space. Ragged fields are `<path>/values` plus `<path>/ends`
(cumulative end offsets: row i is values[ends[i-1]:ends[i]]); strings are UTF-8 bytes.

    steps/    step, sample_end, group_end                       one row per step
    groups/   group_id, prompt_ids, prompt_text, ground_truth   one row per prompt of a step
                                                                (its n samples share it)
    samples/  group (row in groups/), reward, advantage, finish_reason, policy_version,
              sample_id, response_ids, response_text, metadata (JSON, "" = as the sample
              before it in its group),
              reward_metrics/<term>, extra/<field>               one row per sample
    tokens:   samples/response_logprobs, samples/old_logprobs    aligned with response_ids/values

A field a step lacks reads as absent (NaN, INT64_MIN or ""), and so does a field first seen
later, for the steps before it.

Crash safety: the group attribute `committed` (every array's length after the last complete
step) is the commit record, written after the arrays. zarr's local store replaces each file
atomically, so after a kill -9 the store reads up to the last committed step, and the next
writer ignores (and overwrites) the partial one. Arrays grow by doubling, so a step costs one
chunk write per array and no metadata rewrite; `close()` trims them to their length.

Writes run on a background thread (one step's zarr writes cost tens of ms on a small CPU; the
trainer need not wait for them): `append` converts and validates the step, then queues it; the
thread writes what is queued, several steps in one batch when it has fallen behind, and commits.
`flush()` waits for it; a write error is raised by the next `append`, `flush` or `close`.

One writer per store (global rank 0; the other ranks send it their samples): a second writer is
refused through an flock on the store's folder, which the OS releases even on kill -9.

    store = RolloutStore.open(output_dir, resume_step=start, tokenizer=tok)
    store.append(step, samples, advantages, old_logprobs=batch.old_logprobs,
                 extra={"darts_end": ["short", "long", ...]})
    store.close()
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import queue
import threading
import time
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec
from zarr.core.sync import sync

from megatron_rl.types import FINISH_REASONS, Sample

STORE_NAME = "rollouts.zarr"
FORMAT = "megatron-rl rollouts 1"
CHUNK_BYTES = 1 << 18
"""Raw bytes per chunk (elements: CHUNK_BYTES / itemsize): few files, and a write re-encodes at
most 256 KB per array."""
INT_ABSENT = int(np.iinfo(np.int64).min)
"""What an int / bool extra field holds where a sample has no value."""
EXTRA_KINDS = ("int", "float", "bool", "str")
LOGPROBS = ("samples/response_logprobs", "samples/old_logprobs")
MAX_QUEUED_STEPS = 64
"""Steps `append` may run ahead of the writer thread before it blocks."""
COMMIT_INTERVAL_S = 0.5
"""The writer commits at most this often (steps appended meanwhile go in one batch): a step is
durable within this long after `append`, at once after `flush()`."""


def store_path(output_dir: str) -> str:
    return os.path.join(output_dir, STORE_NAME)


def space_of(path: str) -> str:
    """Row space of an array: steps, groups, samples, tokens, or `values` (sized by its ends)."""
    if path.endswith("/values"):
        return "values"
    if path in LOGPROBS:
        return "tokens"
    return path.split("/", 1)[0]


def absent_value(dtype) -> Any:
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.nan
    return INT_ABSENT if dtype == np.int64 else 0


def to_json(value, what: str) -> str:
    def default(o):
        if hasattr(o, "tolist"):  # numpy / torch scalars and arrays
            return o.tolist()
        raise TypeError(f"{what}: a {type(o).__name__} is not JSON-serializable (the rollout "
                        "store keeps this field as JSON)")

    return json.dumps(value, default=default, ensure_ascii=False)


def _lengths(rows) -> np.ndarray:
    return np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))


def _utf8(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    raw = [s.encode("utf-8") for s in strings]
    return np.frombuffer(b"".join(raw), dtype=np.uint8).copy(), _lengths(raw)


def _tokens(rows: list, what: str) -> tuple[np.ndarray, np.ndarray]:
    flat = np.fromiter((t for r in rows for t in r), dtype=np.int64)
    if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(np.int32).max):
        raise ValueError(f"RolloutStore.append: {what} must lie in [0, 2^31) (stored as int32)")
    return flat.astype(np.int32), _lengths(rows)


def _floats(rows: list) -> np.ndarray:
    if rows and all(hasattr(r, "detach") for r in rows):  # torch: one concatenation
        import torch

        return torch.cat([r.reshape(-1) for r in rows]).detach().float().cpu().numpy()
    parts = [np.asarray(r, dtype=np.float32).reshape(-1) for r in rows]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def _kind(v) -> str:
    if isinstance(v, bool | np.bool_):
        return "bool"
    if isinstance(v, int | np.integer):
        return "int"
    if isinstance(v, float | np.floating):
        return "float"
    return "str" if isinstance(v, str) else type(v).__name__


class RolloutStore:
    """Append-only writer of `<output_dir>/rollouts.zarr`; see the module docstring.

    `open(output_dir, resume_step)` keeps the stored steps <= resume_step and drops the rest
    (0: a fresh run keeps nothing; None: keep every committed step). `tokenizer` (anything with
    `decode(ids)`) adds prompt and response text; without it only token ids are stored.
    """

    def __init__(self, group, lock_fd: int, tokenizer):
        self._group = group
        self._lock_fd = lock_fd
        self._tokenizer = tokenizer
        committed = group.attrs["committed"]
        self.kinds: dict[str, str] = dict(committed["kinds"])
        """Extra field name -> one of EXTRA_KINDS (fixed by the field's first values)."""
        self.last_step: int | None = committed["last_step"]
        """The last step appended (queued, not necessarily written yet)."""
        # writer-thread state: array handles, committed lengths, cached last `ends` values
        self._arrays: dict[str, Any] = {}
        self._len: dict[str, int] = dict(committed["lengths"])
        self._last_end: dict[str, int] = {}
        self._rows: dict[str, int] = {}  # append-side row counts per space
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED_STEPS)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  # set by flush / close: commit without waiting
        self._next_commit = 0.0

    @classmethod
    def open(cls, output_dir: str, resume_step: int | None = 0, *, tokenizer=None) -> RolloutStore:
        path = store_path(output_dir)
        os.makedirs(path, exist_ok=True)
        fd = os.open(path, os.O_RDONLY)  # the lock is an flock on the store's folder itself
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"{path} is already open for writing by another process (one "
                               "writer per store: only global rank 0 appends)") from None
        try:
            _remove_partial_files(path)  # temp files of writes a kill interrupted
            group = zarr.open_group(path, mode="a", zarr_format=3)
            if "format" not in group.attrs:
                group.attrs.update({"format": FORMAT, "committed": {
                    "lengths": {}, "kinds": {}, "last_step": None}})
            elif group.attrs["format"] != FORMAT:
                raise ValueError(f"{path} has format {group.attrs['format']!r}, expected "
                                 f"{FORMAT!r} (a megatron-rl rollout store)")
            store = cls(group, fd, tokenizer)
            store._truncate(resume_step)
        except BaseException:
            os.close(fd)
            raise
        store._rows = {space: store._space_len(space)
                       for space in ("steps", "groups", "samples", "tokens")}
        store._thread = threading.Thread(target=store._run, name="rollout-store", daemon=True)
        store._thread.start()
        return store

    def flush(self) -> None:
        """Wait until every appended step is written and committed (call it before saving a
        checkpoint, so the store holds every step the checkpoint has seen)."""
        self._wake.set()
        self._queue.join()
        self._check()

    def close(self) -> None:
        """Flush, trim every array to its length and release the writer lock."""
        if self._lock_fd < 0:
            return
        try:
            self._queue.put(None)
            self._wake.set()
            self._thread.join()
            self._check()
            for path, n in self._len.items():
                arr = self._array(path)
                if arr.shape[0] != n:
                    arr.resize((n,))
        finally:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> RolloutStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout store writer failed: {self._error!r}") from self._error

    # ------------------------------------------------------------------------------ append
    def append(self, step: int, samples: list[Sample], advantages, *, old_logprobs=None,
               extra: dict[str, Any] | None = None) -> None:
        """Queue one step's samples (in the order the step trained on them) for writing.

        advantages: [N] per-sample advantages (stored as float32). old_logprobs: N arrays [L_i]
        of log-probs under pi_old (float32), or None. extra: per-sample fields, name -> N
        values, all int, float, bool or str; None marks an absent int / float / bool value.
        """
        if self._lock_fd < 0:
            raise RuntimeError("RolloutStore.append after close()")
        self._check()
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"RolloutStore.append: step {step} is not after the last stored "
                             f"step {self.last_step}")
        n = len(samples)
        adv = np.asarray(advantages.tolist() if hasattr(advantages, "tolist") else advantages,
                         dtype=np.float32).reshape(-1)
        if adv.shape != (n,):
            raise ValueError(f"RolloutStore.append: {adv.shape[0]} advantages for {n} samples")
        rows: dict[str, np.ndarray] = {}  # path -> new rows (ragged `ends` as row lengths)
        groups, truths, index = self._groups(samples)
        ragged = {
            "groups/group_id": _utf8([g.group_id for g in groups]),
            "groups/prompt_ids": _tokens([g.prompt_ids for g in groups], "prompt_ids"),
            "groups/ground_truth": _utf8(truths),
            "samples/sample_id": _utf8([s.sample_id for s in samples]),
            "samples/response_ids": _tokens([s.response_ids for s in samples], "response_ids"),
            "samples/metadata": _utf8(_metadata_json(samples)),
        }
        if self._tokenizer is not None:
            ragged["groups/prompt_text"] = _utf8([self._tokenizer.decode(g.prompt_ids)
                                                  for g in groups])
            ragged["samples/response_text"] = _utf8([self._tokenizer.decode(s.response_ids)
                                                     for s in samples])
        rows["samples/group"] = self._rows["groups"] + np.asarray(index, dtype=np.int64)
        rows["samples/reward"] = np.array([float(s.reward) for s in samples], np.float64)
        rows["samples/advantage"] = adv
        rows["samples/finish_reason"] = np.array(
            [FINISH_REASONS.index(s.finish_reason) for s in samples], np.uint8)
        rows["samples/policy_version"] = np.array([s.policy_version for s in samples], np.int64)
        lengths = [len(s.response_ids) for s in samples]
        for path, seqs in ((LOGPROBS[0], [s.response_logprobs for s in samples]),
                           (LOGPROBS[1], old_logprobs)):
            if seqs is None or all(x is None for x in seqs):
                continue  # written as absent (NaN)
            if len(seqs) != n or any(x is None or len(x) != k for x, k in zip(seqs, lengths)):
                raise ValueError(f"RolloutStore.append: {path.split('/')[1]} needs one array per "
                                 "sample, as long as its response")
            rows[path] = _floats(seqs)
        for k in sorted({k for s in samples for k in s.reward_metrics}):
            rows[f"samples/reward_metrics/{k}"] = np.array(
                [float(s.reward_metrics.get(k, np.nan)) for s in samples], np.float64)
        for name, values in (extra or {}).items():
            self._put_extra(rows, ragged, name, values, n)
        for path, (values, lens) in ragged.items():
            rows[f"{path}/values"], rows[f"{path}/ends"] = values, lens
        grown = {"steps": 1, "groups": len(groups), "samples": n, "tokens": sum(lengths)}
        for space, k in grown.items():
            self._rows[space] += k
        rows["steps/step"] = np.array([step], np.int64)
        rows["steps/sample_end"] = np.array([self._rows["samples"]], np.int64)
        rows["steps/group_end"] = np.array([self._rows["groups"]], np.int64)
        self.last_step = step
        self._queue.put((step, rows, grown, dict(self.kinds)))

    def _groups(self, samples: list[Sample]):
        """One row per distinct group_id (first-appearance order), and each sample's row."""
        rows: dict[str, int] = {}
        groups, truths, index = [], [], []
        for s in samples:
            k = rows.setdefault(s.group_id, len(groups))
            if k == len(groups):
                groups.append(s)
                truths.append(to_json(s.ground_truth, f"Sample.ground_truth of {s.group_id!r}"))
            elif groups[k].prompt_ids != s.prompt_ids or (
                    s.ground_truth is not groups[k].ground_truth  # make_groups shares one object
                    and to_json(s.ground_truth, "Sample.ground_truth") != truths[k]):
                raise ValueError(f"RolloutStore.append: samples of group {s.group_id!r} differ in "
                                 "prompt_ids or ground_truth")
            index.append(k)
        return groups, truths, index

    def _put_extra(self, rows: dict, ragged: dict, name: str, values, n: int) -> None:
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        if len(values) != n:
            raise ValueError(f"RolloutStore.append: extra field {name!r} has {len(values)} "
                             f"values for {n} samples")
        kinds = {_kind(v) for v in values if v is not None}
        if kinds == {"int", "float"} or (kinds == {"int"} and self.kinds.get(name) == "float"):
            kinds = {"float"}
        kind = self.kinds.get(name, next(iter(kinds)) if len(kinds) == 1 else None)
        if kind not in EXTRA_KINDS or not kinds <= {kind}:
            raise ValueError(f"RolloutStore.append: extra field {name!r} must hold values of one "
                             f"kind of {EXTRA_KINDS} (stored: {self.kinds.get(name)}), got "
                             f"{sorted(kinds)}")
        path = f"samples/extra/{name}"
        if kind == "str":
            if None in values:
                raise ValueError(f"RolloutStore.append: extra field {name!r} (str) has None "
                                 "values; use '' for none")
            ragged[path] = _utf8(values)
        elif kind == "float":
            rows[path] = np.array([np.nan if v is None else v for v in values], np.float64)
        else:
            rows[path] = np.array([INT_ABSENT if v is None else int(v) for v in values], np.int64)
        self.kinds[name] = kind

    # ------------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            if batch[-1] is not None:  # group commit: let steps gather until the interval ends
                self._wake.wait(self._next_commit - time.monotonic())
                self._wake.clear()
            while batch[-1] is not None and len(batch) < MAX_QUEUED_STEPS:
                try:  # steps queued while the last batch was written go in one batch
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            items = [b for b in batch if b is not None]
            if items and self._error is None:
                try:
                    self._write(items)
                except BaseException as e:  # surfaced by the next append / flush / close
                    self._error = e
            self._next_commit = time.monotonic() + COMMIT_INTERVAL_S
            for _ in batch:
                self._queue.task_done()
            if batch[-1] is None:
                return

    def _write(self, items: list) -> None:
        """Write queued steps as one batch, then commit them."""
        base = {space: self._space_len(space) for space in ("steps", "groups", "samples",
                                                            "tokens")}
        paths = dict.fromkeys([*self._len, *(p for _, rows, _, _ in items for p in rows)])
        writes = []
        for path in paths:
            space = space_of(path)
            dtype = self._array(path).dtype if path in self._len else \
                next(rows[path].dtype for _, rows, _, _ in items if path in rows)
            parts = []
            for _, rows, grown, _ in items:
                if path in rows:
                    parts.append(rows[path])
                elif space != "values":  # a field this step lacks: absent rows (empty strings)
                    parts.append(np.zeros(grown[space], np.int64) if path.endswith("/ends")
                                 else np.full(grown[space], absent_value(dtype), dtype))
            data = np.concatenate(parts)
            # a field first seen now: the rows before this batch read as absent (fill value)
            arr = self._array(path, dtype, start=0 if space == "values" else base[space])
            if path.endswith("/ends"):
                data = self._last(path) + np.cumsum(data, dtype=np.int64)
            start, end = self._len[path], self._len[path] + data.shape[0]
            if end > arr.shape[0]:
                arr.resize((max(end, 2 * arr.shape[0], arr.chunks[0]),))
            if data.shape[0]:
                writes.append(arr.async_array.setitem(slice(start, end), data))
                if path.endswith("/ends") or space == "steps":
                    self._last_end[path] = int(data[-1])
            self._len[path] = end
        sync(_gather(writes))  # the arrays' chunk writes run concurrently in zarr's event loop
        self._commit(items[-1][3], items[-1][0])

    def _commit(self, kinds: dict, last_step: int | None) -> None:
        self._group.attrs["committed"] = {"lengths": self._len, "kinds": kinds,
                                          "last_step": last_step}

    def _array(self, path: str, dtype=None, start: int = 0):
        arr = self._arrays.get(path)
        if arr is None:
            if path in self._len:
                arr = self._group[path]
            else:
                dtype = np.dtype(dtype)
                arr = self._group.create_array(  # overwrite: an uncommitted array of a kill
                    path, shape=(start,), dtype=dtype, chunks=(CHUNK_BYTES // dtype.itemsize,),
                    overwrite=True,
                    fill_value=0 if path.endswith("/ends") else absent_value(dtype),
                    # byte-shuffled zstd: ids and offsets are small ints, log-probs share exponents
                    compressors=BloscCodec(cname="zstd", clevel=5, shuffle="shuffle",
                                           typesize=dtype.itemsize))
                self._len[path] = start
            self._arrays[path] = arr
        return arr

    def _space_len(self, space: str) -> int:
        if space == "tokens":
            return self._last("samples/response_ids/ends")
        key = {"steps": "steps/step", "groups": "groups/group_id/ends",
               "samples": "samples/group"}[space]
        return self._len.get(key, 0)

    def _last(self, path: str) -> int:
        """Last committed value of an int array (0 when empty); cached."""
        if path not in self._last_end:
            k = self._len.get(path, 0)
            self._last_end[path] = int(self._array(path)[k - 1]) if k else 0
        return self._last_end[path]

    def _truncate(self, resume_step: int | None) -> None:
        """Keep the committed steps <= resume_step (every array cut at that step's end)."""
        keep = None
        if self.last_step is not None and resume_step is not None and \
                self.last_step > resume_step:
            steps = self._array("steps/step")[: self._len["steps/step"]]
            keep = int(np.searchsorted(steps, resume_step, side="right"))
        if self.last_step is None or keep == 0:
            self._reset()
            return
        if keep is None:
            return

        def at(path, rows):  # the value closing row `rows` of an int array (0 for none)
            return int(self._array(path)[rows - 1]) if rows else 0

        sizes = {"steps": keep, "groups": at("steps/group_end", keep),
                 "samples": at("steps/sample_end", keep)}
        sizes["tokens"] = at("samples/response_ids/ends", sizes["samples"])
        new = {p: min(sizes[space_of(p)], n) for p, n in self._len.items()
               if space_of(p) != "values"}
        for p in self._len:
            if space_of(p) == "values":
                ends = p[: -len("values")] + "ends"
                new[p] = at(ends, new[ends])
        self._len, self._last_end = new, {}
        self.last_step = int(steps[keep - 1])
        self._commit(self.kinds, self.last_step)

    def _reset(self) -> None:
        """No step kept: forget the old fields (and their kinds); arrays a killed writer left
        uncommitted go too. The empty commit comes first, so a kill here loses nothing kept."""
        self._len, self._last_end, self._arrays, self.kinds, self.last_step = {}, {}, {}, {}, None
        self._commit({}, None)
        for name in list(self._group.keys()):
            del self._group[name]


def _metadata_json(samples: list[Sample]) -> list[str]:
    """JSON per sample; "" for "the same as the previous sample of its group" (a group's samples
    share the prompt's metadata: without this the field would dominate the store)."""
    out, prev = [], None
    for i, s in enumerate(samples):
        same = i > 0 and s.group_id == samples[i - 1].group_id and (
            s.metadata is prev or s.metadata == prev)
        out.append("" if same else to_json(s.metadata, f"Sample.metadata of sample {i}"))
        prev = s.metadata
    return out


async def _gather(coroutines: list) -> None:
    await asyncio.gather(*coroutines)


def _remove_partial_files(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            if f.endswith(".partial"):
                os.unlink(os.path.join(root, f))
