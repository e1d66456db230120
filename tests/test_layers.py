"""The three packages stay in strict floors (issues 16 and 26), checked on the source and in fresh interpreters:

  storage/          model files in and out (what they say, where their bytes sit); imports nothing of the others
  flashinfer_lite/  the inference core (and the CLI); imports storage/, never predictors/ (training, torch)
  predictors/       collect, train, evaluate; imports both
"""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flashinfer_lite", "storage", "predictors")


def modules():
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            if f.stem == "__main__":      # runs the CLI when imported
                continue
            parts = f.relative_to(REPO).with_suffix("").parts
            yield ".".join(parts[:-1] if f.stem == "__init__" else parts), f


def project_imports(name: str, path: Path):
    """(imported module, line, at top level?) for every import of a project module in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] in PACKAGES and (t in dict(modules()) or t in PACKAGES):
                yield t, node.lineno, id(node) in top


def test_import_graph_follows_the_floors():
    bad = []
    for name, path in modules():
        for target, line, at_top in project_imports(name, path):
            where = f"{path.relative_to(REPO)}:{line} imports {target}"
            src, dst = name.split(".")[0], target.split(".")[0]
            if name == "flashinfer_lite" and target in ("flashinfer_lite", "flashinfer_lite.api") and not at_top:
                continue  # the package's PEP 562 __getattr__ loads the Python API on first use, never at import
            if src == "storage" and dst != "storage":
                bad.append(f"{where}: storage/ is the bottom floor: it imports nothing of flashinfer_lite/ or "
                           f"predictors/")
            elif src in ("storage", "flashinfer_lite") and dst == "predictors":
                bad.append(f"{where}: inference and storage never import training")
            elif not at_top and name != "flashinfer_lite.cli":
                bad.append(f"{where}: project imports belong at the top of the file")
    assert not bad, "\n".join(bad)


def test_ffn_and_kernels_stay_below_planning():
    """The FFN and its kernels compute; they do not plan: nothing under flashinfer_lite/ffn/ or kernels/ imports the
    DRAM plan (budget), the mode registry, the warm-up or the load pipeline (modes, warmup, runtime, api), and the kernels import nothing of ffn/."""
    bad = []
    for name, path in modules():
        if not name.startswith(("flashinfer_lite.ffn", "flashinfer_lite.kernels")):
            continue
        for target, line, _ in project_imports(name, path):
            if target.startswith(("flashinfer_lite.budget", "flashinfer_lite.runtime", "flashinfer_lite.api",
                                  "flashinfer_lite.modes", "flashinfer_lite.warmup")) or (
                    name.startswith("flashinfer_lite.kernels") and target.startswith("flashinfer_lite.ffn")):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def fresh(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("name", [n for n, _ in modules()])
def test_each_module_imports_alone(name):
    """In a fresh interpreter (no import order to hide a cycle); storage/ pulls in nothing of flashinfer_lite/ or
    predictors/; inference never loads torch."""
    loaded = fresh(f"import sys, {name}; print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
                   f"{PACKAGES!r} or m == 'torch')))").split()
    if name.startswith("storage"):
        assert not [m for m in loaded if m.split(".")[0] in ("flashinfer_lite", "predictors")]
    if not name.startswith("predictors"):
        assert "torch" not in loaded and not [m for m in loaded if m.startswith("predictors")]


def bench_imports(path: Path) -> set[tuple[str, int]]:
    """(bench module, line) for every import of a module of bench/ in the file, whether as a script imports it
    (`import harness`) or as a package module (`bench.harness`)."""
    names = {f.stem for f in (REPO / "bench").glob("*.py")}
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            mods = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        for m in mods:
            parts = m.split(".")
            if parts[0] == "bench" and len(parts) > 1 and parts[1] in names:
                out.add((parts[1], node.lineno))
            elif len(parts) == 1 and parts[0] in names:
                out.add((parts[0], node.lineno))
    return out


def test_benches_import_only_the_harness():
    """Each bench answers one question on top of bench/harness.py; none reaches into another (no import circle)."""
    bad = [f"bench/{f.name}:{line} imports {m}" for f in sorted((REPO / "bench").glob("*.py"))
           for m, line in sorted(bench_imports(f)) if m != "harness" or f.stem == "harness"]
    assert not bad, "\n".join(bad)


def test_bench_stays_small():
    """bench/ answers today's questions through one harness; closed studies leave (bench/README.md keeps their answers
    and the commit to rerun them from), so the benches stay readable next to the code they measure."""
    # 2,500 lines held the studies of the budget and the exact gate; issues 44-47 each bring one bench of their own
    # (device-rate streams, long context, the server's batching, prompt kernels), about 250 lines apiece
    lines = sum(len(f.read_text().splitlines()) for f in (REPO / "bench").glob("*.py"))
    assert lines <= 3500, f"bench/ has {lines} lines of Python (at most 3,500: close a study or fold it into another)"


# The FFN modes' names (flashinfer_lite/modes.py, the registry): literal, so that this test does not trust the module
MODE_NAMES = ("auto", "dense", "oracle", "predicted", "gate", "experts")


def mode_name_comparisons(source: str) -> list[int]:
    """Lines of Python `source` that compare a value with an FFN mode's name: `x == "gate"`, `x != "dense"`, `x in ("dense",
    ...)` (or a list or set of them), either side. "auto" counts only against a name that is ffn or mode: a
    --dram-budget (and --ffn-layout) is "auto" too."""
    def literal(node) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    def named_ffn(node) -> bool:        # ffn, args.ffn, mode: not --ffn-layout's own "auto"
        return re.search(r"(^|\.)(ffn|mode)$", ast.unparse(node)) is not None

    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, sides, sides[1:]):
            if isinstance(op, (ast.Eq, ast.NotEq)):
                pairs = [(literal(left), right), (literal(right), left)]
            elif isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                pairs = [(literal(e), left) for e in right.elts]
            else:
                continue
            if any(v in MODE_NAMES and (v != "auto" or named_ffn(other)) for v, other in pairs):
                out.append(node.lineno)
    return out


def test_only_the_mode_registry_compares_ffn_mode_names():
    """A new FFN mode is a class in flashinfer_lite/modes.py and a line in its MODES: no other library module asks
    "is this the gate?" by the mode's name (where one did, a new mode touched nine places)."""
    registry = REPO / "flashinfer_lite" / "modes.py"
    bad = [f"{f.relative_to(REPO)}:{line}" for pkg in PACKAGES for f in sorted((REPO / pkg).rglob("*.py"))
           if f != registry for line in mode_name_comparisons(f.read_text(encoding="utf-8"))]
    assert not bad, "compares an FFN mode's name outside modes.py:\n" + "\n".join(bad)
    # the check sees what it is for, and not a budget's or a layout's "auto"
    assert mode_name_comparisons('if ffn == "gate":\n    pass\nok = decision.ffn in ("dense", "oracle")\n'
                                 'a = "auto" != args.ffn') == [1, 3, 4]
    assert mode_name_comparisons('b = dram_budget == "auto" or ffn_layout != "auto" or kind == "q8_0"') == []


def test_budget_planning_imports_no_ffn_kernels_or_warm_up():
    """budget.py is arithmetic on sizes: the FFN classes, the kernels and compiling them (warmup.py) are not its
    imports; the kernels' size facts it needs come in as arguments (test_ffn_and_kernels_stay_below_planning checks
    the other direction)."""
    forbidden = ("flashinfer_lite.ffn", "flashinfer_lite.kernels", "flashinfer_lite.quant", "flashinfer_lite.warmup",
                 "flashinfer_lite.modes", "flashinfer_lite.runtime")
    path = REPO / "flashinfer_lite" / "budget.py"
    bad = [f"budget.py:{line} imports {t}" for t, line, _ in project_imports("flashinfer_lite.budget", path)
           if t.startswith(forbidden)]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bad += [f"budget.py:{n.lineno} imports numba" for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
            and any((getattr(n, "module", None) or a.name).split(".")[0] == "numba" for a in n.names)]
    assert not bad, "\n".join(bad)
