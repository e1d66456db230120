"""Issue 28: the exact-gate FFN (ffn/gate.py) over the split layout, on a tiny random SiLU llama built by transformers.

The oracle is float64 numpy on the source weights, outside the runtime: per layer act(gate.x) * (up.x), the neurons
whose |coefficient| clears the calibrated threshold, their down columns; the runtime's logits equal it within 1e-4.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_same_bits_at_every_budget, planner_minimum
from test_quant_e2e import greedy          # n greedy tokens after a batched prompt, and every step's logits
from flashinfer_lite.model import open_any
from flashinfer_lite.model import Transformer
from flashinfer_lite.runtime import load_runtime
from flashinfer_lite.ffn.gate import LayerMagnitudes
from predictors.calibrate_gate import calibrate
from storage.convert import convert
from storage.errors import UserError
from storage.format import FlashCheckpoint, read_layout, verify
from storage.gate_file import DEFAULT_SPARSITY, GATE_FILE, read_gate_file

IDS = [1, 403, 261, 324, 281, 384, 265, 427, 298, 410]


@pytest.fixture(scope="module")
def gated(tiny_model, tmp_path_factory):
    """{dtype: FLASHDIR} of the tiny SiLU llama, converted (the split layout alone, convert's default) and calibrated,
    {dtype-bundles: FLASHDIR} the same model as ffn.bin's bundles (--ffn-layout bundles), and the source path."""
    src = tiny_model("llama-bias-untied")          # SiLU, with gate/up biases (in the gate|up rows) and down's
    root = tmp_path_factory.mktemp("gate")
    out = {"source": src}
    for dtype in ("f32", "q8_0"):
        flash = convert(src, root / dtype, dtype=dtype, progress=False)
        calibrate(str(flash), n_tokens=256, progress=False)
        out[dtype] = flash
        out[f"{dtype}-bundles"] = convert(src, root / f"{dtype}-bundles", dtype=dtype, progress=False,
                                          ffn_layout="bundles")
    yield out
    shutil.rmtree(root, ignore_errors=True)


def test_calibration_quantiles_in_bounded_memory_equal_numpys():
    """Calibration holds a histogram and two bins' magnitudes, not every magnitude (the default model's would be
    189 MiB beside the model, inside the user's budget): its thresholds must still be np.quantile's on all of them, and
    the per-neuron shares above them the plain comparison's, with ties, zeros and the extreme quantiles."""
    rng = np.random.default_rng(0)
    sparsities = (0.0, 0.3, 0.4, 0.5, 0.6, 1.0)
    for trial in range(30):
        n = int(rng.integers(1, 40))
        chunks = [(np.abs(rng.standard_normal((int(rng.integers(1, 9)), n))) * rng.choice([1e-3, 1, 50]))
                  .astype(np.float32) for _ in range(int(rng.integers(1, 10)))]
        if trial % 3 == 0:
            chunks = [np.round(c, 1).astype(np.float32) for c in chunks]
        m = LayerMagnitudes(n, sparsities)
        for c in chunks:
            m.count(c)
        for c in chunks:
            m.keep(c)
        every = np.concatenate(chunks)
        for s in sparsities:
            t, freq = m.result(s)
            assert t == float(np.quantile(every, s)), (trial, s)
            assert np.array_equal(freq, (every > t).mean(axis=0)), (trial, s)


def test_calibration_runs_the_model_once_and_reads_the_second_pass_back_from_disk(gated, tmp_path, monkeypatch):
    """The first pass's magnitudes spilled to a scratch file in the FLASHDIR: the model runs over the windows once,
    not twice, and gate.json holds the bits of the two-pass calibration (no room for the file: Spill.open None), with
    no scratch file left behind."""
    from flashinfer_lite.ffn import gate as gate_mod
    from storage.gate_file import SPARSITIES
    calls = {"n": 0}
    forward = Transformer.forward

    def counted(self, *a, **k):
        calls["n"] += 1
        return forward(self, *a, **k)
    monkeypatch.setattr(Transformer, "forward", counted)
    got = {}
    for name, spill in (("spill", True), ("twice", False)):
        flash = shutil.copytree(gated["q8_0"], tmp_path / name)
        (flash / GATE_FILE).unlink()
        before = sorted(p.name for p in flash.iterdir())
        if not spill:
            monkeypatch.setattr(gate_mod.Spill, "open", classmethod(lambda cls, where, nbytes: None))
        calls["n"] = 0
        calibrate(str(flash), n_tokens=512, progress=False)
        got[name] = (calls["n"], [read_gate_file(flash, 2, 160, s) for s in SPARSITIES])
        assert sorted(p.name for p in flash.iterdir()) == sorted(before + [GATE_FILE])
    (once, spilled), (twice, recomputed) = got["spill"], got["twice"]
    assert twice == 2 * once and once >= 2
    for a, b in zip(spilled, recomputed):
        assert a.thresholds == b.thresholds and all(np.array_equal(x, y) for x, y in zip(a.freq, b.freq))


def test_split_parts_hold_the_bundles_bytes(gated):
    """gate_up.bin and down.bin are the bundles' bytes (ffn.bin's, written from the same weights with --ffn-layout
    bundles) cut by BundleGeometry, checksummed and verified; there is no ffn.bin beside them."""
    for dtype in ("f32", "q8_0"):
        L, T = read_layout(gated[dtype]), read_layout(gated[f"{dtype}-bundles"])
        assert not L.bundled and not (gated[dtype] / "ffn.bin").exists() and T.bundled and not T.parts
        assert json.loads((gated[dtype] / "manifest.json").read_text())["version"] == 5
        gu, dn = L.parts["gate_up"], L.parts["down"]
        assert gu.vectors == ("gate", "up") and dn.vectors == ("down",) and dn.stride % 512 == 0
        for i in range(L.n_layers):
            B = np.fromfile(T.ffn_path, np.uint8, count=T.region_bytes(i), offset=T.offset[i]).reshape(-1, T.stride)
            for P in (gu, dn):
                rows = np.fromfile(P.ffn_path, np.uint8, count=P.region_bytes(i), offset=P.offset[i])
                rows = rows.reshape(-1, P.stride)
                for v in P.vectors:
                    a, b = L.geometry.offset(v), P.geometry.offset(v)
                    n = L.geometry.vector_bytes(v)
                    assert np.array_equal(rows[:, b:b + n], B[:, a:a + n])
            assert np.array_equal(FlashCheckpoint(gated[dtype]).bundles(i), B)     # assembled: ffn.bin's bytes
        verify(gated[dtype], progress=False)


def test_the_bundle_modes_read_the_parts_as_they_read_ffn_bin(gated, monkeypatch):
    """--ffn oracle (bundles through the neuron cache) and dense on the split layout alone give the bits they give on
    ffn.bin (PartsReader assembles the bundles), at every budget too."""
    for ffn in ("oracle", "dense"):
        want = greedy(load_runtime(gated["q8_0-bundles"], ffn)[0], IDS, 6)
        got = greedy(load_runtime(gated["q8_0"], ffn)[0], IDS, 6)
        assert got[0] == want[0] and np.array_equal(got[1], want[1]), ffn
    stats = assert_same_bits_at_every_budget(gated["q8_0"], "oracle", IDS, 4, monkeypatch)
    assert stats["minimum"].read_bytes > 0


def test_a_flipped_byte_of_a_split_part_is_found(gated, tmp_path):
    flash = shutil.copytree(gated["q8_0"], tmp_path / "flash")
    p = flash / "down.bin"
    data = bytearray(p.read_bytes())
    data[100] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(UserError, match="down.bin: checksum mismatch in layer 0"):
        verify(flash, progress=False)


def test_an_edited_gate_file_is_refused(gated, tmp_path):
    flash = shutil.copytree(gated["f32"], tmp_path / "flash")
    m = json.loads((flash / GATE_FILE).read_text())
    m["sparsity"]["0.4"]["thresholds"][0] = 0.0
    (flash / GATE_FILE).write_text(json.dumps(m))
    with pytest.raises(UserError, match="checksum mismatch: the gate calibration is damaged"):
        read_gate_file(flash, 2, 160, DEFAULT_SPARSITY)


def test_gate_file_frequencies_round_trip_compactly_and_version_1_is_still_read(tmp_path):
    """gate.json's frequencies are uint16 shares in base64 (1.46 MB of decimal text for SmolLM2, 0.49 MB now): read
    back within half a step of 1/65535 of what was written; a version 1 file (decimal lists) reads as written; a
    layer's string of the wrong length or with a character outside base64 is refused."""
    from storage.checksums import manifest_checksum
    from storage.gate_file import write_gate_file
    rng = np.random.default_rng(1)
    freq = [rng.random(37), np.r_[0.0, 1.0, rng.random(35)]]
    write_gate_file(tmp_path, 37, {}, {0.4: ([0.5, 0.25], freq)})
    cal = read_gate_file(tmp_path, 2, 37, 0.4)
    assert cal.thresholds == (0.5, 0.25)
    for got, want in zip(cal.freq, freq):
        assert got.dtype == np.float32 and np.abs(got - want).max() <= 0.5 / 65535 + 1e-7
    assert cal.freq[1][0] == 0.0 and cal.freq[1][1] == 1.0
    m = json.loads((tmp_path / GATE_FILE).read_text())
    assert m["version"] == 2 and all(isinstance(f, str) for f in m["sparsity"]["0.4"]["freq"])

    def rewrite(edit):
        e = json.loads(json.dumps(m))
        edit(e)
        e["manifest_checksum"] = manifest_checksum(e)
        (tmp_path / GATE_FILE).write_text(json.dumps(e))

    def v1(e):
        e["version"] = 1
        e["sparsity"]["0.4"]["freq"] = [[round(float(v), 4) for v in f] for f in freq]
    rewrite(v1)
    cal = read_gate_file(tmp_path, 2, 37, 0.4)
    for got, want in zip(cal.freq, freq):
        assert np.array_equal(got, np.asarray([round(float(v), 4) for v in want], np.float32))
    for bad in (lambda e: e["sparsity"]["0.4"]["freq"].__setitem__(0, e["sparsity"]["0.4"]["freq"][0][:-4]),
                lambda e: e["sparsity"]["0.4"]["freq"].__setitem__(1, "!" + e["sparsity"]["0.4"]["freq"][1][1:])):
        rewrite(bad)
        with pytest.raises(UserError, match="thresholds or frequencies of sparsity 0.4 are malformed"):
            read_gate_file(tmp_path, 2, 37, 0.4)


def float64_gated_model(source, flash, thresholds, masks=None):
    """The float64 model on `source`'s weights whose FFN is numpy float64 math over the neurons that clear the
    threshold: computed outside the runtime (its Transformer only for attention and norms, in float64)."""
    ck = open_any(source)
    W = {n: ck.tensor(n).astype(np.float64) for n in ck.names()}

    def ffn(layer: int, x: np.ndarray) -> np.ndarray:
        p = f"layers.{layer}.ffn."
        g = x @ W[p + "gate.weight"].T + W.get(p + "gate.bias", 0.0)
        a = g / (1 + np.exp(-g)) if ck.config.act == "silu" else \
            0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))      # gelu_tanh (GeGLU)
        c = a * (x @ W[p + "up.weight"].T + W.get(p + "up.bias", 0.0))
        keep = np.abs(c) > thresholds[layer]
        if masks is not None:
            masks.append((layer, np.abs(c), keep))
        return np.where(keep, c, 0.0) @ W[p + "down.weight"].T + W.get(p + "down.bias", 0.0)
    return Transformer(ck.config, {n: w for n, w in W.items() if ".ffn." not in n or "norm" in n}, ffn=ffn)


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_runtime_logits_equal_float64_math_on_the_neurons_that_cleared_the_threshold(gated, dtype,
                                                                                    float32_activations):
    """Issue 28's oracle. f32: the HF checkpoint's weights; q8_0: the FLASHDIR's dequantized ones (the blocks are
    the model; float32 activations, which that math assumes). Bounded budget, so gate|up rows of a layer are streamed
    and the down rows come from flash."""
    source = gated["source"] if dtype == "f32" else gated[dtype]
    cal = read_gate_file(gated[dtype], 2, 160, DEFAULT_SPARSITY)
    probe = load_runtime(gated[dtype], "gate", ctx=64, base_bytes=0)[2].plan
    budget = probe.minimum_bytes - 1          # the gate|up rows do not all fit: each layer streams them
    model, _, rt = load_runtime(gated[dtype], "gate", ctx=64, base_bytes=0, dram_budget=budget)
    assert rt.selector.resident_layers == 0
    tokens, got = greedy(model, IDS, 12)
    masks = []
    want_tokens, want = greedy(float64_gated_model(source, gated[dtype], cal.thresholds, masks), IDS, 12)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()
    assert tokens == want_tokens
    assert rt.stats.read_bytes > 0
    kept = np.mean([k.mean() for _, _, k in masks])
    assert 0.4 < kept < 0.8           # the threshold really drops neurons (calibrated for 40%)
    # and the dropped neurons matter: the dense model differs
    dense = float64_gated_model(source, gated[dtype], [-1.0, -1.0])
    assert np.abs(greedy(dense, IDS, 12)[1] - want).max() > 1e-2 * np.abs(want).max()


def test_a_gelu_gated_model_runs_the_exact_gate(tiny_model, tmp_path, float32_activations):
    """Gemma 3 (GeGLU: tanh GELU on the gate): --ffn auto runs the exact gate, the float64 math on the HF weights
    over the neurons that clear the calibrated thresholds, at a budget that streams gate|up rows."""
    src = tiny_model("gemma3")
    flash = convert(src, tmp_path / "f32", dtype="f32", progress=False)
    calibrate(str(flash), n_tokens=256, progress=False)
    L = read_layout(flash)
    cal = read_gate_file(flash, L.n_layers, L.n_neurons[0], DEFAULT_SPARSITY)
    budget = load_runtime(flash, "gate", ctx=64, base_bytes=0)[2].plan.minimum_bytes - 1    # as the SiLU test's
    model, _, rt = load_runtime(flash, "auto", ctx=64, base_bytes=0, dram_budget=budget)
    assert type(rt.selector).__name__ == "ExactGate" and rt.selector.resident_layers < L.n_layers   # some stream
    tokens, got = greedy(model, IDS, 12)
    masks = []
    want_tokens, want = greedy(float64_gated_model(src, flash, cal.thresholds, masks), IDS, 12)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()
    assert tokens == want_tokens
    assert 0.4 < np.mean([k.mean() for _, _, k in masks]) < 0.8      # calibrated for 40% dropped


def test_same_bits_at_every_budget_thread_count_and_prefill(gated, monkeypatch):
    stats = assert_same_bits_at_every_budget(gated["q8_0"], "gate", IDS, 10, monkeypatch)
    assert stats["no budget"].active.sum() < 0.8 * stats["no budget"].rows.sum() * 160


def test_default_ffn_gives_the_same_tokens_with_no_budget_and_at_three_budgets(gated):
    """--ffn auto on a gated model with the split layout is the exact gate at every budget: from the minimum (gate|up
    rows streamed) to the whole model in DRAM, the same greedy tokens (and logits) as with no budget."""
    model, _, rt = load_runtime(gated["q8_0"], "auto", ctx=64, base_bytes=0)
    assert rt is not None and rt.plan.gate_layers == 2
    want = greedy(model, IDS, 16)
    p = rt.plan
    lowest = p.floor_bytes                  # streams every layer's gate|up rows
    for budget in (lowest, p.minimum_bytes, p.used_bytes):
        model, _, rt = load_runtime(gated["q8_0"], "auto", ctx=64, base_bytes=0, dram_budget=budget)
        got = greedy(model, IDS, 16)
        assert got[0] == want[0] and np.array_equal(got[1], want[1]), budget
        assert rt.plan.gate_layers == (0 if budget == lowest else 2)


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_streams_with_chunks_in_flight_give_the_resident_bits(gated, dtype, monkeypatch):
    """Every layer's gate|up rows and down rows read as streams of 3-row chunks, 3 chunks in flight and each stream's
    next layer primed while the current one is computed (storage.reader.RowStream): the prompt's and each decoded
    token's logits are the bits of the run with every row in DRAM and no stream."""
    from storage import profile
    from storage.profile import StreamSettings
    stride = {n: p.stride for n, p in read_layout(gated[dtype]).parts.items()}
    # 3 rows a chunk (at least 3: the smaller stride's chunk bytes hold 3 of the larger's rows or more)
    monkeypatch.setattr(profile, "stream_defaults", lambda path: StreamSettings(3 * max(stride.values()), 3, "test"))
    model, _, rt = load_runtime(gated[dtype], "auto", ctx=64, base_bytes=0)
    assert rt.plan.gate_layers == 2
    want = greedy(model, IDS, 8)
    assert rt.stats.read_bytes == rt.stats.prefill_bytes_read == 0
    model, _, rt = load_runtime(gated[dtype], "auto", ctx=64, base_bytes=0, dram_budget=rt.plan.floor_bytes)
    assert rt.plan.gate_layers == 0 and rt.stream.depth == 3 and rt.selector.gate_up_stream.depth == 3
    rt.stream_decode = lambda layer, ids: True                 # every decoded token's down rows read whole too
    rt.prefer_streaming = lambda layer, sets: True
    chunks, primes = [], []
    for s in (rt.stream, rt.selector.gate_up_stream):
        s.chunks = (lambda f: lambda layer: (chunks.append(layer), (yield from f(layer))))(s.chunks)
        s.prime = (lambda f: lambda layer: (primes.append(layer), f(layer)))(s.prime)
    got = greedy(model, IDS, 8)
    assert got[0] == want[0] and np.array_equal(got[1], want[1])
    n = read_layout(gated[dtype]).parts["down"].n_neurons[0]
    assert rt.stream.rows >= 3 and n > 2 * rt.stream.rows * rt.stream.depth    # a layer is several rounds of chunks
    assert len(chunks) == 2 * 2 * 9 and len(primes) >= 2 * 2 * 8                # 2 streams x 2 layers x 9 passes
    assert rt.stats.read_bytes > 0 and rt.stats.prefill_bytes_read > 0


def test_dense_stays_exact_dense(gated, float32_activations):
    """--ffn dense is the dense model, not the thresholded one (float32 activations: the float64 oracle's)."""
    model = load_runtime(gated["q8_0"], "dense", ctx=64)[0]
    src = float64_gated_model(gated["q8_0"], gated["q8_0"], [-1.0, -1.0])
    got, want = greedy(model, IDS, 8)[1], greedy(src, IDS, 8)[1]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_first_use_calibrates_inside_the_budget(gated, tmp_path):
    """Issue 24: a FLASHDIR's first exact-gate run calibrates its thresholds in its own process, planned under the
    run's --dram-budget (a child beside it held a second runtime: a cold run under a cgroup equal to the budget was
    killed). Under such a cap where the machine allows it: exit 0, no OOM kill, the run's peak within the budget,
    and the thresholds and tokens of a calibration with no budget at all."""
    tools = Path(__file__).resolve().parents[1] / "tools"
    sys.path.insert(0, str(tools))
    from memcap import available
    fresh, free = (Path(shutil.copytree(gated["q8_0"], tmp_path / name)) for name in ("fresh", "free"))
    for d in (fresh, free):
        (d / GATE_FILE).unlink()
    calibrate(str(free), progress=False)            # the default tokens, no budget

    def generate(path, budget, cap=None):
        argv = [sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(path), "-p", "Once upon a time",
                "-n", "6", "--temp", "0", "--json", "-c", "64", "--ignore-chat-template", "--dram-budget", budget]
        if cap:
            argv = [sys.executable, str(tools / "memcap.py"), "--limit", str(cap), "--json", str(tmp_path / "cap.json"),
                    "--", *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=300)

    minimum = planner_minimum(lambda b: (lambda r: (r.returncode, r.stderr))(generate(free, b)))[0]
    budget = int((minimum + 8) * 2**20)
    want = generate(free, str(budget))
    assert want.returncode == 0, want.stderr
    capped = available() is None
    got = generate(fresh, str(budget), cap=budget if capped else None)
    assert got.returncode == 0, got.stderr[-3000:]
    if capped:
        assert json.loads((tmp_path / "cap.json").read_text())["oom_kills"] == 0
    run = json.loads(got.stdout.strip().splitlines()[-1])
    assert run["peak_rss_mb"] * 2**20 <= budget, (run["peak_rss_mb"], budget / 2**20)
    assert run["tokens"] == json.loads(want.stdout.strip().splitlines()[-1])["tokens"]
    sparsity = json.loads((fresh / GATE_FILE).read_text())["sparsity"]
    assert sparsity == json.loads((free / GATE_FILE).read_text())["sparsity"]


def test_eval_of_the_gate_runs_at_the_budget_generate_runs_at(gated, tmp_path):
    """`eval --ffn gate --dram-budget B` plans the mode's model as generate plans it: the dense reference before it
    runs in a child process, whose compiled kernels and freed arrays leave with it. Before, they stayed in eval's
    process and were counted in the model's process base: on SmolLM2's Q4_K_M eval's minimum was 385 MiB where
    generate's is 276. At generate's minimum + 8 MiB eval must exit 0, with the dense reference's numbers:
    the dense perplexity of the in-process reference."""
    from predictors.evaluate import evaluate
    flash = gated["q8_0"]
    text = tmp_path / "corpus.txt"
    text.write_text("Once upon a time there was a little girl who lived in a village near the forest. " * 40)

    def run(cmd, budget):
        argv = [sys.executable, "-m", "flashinfer_lite", *cmd, "-m", str(flash), "--ffn", "gate", "--dram-budget",
                budget]
        argv += ["--corpus", str(text), "--tokens", "96", "--ctx", "48", "--json"] if cmd == ["eval"] else \
            ["-p", "Once upon a time", "-n", "2", "-c", "48", "--ignore-chat-template"]
        return subprocess.run(argv, capture_output=True, text=True, timeout=300)

    minimum = planner_minimum(lambda b: (lambda r: (r.returncode, r.stderr))(run(["generate"], b)))[0]
    got = run(["eval"], f"{minimum + 8:.1f}M")
    assert got.returncode == 0, got.stderr[-2000:]
    res = json.loads(got.stdout.strip().splitlines()[-1])
    want = evaluate(flash, [text], "dense", n_tokens=96, ctx=48, progress=False)
    assert res["tokens"] == want["tokens"] and res["dense_perplexity"] == pytest.approx(want["perplexity"], rel=1e-9)
    assert 0.4 < res["active_share"] < 0.8 and res["top1_agreement"] > 0.5


def test_a_gated_source_given_a_budget_is_converted_on_first_use_and_runs_the_gate(tiny_model, tmp_path):
    """--ffn auto on an HF directory (or GGUF) of a SiLU-gated model with a --dram-budget: converted into the cache on
    first use and run by the exact gate, which needs no predictors (before: refused, asking for predictors), with
    the tokens of --ffn gate without a budget; without a budget it runs dense from the source, converting nothing. A
    ReLU model given a budget is still told to train predictors."""
    src = tiny_model("llama-bias-untied")
    env = dict(os.environ, FLASHINFER_LITE_CACHE=str(tmp_path / "cache"))

    def generate(model, *flags):
        return subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(model), "-p",
                               "Once upon a time", "-n", "6", "--temp", "0", "--json", "-c", "64",
                               "--ignore-chat-template", *flags], capture_output=True, text=True, timeout=300, env=env)
    dense = generate(src)
    assert dense.returncode == 0 and "ffn: dense" in dense.stderr, dense.stderr[-2000:]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("manifest.json"))
    minimum = planner_minimum(lambda b: (lambda r: (r.returncode, r.stderr))(generate(src, "--dram-budget", b)))[0]
    got = generate(src, "--dram-budget", f"{minimum + 8:.1f}M")
    assert got.returncode == 0, got.stderr[-2000:]
    assert "ffn: gate (--ffn auto" in got.stderr
    flash = [p.parent for p in (tmp_path / "cache").rglob("manifest.json")]
    assert len(flash) == 1 and (flash[0] / GATE_FILE).is_file()
    want = generate(flash[0], "--ffn", "gate")
    assert want.returncode == 0, want.stderr[-2000:]
    run = json.loads(got.stdout.strip().splitlines()[-1])
    assert run["tokens"] == json.loads(want.stdout.strip().splitlines()[-1])["tokens"]
    assert run["peak_rss_mb"] <= minimum + 8
    relu = generate(tiny_model("llama-relu"), "--dram-budget", "2G")
    assert relu.returncode == 1 and "no predictors" in relu.stderr.strip().splitlines()[-1]
