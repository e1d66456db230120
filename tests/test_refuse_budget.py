"""A --dram-budget below what the model can ever run in is refused before any work (budget.refuse_below_minimum):
its estimate from the model's sizes is a lower bound of the planner's real minimum, and a cold first run with a
too-small budget converts, compiles and trains nothing."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import STORIES
from flashinfer_lite.budget import (HEAP_SLACK_BYTES, plan_budget, plan_resident_ffn, refuse_below_minimum,
                                    resident_bytes_for)
from storage.errors import UserError
from flashinfer_lite.runtime import STREAM_CHUNK_BYTES
from storage.convert import convert
from storage.format import FlashCheckpoint

REPO = Path(__file__).resolve().parents[1]


def planner_minimum(flashdir: Path, ctx: int) -> int:
    """The smallest budget load_runtime accepts for --ffn predicted or auto, with the runtime line left out (0): the
    sparse plan's minimum, or the in-RAM plan's when that is smaller, both as runtime.plan_dram / plan_resident
    compute them."""
    ckpt = FlashCheckpoint(flashdir)
    cfg, layout = ckpt.config, ckpt.layout
    resident = resident_bytes_for(cfg, half=layout.dtype != "f32", kinds=ckpt.resident_kinds)
    sparse = plan_budget(cfg, layout, 1 << 60, ctx, resident_bytes=resident, stream_chunk_bytes=STREAM_CHUNK_BYTES,
                         heap_slack_bytes=HEAP_SLACK_BYTES).minimum_bytes
    in_ram = plan_resident_ffn(cfg, layout, 1 << 60, ctx, resident, heap_slack_bytes=HEAP_SLACK_BYTES).minimum_bytes
    return min(sparse, in_ram)


def estimate(path, ctx: int) -> int:
    """refuse_below_minimum's minimum (runtime 0), read from the line it refuses a 1-byte budget with."""
    with pytest.raises(UserError) as e:
        refuse_below_minimum(path, 1, ctx, runtime_bytes=0)
    return round(float(re.search(r"at least ([0-9.]+) MiB", str(e.value)).group(1)) * 2**20)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model, smollm2_gguf):
    """(source the user names, its FLASHDIR) for a float16 HF model, a float32 one and a q4_1 GGUF."""
    from storage.cache import flashdir_for
    root = tmp_path_factory.mktemp("refuse")
    llama = tiny_model("llama-bias-untied")
    return [(STORIES, convert(STORIES, root / "stories", dtype="f16", progress=False)),
            (llama, convert(llama, root / "llama", dtype="f32", progress=False)),
            (smollm2_gguf, Path(flashdir_for(smollm2_gguf, progress=False)))]


@pytest.mark.parametrize("ctx", [0, 64, 512])
def test_the_estimate_is_a_lower_bound_of_the_planners_minimum(models, ctx):
    for source, flashdir in models:
        real = planner_minimum(flashdir, ctx or FlashCheckpoint(flashdir).config.default_ctx)
        for path in (source, flashdir):
            low = estimate(path, ctx)
            assert low <= real + (1 << 20), (path, ctx, low, real)     # the message rounds to 0.1 MiB
            refuse_below_minimum(path, real, ctx, runtime_bytes=0)      # what the planner accepts is never refused
            assert low >= real // 4, (path, ctx, low, real)             # and the estimate is not vacuous


@pytest.mark.parametrize("model", ["default", "hf"])
def test_a_too_small_budget_is_refused_before_any_work_on_a_cold_cache(tmp_path, smollm2_gguf, model):
    cache, numba = tmp_path / "cache", tmp_path / "numba"
    numba.mkdir()
    if model == "default":      # the GGUF only (no fetch in a test); no FLASHDIR, no predictors
        (cache / "models").mkdir(parents=True)
        os.symlink(smollm2_gguf, cache / "models" / smollm2_gguf.name)
    env = dict(os.environ, FLASHINFER_LITE_CACHE=str(cache), NUMBA_CACHE_DIR=str(numba),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["--ffn", "predicted"] + ([] if model == "default" else ["-m", str(STORIES)])
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", *args, "-c", "512", "--dram-budget", "50M",
                        "-n", "4", "-p", "Hello"], env=env, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t0
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert re.match(r"error: DRAM budget 50\.0 MiB is below the minimum for this model, at least [0-9.]+ MiB",
                    lines[0]), r.stderr
    assert not (cache / "flash").exists() or not any((cache / "flash").iterdir())    # nothing converted
    compiled = [p for p in numba.rglob("*") if p.is_file()]    # Numba makes its directories on import, no files
    assert not compiled, compiled                                                     # nothing compiled
    assert wall < 20, wall      # a guard only: conversion, compilation or training would take minutes


def test_first_use_training_says_how_long_the_layers_left_take(capsys):
    from tqdm import tqdm

    from predictors.first_use import say_time_left
    on_layer = say_time_left(n_layers=5)
    with tqdm(range(5), file=sys.stderr) as bar:
        on_layer({"layer": 0, "dense": True}, bar)              # the dense first layer trains nothing: no pace yet
        assert "layers left" not in capsys.readouterr().err
        on_layer({"layer": 1, "seconds": 30.0}, bar)            # 3 layers left at 30 s each
        on_layer({"layer": 2, "seconds": 90.0}, bar)            # said once
        assert "(~2 min)" in bar.desc
    err = capsys.readouterr().err
    assert err.count("layers left") == 1 and "30 s per layer; the 3 layers left take about 2 min" in err, err


def test_the_gguf_header_reads_what_gguf_reader_reads(smollm2_gguf, tmp_path):
    """storage.checkpoint.GGUFHeader (scalars, array lengths, the tensor table; no array read) against gguf.GGUFReader,
    the format's reference reader; a file cut anywhere in its header is refused with one UserError."""
    import gguf
    from storage.checkpoint import GGUFArray, GGUFHeader
    ref, got = gguf.GGUFReader(str(smollm2_gguf)), GGUFHeader(smollm2_gguf)
    assert {t.name: (t.tensor_type.name, tuple(int(s) for s in t.shape)) for t in ref.tensors} == got.tensors
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}     # the reader's own: version, counts
    assert set(fields) == set(got.fields)
    for key, field in fields.items():
        value = got.fields[key]
        if isinstance(value, GGUFArray):
            assert len(value) == len(field.data), key
        else:
            assert value == pytest.approx(field.contents()), key
    head = smollm2_gguf.read_bytes()[:4 << 20]          # the metadata and tensor table end before 4 MiB
    for cut in (3, 20, 1000, 500_000, len(head)):
        bad = tmp_path / "cut.gguf"
        bad.write_bytes(head[:cut])
        with pytest.raises(UserError, match="not a valid GGUF file"):
            GGUFHeader(bad)
