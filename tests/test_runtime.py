"""The flash runtime against the dense path: same weights, so the oracle FFN must reproduce dense logits."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import assert_same_bits_at_every_budget
from storage.errors import UserError
from flashinfer_lite.runtime import load_runtime
from storage.convert import convert


@pytest.fixture(scope="module")
def flashdirs(tiny_model, tmp_path_factory):
    """Converted tiny ReLU Llama and OPT models, in f32 and f16."""
    root = tmp_path_factory.mktemp("flash")
    out = {}
    for kind in ("llama-relu", "opt"):
        for dtype in ("f32", "f16"):
            out[kind, dtype] = convert(tiny_model(kind), root / f"{kind}-{dtype}", dtype=dtype, progress=False)
    return out


def logits_token_by_token(model, ids, ctx=64):
    kv = model.new_cache(ctx)
    return np.stack([model.forward([t], kv) for t in ids])


@pytest.mark.parametrize("kind", ["llama-relu", "opt"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_oracle_ffn_reproduces_dense_logits(flashdirs, kind, dtype):
    path = flashdirs[kind, dtype]
    dense, _, _ = load_runtime(path, "dense")
    oracle, _, rt = load_runtime(path, "oracle")
    ids = np.random.default_rng(3).integers(3, 512, size=24).tolist()
    want = logits_token_by_token(dense, ids)
    np.testing.assert_allclose(logits_token_by_token(oracle, ids), want, rtol=0, atol=2e-5)
    share = rt.stats.active_share()
    assert 0.2 < share.mean() < 0.8  # ReLU: only part of the neurons fired, so sparsity was really used
    assert rt.stats.read_bytes > 0 and rt.stats.tokens == len(ids)
    # A batched prompt takes the prefill path (streaming or cache) and must agree too.
    kv = oracle.new_cache(64)
    np.testing.assert_allclose(oracle.forward(ids, kv, all_logits=True), want, rtol=0, atol=2e-5)


def test_small_budget_still_exact_and_reads_more(flashdirs, monkeypatch):
    from flashinfer_lite import budget
    monkeypatch.setattr(budget, "MIN_WINDOW_ROWS", 16)   # the tiny model's 160 neurons would fit the default
    path = flashdirs["llama-relu", "f32"]
    dense, _, _ = load_runtime(path, "dense")
    ids = np.random.default_rng(4).integers(3, 512, size=20).tolist()
    want = logits_token_by_token(dense, ids)
    _, _, probe = load_runtime(path, "oracle")
    minimum = probe.plan.minimum_bytes
    reads = {}
    for extra in (0, 4 << 20):
        # the probe's process base, not a new measurement of this (pytest) process: the arithmetic stays exact
        model, _, rt = load_runtime(path, "oracle", dram_budget=minimum + extra, base_bytes=probe.plan.base_bytes)
        np.testing.assert_allclose(logits_token_by_token(model, ids), want, rtol=0, atol=2e-5)
        reads[extra] = rt.stats.read_bytes
        assert rt.cache.nbytes <= rt.plan.window_bytes + rt.plan.hot_bytes + rt.plan.buffer_bytes
    assert reads[0] > reads[4 << 20]  # a bigger window re-reads less


def test_thread_fallback_gives_the_same_logits_and_says_so_once(flashdirs, monkeypatch, capsys):
    """With io_uring refused (as in a seccomp'd container), the reads go through threads: the same bits, and -v says
    once which engine it uses and why."""
    import errno
    from storage import reader
    path = flashdirs["llama-relu", "f16"]
    ids = np.random.default_rng(5).integers(3, 512, size=12).tolist()
    model, _, rt = load_runtime(path, "oracle", verbose=True)
    want = logits_token_by_token(model, ids)
    ring_line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("reader: ")]
    assert len(ring_line) == 1 and (rt.reader.engine == "threads" or "io_uring" in ring_line[0])

    def refused(*args):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(reader, "setup", refused)
    model, _, rt = load_runtime(path, "oracle", verbose=True)
    assert rt.reader.engine == "threads"
    assert np.array_equal(logits_token_by_token(model, ids), want)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("reader: ")]
    assert len(lines) == 1 and "threads of preadv (io_uring unavailable: Operation not permitted)" in lines[0]


@pytest.mark.parametrize("kind", ["llama-relu", "opt"])
def test_same_logits_at_every_budget_thread_count_overlap_and_prefill(flashdirs, kind, monkeypatch):
    """Issue 14: the budget, -t, overlap and the prefill strategy change which rows are read when, never a bit of
    the output (one summation order, kernels.SparseFFN.accumulate)."""
    ids = np.random.default_rng(5).integers(3, 512, size=12).tolist()
    stats = assert_same_bits_at_every_budget(flashdirs[kind, "f16"], "oracle", ids, 8, monkeypatch)
    # at the minimum a token's set was larger than the window: computed in pieces
    assert stats["minimum"].active.max() > 16 * stats["minimum"].rows.max()


def test_budget_below_minimum_is_one_clear_error(flashdirs):
    with pytest.raises(UserError, match="below the minimum"):
        load_runtime(flashdirs["llama-relu", "f32"], "oracle", dram_budget=1 << 16)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "flashinfer_lite", *args], capture_output=True, timeout=300)


@pytest.mark.parametrize("kind", ["llama-relu", "opt"])
def test_generate_oracle_tokens_equal_dense(flashdirs, kind):
    path = str(flashdirs[kind, "f16"])
    runs = {}
    for mode in ("dense", "oracle"):
        r = cli("generate", "-m", path, "-p", "Once upon a time there was", "-n", "24", "--temp", "0", "--json",
                "--ffn", mode)
        assert r.returncode == 0, r.stderr.decode()
        runs[mode] = json.loads(r.stdout.decode().splitlines()[-1])["tokens"]
    assert runs["oracle"] == runs["dense"] and len(runs["dense"]) == 24


def test_cli_budget_too_small_and_corrupt_flashdir(flashdirs, tmp_path):
    import shutil
    path = flashdirs["llama-relu", "f16"]
    r = cli("generate", "-m", str(path), "-p", "hi", "--ffn", "oracle", "--dram-budget", "64K")
    err = r.stderr.decode().strip()
    assert r.returncode == 1 and len(err.splitlines()) == 1 and "below the minimum" in err, err
    bad = shutil.copytree(path, tmp_path / "bad")
    with open(bad / "ffn.bin", "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))
    r = cli("generate", "-m", str(bad), "-p", "hi", "--ffn", "oracle")
    err = r.stderr.decode().strip()
    assert r.returncode == 1 and "checksum" in err and "Traceback" not in err, err


def test_default_model_same_logits_at_every_budget(smollm2_gguf, tmp_path, monkeypatch):
    """The default model (SwiGLU, float16 bundles) with its calibrated thresholds, where issue 14 saw three different
    continuations: bit-identical logits at its real minimum (256-row window: a token's ~770 fired of 1536 neurons in
    pieces), above it, on 1 and 2 threads, with overlap on or off, with prefill streamed or not."""
    from predictors.collect import collect
    from predictors.first_use import builtin_text
    from predictors.train import train
    from flashinfer_lite import budget
    flash = convert(smollm2_gguf, tmp_path / "flash", dtype="f16", progress=False)
    text = tmp_path / "calibration.txt"
    text.write_text(builtin_text()[:4000])
    collect(str(flash), [text], 512, tmp_path / "acts", ctx=256, rows=512, progress=False)
    train(tmp_path / "acts", flash, sparsity=0.5, thresholds_only=True, progress=False)
    ids = [1, 504, 3458, 282, 4470, 30, 2683, 253, 2030, 28, 260, 2722]
    stats = assert_same_bits_at_every_budget(flash, "oracle", ids, 6, monkeypatch, ctx=32,
                                             pieces_rows=budget.MIN_WINDOW_ROWS)
    assert stats["minimum"].active.max() > 2 * budget.MIN_WINDOW_ROWS * stats["minimum"].rows.max()


def test_a_batched_prompt_counts_each_token_once(flashdirs):
    """Issue 16: a batched prompt through the cache reported 508 hits+misses and 4.08 MB for a true 189 and 1.60 MB.
    The same tokens one by one fetch the same neurons in the same per-layer order, so every count must match theirs,
    and hits + misses must equal the neurons the selector asked for."""
    path = flashdirs["llama-relu", "f16"]
    ids = np.random.default_rng(5).integers(3, 512, size=4).tolist()
    stats, reads = {}, {}
    for how in ("batched", "one by one"):
        model, _, rt = load_runtime(path, "oracle", base_bytes=0)
        rt.prefer_streaming = lambda layer, sets: False
        asked = []
        real = rt.active_ids
        rt.active_ids = lambda layer, x: (lambda r: asked.append(sum(map(len, r))) or r)(real(layer, x))
        kv = model.new_cache(64)
        if how == "batched":
            model.forward(ids, kv, all_logits=True)
        else:
            for t in ids:
                model.forward([t], kv)
        s = rt.stats
        assert s.hits + s.misses == sum(asked) and s.tokens == len(ids)
        stats[how] = (s.hits, s.misses, s.requested_bytes, s.tokens)
        reads[how] = s.read_bytes
    assert stats["batched"] == stats["one by one"]
    # the batched prompt reads its rows' union of misses in one coalesced read, never more than one read per token
    assert 0 < reads["batched"] <= reads["one by one"]


def test_one_blas_thread_even_when_numpy_was_imported_first(flashdirs):
    """OPENBLAS_NUM_THREADS is read when numpy loads: a script that imports numpy before flashinfer_lite used to run
    with every core's BLAS thread spinning (the FFN 14x slower). load_runtime sets one thread at run time."""
    import os
    code = ("import numpy, threadpoolctl\n"
            "blas = lambda: max(i['num_threads'] for i in threadpoolctl.threadpool_info() if i['user_api'] == 'blas')\n"
            "before = blas()\n"
            "from flashinfer_lite.runtime import load_runtime\n"
            f"load_runtime({str(flashdirs['llama-relu', 'f32'])!r}, 'dense')\n"
            "print(before, blas())")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    before, after = map(int, r.stdout.split())
    assert after == 1 and (before > 1 or os.cpu_count() == 1)
