"""The property of issue 25: a model file mutated at random is refused with one clear line (a UserError), or the model
computes exactly what the unmutated one does. Greedy tokens of stories260K are the oracle; mutations are random
bytes written over a file (or the file cut short), drawn by hypothesis with a fixed seed and a bounded count."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import STORIES, write_llama_gguf
from storage.errors import UserError

PROMPT = [1, 403, 407, 261, 378]           # "Once upon a time" in stories260K's vocabulary, after BOS
N_TOKENS = 6
EXAMPLES = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def tokens(path: Path, ffn: str) -> list[int]:
    from flashinfer_lite import api
    model, tok = api.load(path, ffn=ffn, dram_budget="auto")
    return [r.token for r in api.stream_generate(model, tok, PROMPT, N_TOKENS, ignore_eos=True)]


@pytest.fixture(scope="module")
def models(tmp_path_factory, monkeypatch_module):
    """Originals: stories260K's HF directory, a GGUF of it, and a FLASHDIR of it with first-use predictors."""
    from predictors.first_use import ensure_predictors
    from storage.checkpoint import open_checkpoint
    from storage.convert import convert
    root = tmp_path_factory.mktemp("mutations")
    monkeypatch_module.setenv("FLASHINFER_LITE_CORPUS", "builtin")
    monkeypatch_module.setenv("FLASHINFER_LITE_CACHE", str(root / "cache"))
    shutil.copytree(STORIES, root / "hf")
    write_llama_gguf(open_checkpoint(STORIES), root / "stories.gguf")
    flash = convert(STORIES, root / "flash", dtype="f32", progress=False)
    ensure_predictors(flash, progress=False)
    want = {ffn: tokens(flash, ffn) for ffn in ("dense", "predicted")}
    assert tokens(root / "hf", "dense") == want["dense"] == tokens(root / "stories.gguf", "dense")
    return root, want


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def header_end(path: Path) -> int:
    """Bytes of a safetensors file's length prefix and JSON header: the part whose mutation is no valid other model."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


# (what is copied, the file mutated in it, the FFN mode run, where mutations may land: None = anywhere)
TARGETS = {
    "gate_up.bin": ("flash", "gate_up.bin", "dense", None),      # a SiLU model: its FFN in the split parts
    "down.bin": ("flash", "down.bin", "dense", None),
    "resident.safetensors": ("flash", "resident.safetensors", "dense", None),
    "manifest.json": ("flash", "manifest.json", "dense", None),
    "predictors/manifest.json": ("flash", "predictors/manifest.json", "predicted", None),
    "predictors/weights.safetensors": ("flash", "predictors/weights.safetensors", "predicted", None),
    "predictors/frequencies.safetensors": ("flash", "predictors/frequencies.safetensors", "predicted", None),
    # sources carry no checksums: a weight byte changed is a valid other model, so only their headers are mutated
    "model.safetensors header": ("hf", "model.safetensors", "dense", header_end),
    "gguf counts": ("stories.gguf", "", "dense", lambda p: 24),       # magic, version, tensor and key counts
}

mutations = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=4)


@pytest.mark.parametrize("target", list(TARGETS))
@EXAMPLES
@given(edits=mutations, cut=st.one_of(st.none(), st.floats(0, 1, exclude_max=True)))
def test_a_mutated_file_is_refused_in_one_line_or_changes_nothing(models, tmp_path_factory, target, edits, cut):
    root, want = models
    what, name, ffn, span = TARGETS[target]
    work = tmp_path_factory.mktemp("mutant")
    copy = work / what
    (shutil.copytree if (root / what).is_dir() else shutil.copyfile)(root / what, copy)
    f = copy / name if name else copy
    data = bytearray(f.read_bytes())
    limit = span(f) if span else len(data)
    for where, byte in edits:
        data[int(where * limit)] = byte
    if cut is not None and span is None or target == "gguf counts" and cut is not None:
        data = data[:int(cut * len(data))]
    f.write_bytes(bytes(data))
    try:
        got = tokens(copy, ffn)
    except UserError as e:
        assert "\n" not in str(e) and str(e).strip(), repr(str(e))
        return
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert got == want[ffn], (target, edits, cut)
