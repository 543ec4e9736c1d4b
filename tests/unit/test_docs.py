"""The documentation lives inside the repository and every citation of it resolves (issue 11).

- No git-tracked text file names the shared folder outside the repository (the strings are built
  below so that this file does not contain them).
- Every citation `docs/algorithms.md <SEC>` in a tracked .py/.md/.yaml/.h/.cpp/.cu/.sh file names a
  heading of docs/algorithms.md: one section (`B.4.2`), a range (`B.3-B.5`: both ends must exist),
  a list (`C.0, C.2`, `C.2 / C.0.4`, `B.3/B.5`, continued on the next line after a trailing
  separator), `part C`, or `notation`. Bare section numbers such as `(B.4)` in a file that cites
  docs/algorithms.md are checked too: they refer to the same document.
- `docs/design.md` citations by section name (`docs/design.md, "Megatron-Core on CPU"`) and by shim
  number (`docs/design.md, shim 11`) resolve, and the shim list matches megatron_rl/patches.py.

Each failure lists every unresolved citation as file:line. Pure text processing: no torch import.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALGORITHMS = ROOT / "docs" / "algorithms.md"
DESIGN = ROOT / "docs" / "design.md"
CITING_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".h", ".cpp", ".cu", ".sh")
FORBIDDEN = ("../" + "shared", "/work/" + "shared")

SEC = r"[A-G](?:\.\d+)+"
# A section number not glued to a word or a dotted name on either side (so `x.B.1` is not one).
BARE_SEC = re.compile(rf"(?<![\w.]){SEC}(?![\w])")
ALGO_TOKEN = re.compile(
    rf"(?P<a>{SEC})\s*[-\u2013]\s*(?P<b>{SEC})(?![\w])"  # range B.3-B.5
    rf"|\bpart\s+(?P<part>[A-Z])\b"  # part C
    rf"|(?<![\w.])(?P<sec>{SEC})(?![\w])"  # one section
)
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$")
HEADING_ID = re.compile(r"^(?P<id>[A-Z0-9](?:\.\d+)*)\.?(?=\s|$)")
CONTINUED = re.compile(r"(?:[,/\-\u2013]|\band)\s*$")


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout, cannot list tracked files: {e}")
    paths = {ROOT / p for p in out.decode("utf-8", "surrogateescape").split("\0") if p}
    paths |= set((ROOT / "docs").glob("*.md"))  # checked before they are first committed, too
    # A path still in the index may be gone from the working tree (a move in progress).
    return sorted(p for p in paths if p.is_file())


def _read_text(path: Path) -> str | None:
    """The file as text, or None for a binary file (a NUL byte in its first 8 KiB)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def texts() -> dict[Path, str]:
    out = {}
    for path in _tracked_files():
        text = _read_text(path)
        if text is not None:
            out[path] = text
    return out


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _headings(path: Path) -> list[str]:
    """Heading titles of a markdown file, outside fenced code blocks."""
    titles, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            titles.append(m["title"])
    return titles


def _section_ids(titles: list[str]) -> set[str]:
    return {m["id"] for t in titles if (m := HEADING_ID.match(t))}


def _citations(text: str, marker: str):
    """(line number from 1, text after the marker) for each occurrence of `marker`; the text
    runs to the end of the line, plus the next line when this one ends with a separator."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        start = 0
        while (k := line.find(marker, start)) >= 0:
            start = k + len(marker)
            window = line[start:]
            if CONTINUED.search(window) and i + 1 < len(lines):
                window += " " + lines[i + 1].lstrip(" \t#/*\"'")
            yield i + 1, window


def _shim_numbers(design_text: str) -> set[int]:
    """Numbers of the list items under the design doc's "Megatron-Core on CPU" heading."""
    numbers, inside = set(), False
    for line in design_text.splitlines():
        m = HEADING.match(line)
        if m:
            inside = "megatron-core on cpu" in m["title"].lower()
            continue
        if inside and (item := re.match(r"^(\d+)\.\s", line)):
            numbers.add(int(item[1]))
    return numbers


def _citing_files(texts: dict[Path, str]) -> dict[Path, str]:
    # This file quotes the citation patterns themselves; it cites nothing.
    return {p: t for p, t in texts.items()
            if p.suffix in CITING_SUFFIXES and p.resolve() != Path(__file__).resolve()}


def test_docs_exist():
    for path in (ALGORITHMS, DESIGN):
        assert path.is_file(), f"{_rel(path)} is missing"


def test_no_reference_outside_the_repository(texts):
    bad = []
    for path, text in texts.items():
        for n, line in enumerate(text.splitlines(), 1):
            for s in FORBIDDEN:
                if s in line:
                    bad.append(f"{_rel(path)}:{n}: {line.strip()}")
    print("\n".join(bad))
    assert not bad, f"{len(bad)} line(s) refer to a folder outside the repository:\n" + "\n".join(bad)


def test_algorithms_headings_are_numbered_and_unique():
    ids = [m["id"] for t in _headings(ALGORITHMS) if (m := HEADING_ID.match(t))]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, f"docs/algorithms.md: section numbers used twice: {duplicates}"
    for required in ("A", "B", "C", "G"):
        assert required in ids, f"docs/algorithms.md has no part {required}"


def test_algorithms_citations_resolve(texts):
    titles = _headings(ALGORITHMS)
    ids = _section_ids(titles)
    has_notation = any("notation" in t.lower() for t in titles)
    bad = []
    for path, text in _citing_files(texts).items():
        for n, window in _citations(text, "docs/algorithms.md"):
            where = f"{_rel(path)}:{n}"
            if re.match(r"\s*notation\b", window, re.I) and not has_notation:
                bad.append(f"{where}: `notation` (no Notation heading)")
            for m in ALGO_TOKEN.finditer(window):
                for sec in (m["a"], m["b"], m["part"], m["sec"]):
                    if sec is not None and sec not in ids:
                        bad.append(f"{where}: docs/algorithms.md {m[0]} ({sec} is not a heading)")
        if "docs/algorithms.md" not in text:
            continue
        # Bare numbers like "(B.4)" in a file that cites the document refer to it as well.
        for n, line in enumerate(text.splitlines(), 1):
            for m in BARE_SEC.finditer(line):
                if m[0] not in ids:
                    bad.append(f"{_rel(path)}:{n}: section {m[0]} is not a heading of "
                               "docs/algorithms.md")
    bad = sorted(set(bad))
    print("\n".join(bad))
    assert not bad, f"{len(bad)} unresolved docs/algorithms.md citation(s):\n" + "\n".join(bad)


def test_design_citations_resolve(texts):
    design = DESIGN.read_text(encoding="utf-8")
    titles = [t.lower() for t in _headings(DESIGN)]
    shims = _shim_numbers(design)
    bad = []
    for path, text in _citing_files(texts).items():
        for n, window in _citations(text, "docs/design.md"):
            where = f"{_rel(path)}:{n}"
            named = re.match(r"""\s*[,:]?\s*["\u201c]([^"\u201d]+)["\u201d]""", window)
            if named and not any(named[1].lower() in t for t in titles):
                bad.append(f'{where}: docs/design.md "{named[1]}" (no such heading)')
            for shim in re.findall(r"\bshim\s+(\d+)\b", window):
                if int(shim) not in shims:
                    bad.append(f"{where}: docs/design.md shim {shim} (not in the numbered list "
                               "under 'Megatron-Core on CPU')")
    print("\n".join(bad))
    assert not bad, f"{len(bad)} unresolved docs/design.md citation(s):\n" + "\n".join(bad)


def test_shim_list_matches_patches():
    """The numbered shims of patches.py's docstring are the numbered list of the design doc."""
    patches = (ROOT / "megatron_rl" / "patches.py").read_text(encoding="utf-8")
    listed = {int(n) for n in re.findall(r"^\s+(\d+)\.\s", patches.split('"""')[1], re.M)}
    documented = _shim_numbers(DESIGN.read_text(encoding="utf-8"))
    assert listed, "megatron_rl/patches.py: no numbered shim list in the module docstring"
    assert listed == documented, (
        f"shims numbered in megatron_rl/patches.py {sorted(listed)} != docs/design.md "
        f"'Megatron-Core on CPU' list {sorted(documented)}"
    )

