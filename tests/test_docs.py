"""The documentation stays a guide and the library states facts: README.md at most 250 lines, no markdown line over
200 characters, no dates or load averages in library code, and every relative link in README.md and docs/ resolves."""
from __future__ import annotations

import dis
import importlib
import inspect
import re
import subprocess
import sys
import types
from dataclasses import dataclass, field
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
# docs/ARCHITECTURE.md's two walks name real functions, and the project code those functions reach lies in the walk's
# files: what a stop calls is followed, so a helper in another module counts as the file it is

PROJECT = ("flashinfer_lite", "storage")


@dataclass
class Walk:
    most: int                                           # files of the walk at most
    skip: dict = field(default_factory=dict)            # function (qualified name) -> why the walk does not go there
    outside: dict = field(default_factory=dict)         # module or package reached -> why it is not a walk file


WALKS = {
    "## Walk: one decode token's FFN": Walk(6, skip={
        "FlashFFN.selected": "the predicted selector's path: another mode than the walk's (docs/MODES.md)",
    }, outside={
        "storage.errors": "UserError is only raised: a failure ends the walk with one line",
        "flashinfer_lite.threads": "numba_threads: the thread count the down sum's tasks are sized by, a setting read",
    }),
    "## Walk: `load()` to the first token": Walk(8, skip={
        "prepare_files": "a model's first use: the default model's fetch and sha256 check, the conversion into the "
                         "cache (a warm load finds both done: runtime.located)",
        "default_model_facts": "the default model's facts before its first use fetches it (its recorded header)",
        "convert_in_child": "a model's first use: its conversion into the cache",
        "first_use_line": "a model's first use: the line announcing its conversion",
        **dict.fromkeys(["layout_for", "resident_names", "resident_kinds"],
                        "model_facts of a source not converted yet (its layout as conversion will make it)"),
        "calibration_next": "a model's first use: the line announcing conversion and calibration",
        "calibrate_on_first_use": "a FLASHDIR's first exact-gate run: its thresholds calibrated, once",
        "train_on_first_use": "the default model's predictors, trained on first use for --ffn predicted",
        "load_predictors": "a FLASHDIR's predictors, loaded when a mode --ffn may run asks them (the exact gate never)",
        "load_expert_freq": "a mixture of experts' routing counts",
    }, outside={
        **dict.fromkeys(["flashinfer_lite.ffn", "flashinfer_lite.kernels", "flashinfer_lite.kv_pages",
                         "flashinfer_lite.flash_matrix", "flashinfer_lite.neuron_cache", "flashinfer_lite.pruning",
                         "storage.reader", "storage._watch"],
                        "the forward pass's own code: the walk above follows its FFN; attention, the KV cache and "
                        "the kernels are the math of model.py's stop"),
        **dict.fromkeys(["storage.config", "storage.checkpoint", "storage.untrusted", "storage.checksums",
                         "storage.blocks", "storage.columns", "storage.experts", "storage.half", "storage.sizes",
                         "storage.predictor_files", "storage.files", "storage.profile"],
                        "storage's readers beneath the walk's stops: model files and the device profile, parsed and "
                        "checked"),
        **dict.fromkeys(["storage.tokenizer", "storage.gate_file"],
                        "storage's readers beneath the walk's stops: tokenizer.json (through format.py's "
                        "FlashCheckpoint.tokenizer) and gate.json, parsed and checked"),
        "flashinfer_lite.default_model": "default_model_path: where the default model's file is kept; its fetch and "
                                         "sha256 check are a first use's (runtime.prepare_files)",
        "flashinfer_lite.process": "the RSS probes (/proc) warmup.py's stop measures the process base with",
        "flashinfer_lite.threads": "Numba's thread count: a setting applied, as in the walk above",
        "storage.errors": "UserError is only raised: a failure ends the walk with one line",
    }),
}
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


def lookup(module, name: str):
    """module's object at the dotted name, or None."""
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj


def resolves(module, name: str) -> bool:
    return callable(lookup(module, name))


def in_project(module_name) -> bool:
    return isinstance(module_name, str) and module_name.split(".")[0] in PROJECT


def code_objects(code: types.CodeType):
    """code and the code nested in it (comprehensions, lambdas, inner functions)."""
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from code_objects(c)


def self_attributes(code: types.CodeType) -> set[str]:
    """The names a method's code reads or calls as self.NAME (self: its first argument)."""
    if not code.co_argcount:
        return set()
    me, names, prev = code.co_varnames[0], set(), None
    for ins in dis.get_instructions(code):
        if prev is not None and prev.opname.startswith("LOAD_FAST") and prev.argval == me \
                and ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            names.add(ins.argval)
        prev = ins
    return names


def owner(func: types.FunctionType):
    """The class func is a method of (by its qualified name), or None."""
    parts = func.__qualname__.split(".<locals>")[0].split(".")
    obj = sys.modules.get(func.__module__)
    for part in parts[:-1]:
        obj = getattr(obj, part, None)
    return obj if len(parts) > 1 and isinstance(obj, type) else None


def reached(roots, skip=()) -> dict[str, set[str]]:
    """{module: qualified names} of the project code `roots` reach: the globals each function's code names (a Numba
    dispatcher through its py_func, an intrinsic through its definition, a class through __init__, a module through
    the attributes the code reads of it) and the methods it reads as self.NAME, recursively; the functions named in
    `skip` are not followed."""
    seen, out, todo = set(), {}, list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, property):
            todo += [f for f in (obj.fget, obj.fset) if f is not None]
            continue
        if isinstance(obj, types.ModuleType):
            if in_project(obj.__name__):
                out.setdefault(obj.__name__, set())
            continue
        if isinstance(obj, type):
            if in_project(obj.__module__):
                out.setdefault(obj.__module__, set()).add(obj.__qualname__)
                todo += [vars(obj)[m] for m in ("__init__", "__post_init__") if m in vars(obj)]
            continue
        func = getattr(obj, "py_func", None) or getattr(obj, "_defn", None) or obj   # Numba dispatcher, intrinsic
        func = getattr(func, "__func__", func)                                  # a bound or class method
        if not isinstance(func, types.FunctionType) or not in_project(func.__module__) or func.__qualname__ in skip:
            continue
        out.setdefault(func.__module__, set()).add(func.__qualname__)
        g, cls = func.__globals__, owner(func)
        for code in code_objects(func.__code__):
            for name in code.co_names:
                if name in g:
                    todo.append(g[name])
                    if isinstance(g[name], types.ModuleType) and in_project(g[name].__name__):
                        todo += [getattr(g[name], a) for a in code.co_names if hasattr(g[name], a)]
        if cls is not None:
            todo += [inspect.getattr_static(cls, a) for a in self_attributes(func.__code__) if hasattr(cls, a)]
        for cell in func.__closure__ or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:          # a cell not yet filled
                pass
    return out


@pytest.mark.parametrize("heading", list(WALKS))
def test_architecture_walks_name_real_functions_and_stay_in_their_files(heading):
    walk = WALKS[heading]
    rows = walk_rows((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"), heading)
    assert rows, f"no table under {heading}"
    files = {f for f, _ in rows}
    assert len(files) <= walk.most, f"{heading}: {len(files)} files: {sorted(files)}"
    missing, roots = [], []
    for f, names in rows:
        assert (ROOT / f).is_file(), f
        assert names, f"{f}: the walk names no function there"
        module = importlib.import_module(f[:-3].replace("/", "."))
        missing += [f"{f}: {n}" for n in names if not resolves(module, n)]
        roots += [lookup(module, n) for n in names if resolves(module, n)]
    assert not missing, "the walk names what the code does not have:\n" + "\n".join(missing)
    modules = {f[:-3].replace("/", ".") for f in files}
    beyond = {m: sorted(q)[:6] for m, q in reached(roots, walk.skip).items()
              if m not in modules and not any(m == o or m.startswith(o + ".") for o in walk.outside)}
    assert not beyond, f"{heading}: its functions reach project code outside its {len(files)} files: {beyond}"


def test_the_walk_check_can_fail():
    text = "## Walk: x\n\n| stop | file | what runs |\n|---|---|---|\n| 1 | `storage/sizes.py` | `parse_size`, `gone` |\n"
    import storage.sizes
    rows = walk_rows(text, "## Walk: x")
    assert rows == [("storage/sizes.py", ["parse_size", "gone"])]
    assert resolves(storage.sizes, "parse_size") and not resolves(storage.sizes, "gone")


def test_reached_follows_kernels_methods_and_skips():
    """What the walk check follows: a Numba kernel's Python code to the kernels it inlines, a method to the methods it
    calls on self and on to a class it makes; what it is told to skip stays out."""
    from flashinfer_lite.ffn.flash import FlashFFN
    from flashinfer_lite.kernels.neurons import quant_gate_coefficients
    kernel = reached([quant_gate_coefficients])
    assert {"flashinfer_lite.kernels.neurons", "flashinfer_lite.kernels.blocks"} <= set(kernel)
    assert "coefficient" in kernel["flashinfer_lite.kernels.neurons"]              # the gating rule, inlined
    gated = reached([FlashFFN.gated])
    assert {"FlashFFN._dropped", "FlashFFN.stream_down"} <= gated["flashinfer_lite.ffn.flash"]
    assert "FlashStats" in gated["storage.reader"]                                  # _dropped makes a FlashStats()
    assert "FlashStats" not in reached([FlashFFN.gated], skip={"FlashFFN._dropped"}).get("storage.reader", set())
