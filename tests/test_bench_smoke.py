"""Smoke test of bench/e2e.py --quick (the tiny model as f16 and q4_0 FLASHDIRs): the JSON is well-formed and modes
that compute the same tokens agree.

No timing is asserted. The oracle for agreement is the dense-ram mode of the same FLASHDIR (all weights in DRAM):
dense-mmap and layer-stream run the same kernel on the same bytes, so their argmax tokens must be identical;
flash-oracle runs the sparse kernel on exactly the neurons the dense run found active (FATReLU), so its tokens must
match as well.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import run_bench

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))


def _cap_unavailable() -> str | None:
    import memcap
    return memcap.available()


@pytest.fixture(scope="module")
def quick_doc():
    why = _cap_unavailable()
    if why:
        pytest.skip(f"memory cgroup unavailable: {why}")
    return run_bench("e2e.py", "--quick", "--quick-dtypes", "f16,q4_0")


def test_json_is_well_formed(quick_doc):
    doc, _ = quick_doc
    for key in ("models", "cap_bytes", "machine", "results", "command"):
        assert key in doc
    assert [m["tag"] for m in doc["models"]] == ["f16", "q4_0"]
    for m in doc["models"]:
        assert m["model_bytes"] > m["ffn_bytes"] > 0
        modes = {r["mode"] for r in doc["results"] if r["model"] == m["tag"]}
        assert {"dense-ram", "dense-mmap", "layer-stream", "flash-oracle-75", "flash-trace-75"} <= modes
    # the overlap / lookahead variants run on the first FLASHDIR only (--quick)
    assert {r["model"] for r in doc["results"] if r["mode"].endswith(("-serial", "-lookahead"))} == {"f16"}
    for r in doc["results"]:
        assert "error" not in r, r
        if "below_minimum" in r:
            continue
        assert r["tokens"] > 0 and len(r["argmax"]) == r["tokens"]
        assert r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] and r["tokens_per_s"] > 0
        assert r["memcap"]["oom_kills"] == 0 and r["memcap"]["exit_code"] == 0
        if r["hit_rate"] is not None:
            assert 0.0 <= r["hit_rate"] <= 1.0
        assert r["floor_ms"] == pytest.approx(r["floor_flash_ms"] + r["floor_dram_ms"], abs=0.11)


def test_modes_computing_the_same_tokens_agree(quick_doc):
    doc, _ = quick_doc
    for tag in ("f16", "q4_0"):
        modes = {r["mode"]: r for r in doc["results"] if r["model"] == tag}
        ref = modes["dense-ram"]["argmax"]
        for name in ("dense-mmap", "layer-stream", "flash-oracle-75"):
            got = modes[name]["argmax"]
            assert got == ref[:len(got)], (tag, name)
            assert modes[name]["ids"] == modes["dense-ram"]["ids"][:len(got)]


def test_layer_stream_reads_every_ffn_byte_per_token(quick_doc):
    doc, _ = quick_doc
    for m in doc["models"]:
        r = next(r for r in doc["results"] if r["model"] == m["tag"] and r["mode"] == "layer-stream")
        # the quick model's directory is removed after the run; its geometry travels in the JSON
        per_token = m["config"]["n_layers"] * m["config"]["ffn_dim"] * m["stride"]
        assert r["reader_MB_per_token"] == pytest.approx(per_token / 1e6, abs=0.01)


def test_markdown_table_lists_every_mode(quick_doc):
    doc, err = quick_doc
    for r in doc["results"]:
        assert f"| {r['mode']} |" in err


# ----------------------------------------------------------------------------------------------------------------------
# bench/lookahead.py --quick: stories260K with predictors trained on the fly. The oracle is transformers on the same
# tokens: FFN inputs, residuals and activations from hooks, the stored predictors and the saved lookahead applied to
# them, and the 5-token window replayed with Python sets.

@pytest.fixture(scope="module")
def lookahead(tmp_path_factory):
    work = tmp_path_factory.mktemp("lookahead")
    doc, err = run_bench("lookahead.py", "--quick", "--keep", work / "w", "--save-lookahead",
                         work / "lookahead.safetensors")
    return doc, err, work, _hf_rows(doc)


def _hf_rows(doc):
    """Per layer, from transformers on the bench's eval tokens: FFN input x [T, d], |a| [T, n], and the residual
    after attention h [T, d] normed with the NEXT layer's ffn norm (what the naive lookahead of that layer sees)."""
    import torch
    from conftest import transformers_model
    from predictors.acts import read_corpus
    from predictors.collect import token_segments
    from storage.format import FlashCheckpoint
    ck = FlashCheckpoint(doc["model"])
    m = transformers_model(REPO / "tests" / "data" / "stories260K")
    layers = m.model.layers
    xs, hs = [[] for _ in layers], [[] for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.mlp.register_forward_pre_hook(lambda mod, args, i=i: xs[i].append(args[0][0])))
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda mod, args, i=i: hs[i].append(args[0][0])))
    text = read_corpus(doc["eval"]["corpus"]).text
    with torch.no_grad():
        for w in token_segments(ck.tokenizer(), text, doc["eval"]["tokens"], doc["eval"]["ctx"], ck.config.bos_id):
            m(torch.tensor([w]))
        for hk in hooks:
            hk.remove()
        x, h = [torch.cat(v) for v in xs], [torch.cat(v) for v in hs]
        absa = [(layer.mlp.act_fn(layer.mlp.gate_proj(xi)) * layer.mlp.up_proj(xi)).abs().numpy()
                for layer, xi in zip(layers, x)]
        h_next = [layers[i + 1].post_attention_layernorm(h[i]).numpy() for i in range(len(layers) - 1)]
    return {"x": [xi.numpy() for xi in x], "absa": absa, "h_next": h_next}


def _recall_precision(mask, y):
    tp = (mask & y).sum()
    return tp / y.sum(), tp / mask.sum()


def test_lookahead_recalls_match_transformers(lookahead):
    from flashinfer_lite.predictor_set import load_predictors
    from safetensors.numpy import load_file
    doc, _, work, hf = lookahead
    preds = load_predictors(doc["model"])
    la = load_file(str(work / "lookahead.safetensors"))
    assert [r["layer"] for r in doc["layers"]] == list(range(1, doc["config"]["n_layers"]))
    assert doc["eval"]["tokens"] == len(hf["x"][0])
    for r in doc["layers"]:
        j = r["layer"]
        y = hf["absa"][j] > preds.act_threshold(j)
        W1, W2, b = (la[f"layers.{j}.{k}"].astype(np.float32) for k in ("w_in", "w_out", "bias"))
        masks = {"same": preds.predict(j, hf["x"][j]),
                 "naive": preds.predict(j, hf["h_next"][j - 1]),
                 "trained": (hf["x"][j - 1] @ W1.T) @ W2.T + b > 0}
        for kind, mask in masks.items():
            rec, prec = _recall_precision(mask, y)
            # |a| passes through float16 in the bench's ACTS: a few borderline neurons may flip
            assert r[kind]["recall"] == pytest.approx(rec, abs=2e-3), (j, kind)
            assert r[kind]["precision"] == pytest.approx(prec, abs=2e-3), (j, kind)
            assert r[kind]["pred_share"] == pytest.approx(mask.mean(), abs=1e-3), (j, kind)
        assert 0.5 < r["same"]["recall"] < 1.0 and r["same"]["pred_share"] < 1.0   # a real predictor, not all-on


def test_lookahead_bytes_match_a_replayed_window(lookahead):
    """Today: exact-set neurons outside the union of the last 5 tokens' sets. Hybrid (naive lookahead): the window
    holds lookahead | exact ("naive") or only the exact sets ("naive_drop"); prefetched = lookahead outside it;
    critical = exact outside it and the lookahead. Counted from token `warmup_tokens` on."""
    from flashinfer_lite.predictor_set import load_predictors
    doc, _, _, hf = lookahead
    assert doc["hot"] == "none" and doc["window"] == 5
    preds, stride, w0 = load_predictors(doc["model"]), doc["stride"], doc["warmup_tokens"]
    assert w0 == 5
    for r in doc["layers"]:
        j = r["layer"]
        exact = preds.predict(j, hf["x"][j])
        ahead = preds.predict(j, hf["h_next"][j - 1])
        got = {"today": 0, **{p: {"prefetched": 0, "wasted": 0, "critical": 0} for p in ("naive", "naive_drop")}}
        hist_today, hist_hyb = [], []
        for t, (e, a) in enumerate(zip(exact, ahead)):
            e, a = set(np.flatnonzero(e)), set(np.flatnonzero(a))
            win_today = set().union(*hist_today[-5:])
            if t >= w0:
                got["today"] += len(e - win_today)
                for p, win in (("naive", set().union(*hist_hyb[-5:])), ("naive_drop", win_today)):
                    got[p]["prefetched"] += len(a - win)
                    got[p]["wasted"] += len(a - win - e)
                    got[p]["critical"] += len(e - win - a)
            hist_today.append(e)
            hist_hyb.append(e | a)
        T = len(exact) - w0
        b = r["bytes_per_token"]
        assert b["today"]["critical"] == pytest.approx(got["today"] * stride / T, rel=0.01, abs=1), j
        for p in ("naive", "naive_drop"):
            for k in ("prefetched", "wasted", "critical"):
                assert b[p][k] == pytest.approx(got[p][k] * stride / T, rel=0.01, abs=1), (j, p, k)


def test_lookahead_byte_accounting_adds_up(lookahead):
    doc, err, _, _ = lookahead
    for r in doc["layers"]:
        for k in ("naive", "trained", "naive_drop", "trained_drop"):
            b = r["bytes_per_token"][k]
            assert b["total"] == pytest.approx(b["prefetched"] + b["critical"], abs=0.2)
            assert 0 <= b["wasted"] <= b["prefetched"]
            assert r["resident_bytes"][k] >= r["resident_bytes"]["today"] * 0.999   # it holds exact | lookahead
        for k in ("naive_drop", "trained_drop"):
            # same window as today: every prefetched row is either one today reads or one nobody selected
            b = r["bytes_per_token"][k]
            assert b["total"] == pytest.approx(r["bytes_per_token"]["today"]["critical"] + b["wasted"], abs=0.3)
            assert r["resident_bytes"][k] == r["resident_bytes"]["today"]
        assert f"| {r['layer']} |" in err
    tot = doc["bytes_per_token"]
    for p, parts in tot.items():
        for m, v in parts.items():
            assert v == pytest.approx(sum(r["bytes_per_token"][p][m] for r in doc["layers"]), abs=1)
    for k in ("naive", "trained", "naive_drop", "trained_drop"):
        c = doc["conclusion"][k]
        assert c["moved_off_critical_share"] == pytest.approx(1 - tot[k]["critical"] / tot["today"]["critical"],
                                                              abs=1e-3)
        assert c["extra_MB_per_token"] == pytest.approx((tot[k]["total"] - tot["today"]["critical"]) / 1e6, abs=1e-4)


# ----------------------------------------------------------------------------------------------------------------------
# bench/smollm2_modes.py --quick: stories260K converted, predictors trained, every row on the same tokens.
# Oracles: predictors/evaluate.py computes the dense and oracle perplexities of the same FLASHDIR on its own windows
# of the corpus; transformers (the accelerate row, run on the HF source) and the memmap dense row (Numba kernel over
# the bundles) are independent implementations of the dense model.

@pytest.fixture(scope="module")
def modes_run(tmp_path_factory):
    why = _cap_unavailable()
    if why:
        pytest.skip(f"memory cgroup unavailable: {why}")
    work = tmp_path_factory.mktemp("smollm2_modes")
    doc, err = run_bench("smollm2_modes.py", "--quick", "--keep", work, timeout=900)
    return doc, err, {r["mode"]: r for r in doc["results"]}


def test_modes_json_is_well_formed(modes_run):
    doc, _, rows = modes_run
    for key in ("model", "corpus", "ctx", "model_bytes", "cap_bytes", "runtime_minimum", "machine", "results",
                "command"):
        assert key in doc
    assert {"dense-ram", "dense-mmap", "flash-oracle-min", "flash-predicted-min", "accelerate-disk"} <= set(rows)
    # 50% of the tiny model's files is far below what the runtime needs: that row says so instead of running
    assert "below the minimum" in rows["flash-predicted-50"]["below_minimum"]
    n_ppl = rows["dense-ram"]["ppl_tokens"]
    for r in doc["results"]:
        if "below_minimum" in r:
            continue
        assert "error" not in r, r
        assert r["ppl_tokens"] == n_ppl and 1.0 < r["perplexity"] < 512          # vocabulary 512: uniform = 512
        assert len(r["gen_tokens"]) == doc["gen_tokens"] and r["decode_steps"] == doc["gen_tokens"] - 1
        assert r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] and r["tokens_per_s"] > 0
        assert r["memcap"]["oom_kills"] == 0 and r["memcap"]["exit_code"] == 0
        assert 0.0 <= r["top1_agree_with_dense"] <= 1.0
        if r["mode"].startswith("flash"):
            assert 0.0 <= r["decode_hit_rate"] <= 1.0 and 0.0 < r["active_share"] < 1.0
            assert r["cap_bytes"] >= r["budget_bytes"]
    # the accelerate row really offloaded part of the model to disk
    assert "disk" in rows["accelerate-disk"]["device_map_modules"]


def test_modes_dense_and_oracle_perplexity_equal_evaluate(modes_run):
    """evaluate.py windows the corpus itself and runs the runtime's model: same perplexity to rounding."""
    from predictors.evaluate import evaluate
    doc, _, rows = modes_run
    for ffn, mode in (("dense", "dense-ram"), ("oracle", "flash-oracle-min")):
        ref = evaluate(doc["model"], doc["corpus"], ffn, n_tokens=doc["ppl_tokens_requested"], ctx=doc["ctx"],
                       progress=False)
        assert rows[mode]["ppl_tokens"] == ref["tokens"]
        assert rows[mode]["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-4), mode
    # oracle computes about half the neurons (sparsity-0.5 thresholds), so it is not the dense model
    assert rows["flash-oracle-min"]["active_share"] < 0.7


def test_modes_independent_dense_implementations_agree(modes_run):
    """transformers on the HF source (half its weights offloaded to disk) and the Numba kernel over memmapped
    bundles compute the dense perplexity of the runtime's dense model; the FLASHDIR is f32, so to float rounding."""
    _, _, rows = modes_run
    dense = rows["dense-ram"]
    # transformers keeps K/V in float32, our KV cache in float16: 2e-4 apart measured on this model
    for mode, rel in (("dense-mmap", 1e-4), ("accelerate-disk", 5e-4)):
        assert rows[mode]["perplexity"] == pytest.approx(dense["perplexity"], rel=rel), mode
        assert rows[mode]["top1_agree_with_dense"] >= 0.98, mode
    assert rows["dense-mmap"]["gen_tokens"] == dense["gen_tokens"]


def test_modes_markdown_lists_every_row(modes_run):
    doc, err, _ = modes_run
    for r in doc["results"]:
        assert f"| {r['mode']} |" in err


# ----------------------------------------------------------------------------------------------------------------------
# bench/cache_window.py --trace: the counting reader under a real NeuronCache. The oracle is set arithmetic on the
# trace: with an unbounded window of k tokens and nothing pinned, token t misses exactly the neurons of A_t that are
# in none of A_{t-k} .. A_{t-1}.

def test_cache_window_trace_bytes_match_set_arithmetic(tmp_path):
    from record_trace import load_trace
    env = dict(os.environ, PYTHONPATH=str(REPO))
    trace = tmp_path / "trace.npz"
    subprocess.run([sys.executable, str(REPO / "tools" / "record_trace.py"), "-o", str(trace), "--model",
                    str(REPO / "tests" / "data" / "stories260K"), "--layers", "2", "--ffn", "512",
                    "--cal-tokens", "64", "--tokens", "24"], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=300)
    stride = 3000
    doc, _ = run_bench("cache_window.py", "--trace", trace, "--stride", stride, timeout=300)
    active, _, _ = load_trace(trace)                         # [T, L, n]
    T = active.shape[0]
    for row in doc["window_sweep"]:
        if row["hot_frac_of_ffn"] != 0.0:
            continue
        k = row["window"]
        misses = 0
        for t in range(T):
            seen = active[max(0, t - k):t].any(axis=0)       # [L, n]: active in the last k tokens
            misses += int((active[t] & ~seen).sum())
        assert row["bytes_requested_per_token"] == round(misses * stride / T), row
        assert row["hit_rate"] == round(1 - misses / active.sum(), 4), row
