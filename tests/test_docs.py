"""The documentation stays a guide and the library states facts: README.md at most 250 lines, no markdown line over
200 characters, no dates or load averages in library code, and every relative link in README.md and docs/ resolves."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
MD_MAX_CHARS = 200
LIBRARY = ("flashinfer_lite", "storage", "predictors")
# a date (2026-11-24, 2026-11) or a load average with its figure (a run diary, not a fact about the code)
DIARY = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])(?:-[0-3]\d)?\b|load averages? (?:of |was |about |~)?\d")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def tracked(pattern: str) -> list[Path]:
    """The repository's tracked files matching a git pathspec (the files a clone has)."""
    out = subprocess.run(["git", "ls-files", "-z", "--", pattern], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def long_lines(path: Path) -> list[int]:
    return [i for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if len(line) > MD_MAX_CHARS]


def diary_lines(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{i}: {m.group(0)}"
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) for m in DIARY.finditer(line)]


def broken_links(path: Path) -> list[str]:
    """Relative link targets of a markdown file that name no existing file or directory (anchors and URLs skipped)."""
    bad = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            bad.append(target)
    return bad


def test_readme_is_a_guide_of_at_most_250_lines():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; reference goes to docs/, run reports to bench/README.md"


def test_no_markdown_line_is_over_200_characters():
    files = tracked("*.md")
    assert ROOT / "README.md" in files and ROOT / "bench" / "README.md" in files
    bad = {str(p.relative_to(ROOT)): lines[:5] for p in files if (lines := long_lines(p))}
    assert not bad, f"lines over {MD_MAX_CHARS} characters: {bad}"


def test_library_code_has_no_dates_or_load_averages():
    files = [p for d in LIBRARY for p in tracked(f"{d}/*.py")] + [ROOT / "pyproject.toml"]
    assert len(files) > 30
    bad = [hit for p in files for hit in diary_lines(p)]
    assert not bad, f"say why and name the bench; the measurement goes to bench/README.md: {bad}"


def test_relative_links_of_the_readme_and_docs_resolve():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    linked = {t for p in files for t in LINK.findall(p.read_text(encoding="utf-8"))}
    assert {"docs/MODES.md", "docs/FORMAT.md", "docs/PREDICTORS.md", "bench/README.md"} <= linked
    bad = {str(p.relative_to(ROOT)): b for p in files if (b := broken_links(p))}
    assert not bad, f"links to missing files: {bad}"


@pytest.mark.parametrize("text, diary, broken", [
    ("measured 2026-11-24 on a quiet machine", ["2026-11-24"], []),
    ("directories written before 2026-11 are still read", ["2026-11"], []),
    ("fast at load average 3.5 (bench/README.md)", ["load average 3"], []),
    ("load 16 or 32 bytes of a block; 1-minute load average, at least 1", [], []),
    ("see [the format](FORMAT.md#manifest) and [llama.cpp](https://github.com/ggml-org/llama.cpp)", [], []),
    ("see [the modes](MISSING.md) and [a section](#here)", [], ["MISSING.md"]),
])
def test_the_checks_find_what_they_look_for(tmp_path, text, diary, broken):
    """The helpers above on known text: each check can fail."""
    (tmp_path / "FORMAT.md").write_text("# Format\n")
    doc = tmp_path / "doc.md"
    doc.write_text(text + "\n" + "x" * (MD_MAX_CHARS + 1) + "\n")
    assert [h.split(": ", 1)[1] for h in diary_lines(doc)] == diary
    assert broken_links(doc) == broken
    assert long_lines(doc) == [2]


# ----------------------------------------------------------------------------------------------------------------------
# docs/ARCHITECTURE.md's two walks name real functions, through a bounded number of files

WALKS = {"## Walk: one decode token's FFN": 6, "## Walk: `load()` to the first token": 8}
CELL_NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)`")


def walk_rows(text: str, heading: str) -> list[tuple[str, list[str]]]:
    """(file, names) per row of the table under `heading`: the file cell's path and the backticked names after it."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`") and cells[1].endswith(".py`"):
            rows.append((cells[1].strip("`"), CELL_NAME.findall(cells[2])))
    return rows


def resolves(module, name: str) -> bool:
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return callable(obj)


@pytest.mark.parametrize("heading", list(WALKS))
def test_architecture_walks_name_real_functions_in_few_files(heading):
    import importlib
    rows = walk_rows((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"), heading)
    assert rows, f"no table under {heading}"
    files = {f for f, _ in rows}
    assert len(files) <= WALKS[heading], f"{heading}: {len(files)} files: {sorted(files)}"
    missing = []
    for f, names in rows:
        assert (ROOT / f).is_file(), f
        module = importlib.import_module(f[:-3].replace("/", "."))
        missing += [f"{f}: {n}" for n in names if not resolves(module, n)]
        assert names, f"{f}: the walk names no function there"
    assert not missing, "the walk names what the code does not have:\n" + "\n".join(missing)


def test_the_walk_check_can_fail():
    text = "## Walk: x\n\n| stop | file | what runs |\n|---|---|---|\n| 1 | `storage/sizes.py` | `parse_size`, `gone` |\n"
    import storage.sizes
    rows = walk_rows(text, "## Walk: x")
    assert rows == [("storage/sizes.py", ["parse_size", "gone"])]
    assert resolves(storage.sizes, "parse_size") and not resolves(storage.sizes, "gone")
