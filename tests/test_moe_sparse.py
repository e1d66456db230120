"""Neuron sparsity inside experts (issue 30, item 5): split expert chunks (convert --expert-chunks split: gate|up
rows, then down columns), the exact gate inside each routed expert, and only the firing neurons' down columns read.
Threshold 0 is exact: transformers' logits and tokens, and the same bits whether a miss reads the whole chunk or its
columns; a calibrated threshold reads fewer bytes at a stated perplexity cost, with the same bits at every budget,
thread count and overlap setting."""
import functools
import json
import shutil

import numba
import numpy as np
import pytest

from conftest import transformers_model
from flashinfer_lite.ffn.experts import ExpertCache
from flashinfer_lite.runtime import load_runtime
from storage.convert import convert
from storage.errors import UserError
from storage.format import FORMAT_VERSION, read_layout, verify
from test_flash_format import edit_manifest
from test_moe import PROMPT, greedy


@pytest.fixture(scope="module")
def split_dirs(tiny_model, tmp_path_factory):
    """split_dirs(kind, dtype) -> a FLASHDIR of the tiny mixture of experts `kind` with split chunks (made once)."""
    return functools.cache(lambda kind, dtype: convert(
        tiny_model(kind), tmp_path_factory.mktemp(f"split_{kind}_{dtype}") / "flash", dtype=dtype, progress=False,
        expert_chunks="split"))


def minimum(flash) -> int:
    return load_runtime(flash, "auto", dram_budget=None, base_bytes=0)[2].plan.minimum_bytes


def run(flash, ffn, budget, threads=None, overlap=True, columns=None, monkeypatch=None):
    """(logits, tokens, runtime) of greedy(PROMPT, 6); columns=True: every miss reads gate|up rows then columns."""
    if columns:
        monkeypatch.setattr(ExpertCache, "reads_columns", lambda self, layer: True)
    model, _, rt = load_runtime(flash, ffn, dram_budget=budget, base_bytes=0)
    rt.overlap = overlap
    before = numba.get_num_threads()
    numba.set_num_threads(threads or before)
    try:
        got, tokens = greedy(model, PROMPT, 6)
    finally:
        numba.set_num_threads(before)
        if columns:
            monkeypatch.undo()
    return got, tokens, rt


@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral"])
def test_threshold_zero_matches_transformers(split_dirs, tiny_model, kind, monkeypatch):
    """f32 split chunks, threshold 0: transformers' logits (1e-4) and greedy tokens, with every expert in DRAM and
    at the minimum budget reading gate|up rows and then columns; the same bits both ways."""
    import torch
    flash = split_dirs(kind, "f32")
    L = read_layout(flash)
    assert L.experts.split and json.loads((flash / "manifest.json").read_text())["version"] == FORMAT_VERSION
    got, tokens, rt = run(flash, "auto", None)
    assert rt.stats.misses == 0 and rt.thresholds == [0.0] * L.experts.n_layers
    with torch.no_grad():     # transformers' logits over our tokens: each decoded token must be their argmax
        want = transformers_model(tiny_model(kind))(torch.tensor([PROMPT + tokens])).logits[0].numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    assert want[len(PROMPT) - 1:-1].argmax(axis=1).tolist() == tokens      # transformers' greedy tokens
    cols, _, rt = run(flash, "auto", minimum(flash), columns=True, monkeypatch=monkeypatch)
    assert np.array_equal(cols, got) and rt.stats.misses > 0


@pytest.mark.parametrize("kind,dtype", [("qwen3moe", "q8_0"), ("mixtral", "q4_0")])
def test_same_bits_at_every_budget_thread_count_and_read(split_dirs, kind, dtype, monkeypatch):
    """Threshold 0 (--ffn auto) and a calibrated one (--ffn gate): the logits are the same bits with every expert in
    DRAM, at the minimum budget (experts evicted, gate|up rows and columns read again) and one slot above it, on 1
    and 2 threads, overlap on and off; at threshold 0 also with misses read as columns instead of whole chunks."""
    flash = split_dirs(kind, dtype)
    low = minimum(flash)
    per_slot = read_layout(flash).experts.n_layers * read_layout(flash).experts.chunk
    most = max(1, numba.config.NUMBA_NUM_THREADS)
    for ffn in ("auto", "gate"):
        want, _, rt = run(flash, ffn, None)
        misses = set()
        for budget in (low, low + per_slot):
            for threads in sorted({1, most}):
                for overlap in (True, False):
                    got, _, rt = run(flash, ffn, budget, threads, overlap)
                    assert np.array_equal(got, want), (ffn, budget, threads, overlap)
                    misses.add(rt.stats.misses)
        assert min(misses) > 0
        if ffn == "auto":
            got, _, _ = run(flash, ffn, low, columns=True, monkeypatch=monkeypatch)
            assert np.array_equal(got, want)


def nll(model, tokens, prompt=8) -> float:
    """Mean negative log-likelihood of tokens[1:] given the ones before (float64 softmax): a prompt of `prompt`
    tokens, then one token a step, as decode reads experts."""
    kv = model.new_cache(len(tokens))
    logits = [model.forward(tokens[:prompt], kv, all_logits=True)]
    logits += [model.forward([t], kv)[None, :] for t in tokens[prompt:-1]]
    logp = np.concatenate(logits).astype(np.float64)
    logp -= logp.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(tokens) - 1), tokens[1:]].mean())


def test_a_calibrated_threshold_reads_fewer_bytes(split_dirs, tmp_path):
    """--ffn gate (sparsity 0.4, thresholds calibrated on first use into gate.json) at the minimum budget reads
    fewer bytes than threshold 0, computes fewer neurons, and its perplexity on 64 tokens stays within 5% of the
    exact one (measured: see the note in the assertion's message)."""
    flash = shutil.copytree(split_dirs("qwen3moe", "q8_0"), tmp_path / "flash")
    tokens = np.random.default_rng(7).integers(3, 512, size=64).tolist()
    low = minimum(flash)
    exact_model, _, exact = load_runtime(flash, "auto", dram_budget=low, base_bytes=0)
    exact_nll = nll(exact_model, tokens)
    load_runtime(flash, "gate", dram_budget=None, base_bytes=0)     # calibrates: first use
    assert (flash / "gate.json").exists()
    gate_model, _, gate = load_runtime(flash, "gate", dram_budget=low, base_bytes=0)
    assert min(gate.thresholds) > 0
    gate_nll = nll(gate_model, tokens)
    per_miss = [rt.stats.read_bytes / rt.stats.misses for rt in (gate, exact)]   # routes may differ a little
    assert exact.stats.read_bytes == exact.stats.misses * read_layout(flash).experts.chunk      # whole chunks
    assert per_miss[0] < per_miss[1]
    assert gate.cache.fired < 0.8 * exact.cache.fired
    ratio = np.exp(gate_nll - exact_nll)
    assert abs(ratio - 1) < 0.05, (ratio, per_miss)


def test_whole_chunks_still_load_and_bad_inputs_are_refused(tiny_model, split_dirs, tmp_path):
    """A FLASHDIR with whole chunks runs and refuses --ffn gate in one line; a manifest of split chunks that says
    they are whole is refused; --expert-chunks split on a dense model is refused."""
    flash = convert(tiny_model("olmoe"), tmp_path / "whole", dtype="f16", progress=False)
    assert not read_layout(flash).experts.split
    load_runtime(flash, "auto", dram_budget=None, base_bytes=0)
    with pytest.raises(UserError, match="--expert-chunks split"):
        load_runtime(flash, "gate", dram_budget=None, base_bytes=0)
    bad = shutil.copytree(split_dirs("mixtral", "q4_0"), tmp_path / "bad")
    verify(bad, progress=False)
    edit_manifest(bad, lambda m: m["experts"].pop("split"))    # as a hostile file would: its checksum redone
    with pytest.raises(UserError, match="checksum mismatch"):  # the chunks' digests are bound to their geometry
        load_runtime(bad, "auto", dram_budget=None, base_bytes=0)
    with pytest.raises(UserError, match="checksum mismatch"):
        verify(bad, progress=False)
    with pytest.raises(UserError, match="dense model"):
        convert(tiny_model("llama-silu-gqa"), tmp_path / "dense", progress=False, expert_chunks="split")
    assert not (tmp_path / "dense").exists()


def test_expert_rate_reads_whole_chunks(split_dirs):
    """flash_bench.expert_rate (bench/moe_vs_llama_cpp.py's device rate) reads the FLASHDIR's own chunks: its figure
    is bytes over time of whole-chunk reads, k a call."""
    from storage.flash_bench import expert_rate
    flash = split_dirs("mixtral", "q4_0")
    r = expert_rate(flash, 0.1)
    assert r["chunk_bytes"] == read_layout(flash).experts.chunk
    for p in r["probes"]:       # reads were in flight no longer than the wall time, at most the probe's count at once
        assert 0 < p["MBps"] <= p["busy_MBps"] * 1.001
        assert 0 < p["in_flight"] <= p["chunks"] * p["calls"] + 1e-9
