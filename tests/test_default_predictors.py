"""The default model's predictors, trained on first use: from a corpus directory beside the repository when there is one, else from the
built-in calibration text. The default model is swapped for stories260K (same code path, seconds instead of minutes)
and the cache for a temp dir; the CLI runs in-process so the swap holds, and training runs in its real child process
(`python -m predictors.first_use`), whose stderr the tests read through capfd."""
from __future__ import annotations

import importlib
import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from storage.errors import UserError

from conftest import CORPUS, STORIES

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ["-p", "Once upon a time", "-n", "16", "--temp", "0", "--json"]


@pytest.fixture
def default_is_stories(monkeypatch, tmp_path):
    """The default model is stories260K, the cache is empty and private. Returns the cache dir."""
    runtime = load_module()
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(cache))
    monkeypatch.delenv("FLASHINFER_LITE_CORPUS", raising=False)
    monkeypatch.setattr(runtime, "ensure_default_model", lambda quiet=False: STORIES)
    return cache


def load_module():
    """The module of the library's load() (flashinfer_lite.runtime), which the `generate` command calls: where the
    default model is found and first use trains its predictors."""
    return importlib.import_module("flashinfer_lite.runtime")


def run_cli(capfd, *argv) -> tuple[int, str, str]:
    from flashinfer_lite.cli import main
    rc = main(list(argv))
    out, err = capfd.readouterr()
    return rc, out, err


def flashdir_of(cache: Path) -> Path:
    (d,) = [p for p in (cache / "flash").iterdir() if p.is_dir() and not p.name.startswith(".")]
    return d


def leftovers(cache: Path) -> list[str]:
    """Temp dirs of collect / train / first use anywhere in the cache."""
    return [str(p) for p in cache.rglob(".*") if ".tmp-" in p.name or ".calibrate-" in p.name]


def predictor_manifest(flashdir: Path) -> dict:
    return json.loads((flashdir / "predictors" / "manifest.json").read_text())


def tokens_of(out: str) -> list[int]:
    return json.loads(out.strip().splitlines()[-1])["tokens"]


def test_first_use_trains_from_the_corpus_once_when_the_model_does_not_fit(default_is_stories, monkeypatch, capfd):
    from predictors import first_use
    from flashinfer_lite.predictor_set import load_predictors
    cache = default_is_stories
    monkeypatch.setenv("FLASHINFER_LITE_CORPUS", str(CORPUS))
    runtime = load_module()
    # --ffn auto on the (SiLU-gated) default model is the exact gate at every budget (issue 28): its thresholds are
    # calibrated on first use, no predictor is trained
    with monkeypatch.context() as mp:
        mp.setattr(runtime, "train_on_first_use", lambda flashdir: pytest.fail("trained predictors for the gate"))
        rc, out0, err = run_cli(capfd, "generate", *PROMPT)
    assert rc == 0, err
    assert "ffn: gate (--ffn auto, gated model (silu): the exact gate, no predictor; the default model" in err
    flashdir = flashdir_of(cache)
    assert not (flashdir / "predictors").exists() and (flashdir / "gate.json").is_file()
    # a budget below even the sparse minimum is refused in one line before any training
    with monkeypatch.context() as mp:
        mp.setattr(runtime, "train_on_first_use", lambda flashdir: pytest.fail("trained for a refused budget"))
        rc, _, err = run_cli(capfd, "generate", "--dram-budget", "1M", *PROMPT)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "is below the minimum" in err, err
    # --ffn predicted: first use trains (in the child process), then runs sparse
    rc, out, err = run_cli(capfd, "generate", "--ffn", "predicted", *PROMPT)
    assert rc == 0, err
    m = predictor_manifest(flashdir)
    cal = m["calibration"]
    assert cal["source"] == "corpus" and cal["path"] == str(CORPUS.resolve())
    assert cal["files"] == ["wikitext2_valid.txt", "tinystories_cased_197KB.txt"]   # never wikitext2_test.txt
    assert cal["tokens"] == first_use.SETTINGS.tokens and cal["trained_on_first_use"]
    assert m["sparsity"] == first_use.SETTINGS.sparsity and m["target_recall"] == first_use.SETTINGS.target_recall
    assert m["max_read_share"] == 0.9
    assert f"predictors: trained on first use from {CORPUS.resolve()} (wikitext2_valid.txt, " \
           f"tinystories_cased_197KB.txt; {cal['tokens']} tokens)" in err
    # the predictors load and predict
    ps = load_predictors(flashdir)
    assert ps.has_predictors and ps.n_layers == 5
    # only the modes that ask them load them: the exact gate's files (and process base) leave them out
    from flashinfer_lite.process import RSS_MARKS
    assert runtime.open_model_files(None, "gate").predictors is None
    assert "predictors" not in [what for what, _ in RSS_MARKS]
    assert runtime.open_model_files(None, "predicted").predictors.has_predictors
    assert "predictors" in [what for what, _ in RSS_MARKS]
    # a layer keeps its predictor only where it would read at most max_read_share of the neurons (stories260K's
    # SwiGLU predictors select about 0.98 at recall 0.99, so here every layer reads all and the threshold decides)
    cards = [json.loads((flashdir / "predictors" / f"layer_{i:03d}.json").read_text()) for i in range(5)]
    assert m["dense_layers"] == [0] + [c["layer"] for c in cards[1:] if c["pred_share"] > m["max_read_share"]]
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    for i in range(5):
        mask = ps.predict(i, x)
        assert mask.shape == (4, 172) and (mask.all() if i in m["dense_layers"] else 0 < mask.mean() < 1)
    first = json.loads(out.strip().splitlines()[-1])
    assert len(first["tokens"]) == 16 and first["flash"]["active_share"] < 0.75      # the run really was sparse
    assert not leftovers(cache)

    # second run: nothing is retrained (training would now fail), same tokens, the source is still named
    stamp = (flashdir / "predictors" / "weights.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(runtime, "run_child", lambda *a, **k: pytest.fail("trained again"))
    rc, out2, err2 = run_cli(capfd, "generate", "--ffn", "predicted", *PROMPT)
    assert rc == 0, err2
    assert "predictors: trained" not in err2
    assert (flashdir / "predictors" / "weights.safetensors").stat().st_mtime_ns == stamp
    assert tokens_of(out2) == first["tokens"]
    # --ffn auto on the same FLASHDIR, predictors or not, is still the exact gate: the first run's tokens
    monkeypatch.undo()
    rc, out4, err4 = run_cli(capfd, "generate", "-m", str(flashdir), *PROMPT)
    assert rc == 0 and "ffn: gate (--ffn auto, gated model (silu): the exact gate" in err4
    assert tokens_of(out4) == tokens_of(out0)


def test_without_a_corpus_the_builtin_text_is_used(default_is_stories, monkeypatch, capfd, tmp_path):
    from predictors import first_use
    cache = default_is_stories
    monkeypatch.setenv("FLASHINFER_LITE_CORPUS", "builtin")          # even where a corpus sits beside the repo
    rc, out, err = run_cli(capfd, "generate", "--ffn", "predicted", *PROMPT)
    assert rc == 0, err
    cal = predictor_manifest(flashdir_of(cache))["calibration"]
    assert cal["source"] == "builtin" and cal["files"] == ["calibration.txt"]
    assert 0 < cal["tokens"] <= first_use.SETTINGS.tokens
    assert f"predictors: trained on first use from the built-in calibration text ({cal['tokens']} tokens)" in err
    assert len(tokens_of(out)) == 16 and not leftovers(cache)


@pytest.mark.parametrize("where", ["training", "saving"])
def test_interrupted_first_use_leaves_no_predictors(default_is_stories, monkeypatch, capfd, where):
    """Ctrl-C while a layer trains, or between the predictor files being written: no predictors dir, no temp dirs.
    (In the training process itself, where the monkeypatches hold.)"""
    import safetensors.numpy
    from predictors import first_use, train
    cache = default_is_stories
    monkeypatch.setenv("FLASHINFER_LITE_CORPUS", str(CORPUS))
    monkeypatch.setattr(first_use, "SETTINGS", first_use.Calibration(tokens=1024, rows=1024, steps=50))  # quick
    if where == "training":
        real, calls = train.train_layer, []

        def layer_then_interrupt(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(*a, **k)
        monkeypatch.setattr(train, "train_layer", layer_then_interrupt)
    else:
        real_save = safetensors.numpy.save_file

        def save_then_interrupt(tensors, path, *a, **k):
            if ".predictors.tmp-" in str(path) and path.endswith("frequencies.safetensors"):
                assert Path(path).with_name("weights.safetensors").exists()   # really mid-write
                raise KeyboardInterrupt
            return real_save(tensors, path, *a, **k)
        monkeypatch.setattr(safetensors.numpy, "save_file", save_then_interrupt)
    from storage.cache import flashdir_for
    flashdir = Path(flashdir_for(STORIES, progress=False))
    with pytest.raises(KeyboardInterrupt):          # what the child process gets on Ctrl-C
        first_use.ensure_predictors(flashdir, progress=False)
    assert not (flashdir / "predictors").exists()
    assert not leftovers(cache)


def test_missing_torch_is_one_clear_line(default_is_stories, monkeypatch, capfd):
    runtime = load_module()
    real = runtime.find_spec
    monkeypatch.setattr(runtime, "find_spec", lambda name: None if name == "torch" else real(name))
    rc, out, err = run_cli(capfd, "generate", "--ffn", "predicted", *PROMPT)
    assert rc == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "flashinfer-lite[train]" in lines[0] and "--ffn dense" in lines[0]
    assert not (flashdir_of(default_is_stories) / "predictors").exists()


def test_auto_without_predictors_is_dense_and_plans_a_budget_for_the_gate(default_is_stories, capfd):
    """An HF directory without predictors runs dense; given a budget, this SiLU-gated one is planned for the exact
    gate (which needs no predictors: tests/test_exact_gate.py runs it), so a budget too small is refused naming the
    minimum, not asking for predictors (a ReLU model is: the same test)."""
    rc, out, err = run_cli(capfd, "generate", "-m", str(STORIES), *PROMPT)
    assert rc == 0 and f"ffn: dense (--ffn auto, {STORIES} has no trained predictors)" in err
    assert "flash" not in json.loads(out.strip().splitlines()[-1])          # the dense path: no flash runtime
    rc, out, err = run_cli(capfd, "generate", "-m", str(STORIES), "--dram-budget", "64M", *PROMPT)
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert "below the minimum" in err and "for this model (estimated" in err and "train-predictor" not in err
    # the default model with an explicit --ffn dense trains nothing
    rc, out, err = run_cli(capfd, "generate", "--ffn", "dense", *PROMPT)
    assert rc == 0 and not (default_is_stories / "flash").exists()


def test_a_corpus_variable_without_calibration_text_is_one_line(default_is_stories, monkeypatch, capfd, tmp_path):
    empty = tmp_path / "corpus"
    empty.mkdir()
    (empty / "wikitext2_test.txt").write_text("evaluation text only\n")   # the test split never calibrates
    monkeypatch.setenv("FLASHINFER_LITE_CORPUS", str(empty))
    rc, out, err = run_cli(capfd, "generate", "--ffn", "predicted", *PROMPT)
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert rc == 1 and len(errors) == 1 and "FLASHINFER_LITE_CORPUS" in errors[0] and "Traceback" not in err


def test_calibration_files_are_the_calibration_splits(tmp_path):
    from predictors.first_use import calibration_files
    for name in ("wikitext2_test.txt", "tinystories_lowercase_4MB.txt", "wikitext2_valid.txt", "README.md"):
        (tmp_path / name).write_text("x\n")
    assert [p.name for p in calibration_files(tmp_path)] == ["wikitext2_valid.txt", "tinystories_lowercase_4MB.txt"]
    (tmp_path / "tinystories_cased_197KB.txt").write_text("x\n")
    assert [p.name for p in calibration_files(tmp_path)] == ["wikitext2_valid.txt", "tinystories_cased_197KB.txt"]
    assert calibration_files(tmp_path / "absent") == []


def test_mixed_text_takes_a_share_of_each_file(tmp_path):
    """Half the tokens from WikiText, then TinyStories: both sources reach the windows collect reads."""
    from flashinfer_lite.model import open_any
    from predictors.first_use import mixed_text
    tok = open_any(STORIES).tokenizer()
    files = [CORPUS / "wikitext2_valid.txt", CORPUS / "tinystories_cased_197KB.txt"]
    text = mixed_text(files, tok, 4000)
    wiki, stories = (f.read_text(encoding="utf-8") for f in files)
    head = text[: len(text) - len(stories) - 1]
    assert wiki.startswith(head) and text.endswith(stories)
    n = len(tok.encode(head, add_special_tokens=False))
    assert 2000 <= n < 2000 + 2500        # at least the share, at most one 4 KB chunk more


def test_builtin_calibration_text_ships():
    data = (resources.files("predictors") / "calibration.txt").read_bytes()
    text = data.decode("utf-8")                                   # strict: valid UTF-8
    assert 5_000 < len(data) < 200_000 and len(text.split()) > 1000
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "calibration.txt" in cfg["tool"]["setuptools"]["package-data"]["predictors"]
