"""Durable files for checkpoints: fsync, a manifest of sizes and checksums written last, its
verification, and an atomically replaced pointer file.

A checkpoint folder is complete exactly when its `manifest.json` exists and every file it lists
has the listed size and SHA-256: the manifest is written (and fsynced) after every other file
and folder, so a save killed at any moment leaves a folder that `verify` rejects, never one that
loads half-written shards. A truncated shard, a deleted file or a flipped byte are all caught
before anything is loaded.

    write_manifest(folder, meta={"step": 4})   # fsyncs everything below folder, then the manifest
    problem = verify(folder)                   # None, or what is wrong (names the file)
    write_pointer(root, "latest", "step_000004")
"""

from __future__ import annotations

import hashlib
import json
import os

MANIFEST = "manifest.json"


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    """Make a folder's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _files(folder: str) -> list[str]:
    out = []
    for d, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(d, n), folder) for n in names]
    return sorted(p for p in out if p != MANIFEST)


def write_manifest(folder: str, meta: dict | None = None) -> dict:
    """fsync every file and folder under `folder`, then write `manifest.json` (path -> size,
    sha256) and fsync it and its folder. Returns the manifest."""
    files = {}
    for rel in _files(folder):
        path = os.path.join(folder, rel)
        fsync_file(path)
        files[rel] = {"size": os.path.getsize(path), "sha256": sha256(path)}
    for d, _, _ in os.walk(folder):
        fsync_dir(d)
    manifest = {**(meta or {}), "files": files}
    path = os.path.join(folder, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_dir(folder)
    return manifest


def read_manifest(folder: str) -> dict | None:
    """The manifest of a complete folder (None when there is none or it does not parse)."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest.get("files"), dict) else None


def verify(folder: str, checksums: bool = True) -> str | None:
    """None when `folder` is complete and intact, else a sentence naming what is wrong."""
    manifest = read_manifest(folder)
    if manifest is None:
        return f"`{os.path.join(folder, MANIFEST)}` is missing or unreadable (an unfinished save)"
    for rel, want in manifest["files"].items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"`{path}` is missing"
        size = os.path.getsize(path)
        if size != want["size"]:
            return f"`{path}` has {size} bytes, the manifest says {want['size']} (truncated?)"
        if checksums and sha256(path) != want["sha256"]:
            return f"`{path}` does not match its SHA-256 in the manifest (corrupt)"
    return None


def write_pointer(root: str, name: str, target: str) -> None:
    """Atomically replace the one-line file `root/name` with `target`."""
    path = os.path.join(root, name)
    with open(path + ".tmp", "w") as f:
        f.write(target + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_dir(root)


def read_pointer(root: str, name: str) -> str | None:
    try:
        with open(os.path.join(root, name)) as f:
            return f.read().strip() or None
    except OSError:
        return None
