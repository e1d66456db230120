"""The predictor pipeline end to end: collect -> train-predictor -> eval, on stories260K (SwiGLU, thresholds) and on a
transformers-built random ReLU Llama (recall checked against the dense math on text the predictors never saw)."""
from __future__ import annotations

import argparse
import json
import shutil

import numpy as np
import pytest

from storage.errors import UserError
from conftest import CORPUS, STORIES, assert_same_bits_at_every_budget, build_tiny, predicted_ffn_calls

TINYSTORIES = CORPUS / "tinystories_cased_197KB.txt"


def corpus_slices(tmp_path, cal_bytes=60_000, eval_bytes=20_000):
    """Calibration text and held-out text: disjoint slices of TinyStories, written into tmp (never into the repo)."""
    data = TINYSTORIES.read_bytes()
    cal, held = tmp_path / "cal.txt", tmp_path / "heldout.txt"
    cal.write_bytes(data[:cal_bytes])
    held.write_bytes(data[-eval_bytes:])
    return cal, held


def parse(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    """stories260K converted to a FLASHDIR, activations collected on calibration text, predictors trained."""
    from predictors import collect, train
    from storage.convert import convert
    tmp = tmp_path_factory.mktemp("stories_pipeline")
    cal, held = corpus_slices(tmp)
    flash = convert(STORIES, tmp / "flash", dtype="f32", progress=False)
    acts = tmp / "acts"
    assert collect.run(parse(collect, ["-m", str(STORIES), "--corpus", str(cal), "--tokens", "5000", "-o",
                                       str(acts), "--rows", "3000"])) == 0
    # max_read_share=1: keep every layer's predictor, whatever it selects, so that the predictor path is what runs
    cards = train.train(acts, flash, sparsity=0.5, steps=150, max_read_share=1.0, progress=False)
    return dict(flash=flash, acts=acts, held=held, cal=cal, cards=cards, tmp=tmp)


def test_collect_records_what_the_dense_model_computes(stories):
    """The stored rows are the dense FFN's inputs and |activations|: recompute |a| from x with the source weights."""
    from storage.checkpoint import open_checkpoint
    from flashinfer_lite.model import load_weights
    from flashinfer_lite.ffn.dense import FeedForward
    from predictors.acts import Acts
    acts = Acts(stories["acts"])
    ckpt = open_checkpoint(STORIES)
    w = load_weights(ckpt)
    assert acts.tokens == 5000 and 2000 < acts.manifest["rows"] <= 3000
    for i in (0, ckpt.config.n_layers - 1):
        x, absa = acts.layer(i)
        assert x.shape == (acts.manifest["rows"], 64) and absa.shape == (acts.manifest["rows"], 172)
        want = np.abs(FeedForward(ckpt.config, w, i).activations(x[:200]))
        np.testing.assert_allclose(absa[:200], want, rtol=2e-3, atol=1e-6)   # |a| stored as float16
        # the histogram covers every token x neuron, not only the sampled rows
        assert acts.hist_count[i].sum() == acts.tokens * 172


def test_thresholds_hit_the_target_sparsity(stories):
    from predictors.acts import Acts
    from flashinfer_lite.predictor_set import load_predictors
    acts, ps = Acts(stories["acts"]), load_predictors(stories["flash"])
    for i in range(5):
        x, absa = acts.layer(i)
        assert ps.act_threshold(i) > 0
        assert abs((absa <= ps.act_threshold(i)).mean() - 0.5) < 0.02
        assert np.allclose(ps.neuron_freq(i), (absa > ps.act_threshold(i)).mean(0))


def test_predicted_perplexity_within_5_percent_of_dense(stories, capsys):
    """eval --json runs the decode path on held-out text; the sparsity it reports is real (about half the neurons)."""
    from predictors import evaluate
    assert evaluate.run(parse(evaluate, ["-m", str(stories["flash"]), "--corpus", str(stories["held"]), "--ffn",
                                         "predicted", "--tokens", "400", "--json"])) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)                               # --json: stdout is the JSON object and nothing else
    assert "perplexity=" in err                         # the table went to stderr
    assert res["tokens"] >= 390
    assert res["perplexity"] <= 1.05 * res["dense_perplexity"], res
    assert res["active_share"] < 0.6, res            # computed neurons: the threshold sparsity, reached
    assert res["top1_agreement"] > 0.7
    assert res["predicted_share"] >= res["active_share"]
    assert 0 < res["predictor_share_of_ffn_bytes"] < 0.2


def test_cards_and_files(stories):
    from flashinfer_lite.predictor_set import PREDICTOR_DIR
    root = stories["flash"] / PREDICTOR_DIR
    cards = [json.loads((root / f"layer_{i:03d}.json").read_text()) for i in range(5)]
    assert cards[0]["dense"] is True
    for c in cards[1:]:
        assert c["rank"] >= 16 and c["bytes"] == (c["rank"] * (64 + 172)) * 2 + 172 * 4
        assert 0 < c["precision"] <= 1 and c["recall"] >= 0.98 and c["pred_true_ratio"] >= c["recall"]
    from storage.format import VERIFIED_STAMP
    left = [p for p in stories["flash"].iterdir() if p.name.startswith(".") and p.name != VERIFIED_STAMP]
    assert not left                                                    # no temp dirs left behind


def test_thresholds_only(stories, tmp_path):
    """--thresholds-only stores what `--ffn oracle` needs; asking it for predictions is a clear error."""
    import shutil
    from flashinfer_lite.predictor_set import load_predictors
    from predictors.train import train
    flash = tmp_path / "flash"
    shutil.copytree(stories["flash"], flash)
    shutil.rmtree(flash / "predictors")
    assert load_predictors(flash) is None
    train(stories["acts"], flash, sparsity=0.5, thresholds_only=True, progress=False)
    ps, full = load_predictors(flash), load_predictors(stories["flash"])
    assert not ps.has_predictors
    assert [ps.act_threshold(i) for i in range(5)] == [full.act_threshold(i) for i in range(5)]
    with pytest.raises(UserError, match="thresholds only"):
        ps.predict(1, np.zeros((1, 64), np.float32))


def test_relu_recall_meets_target_on_heldout_text(tiny_model, tmp_path):
    """Random ReLU Llama: collect from the HF dir, train into its FLASHDIR, then check recall on text the predictor
    never saw against the dense activations (a != 0) computed from the source weights."""
    from flashinfer_lite.model import load_reference
    from predictors.collect import collect
    from flashinfer_lite.predictor_set import load_predictors
    from predictors.train import train
    from storage.convert import convert
    model_dir = tiny_model("llama-relu")
    cal, held = corpus_slices(tmp_path, cal_bytes=40_000, eval_bytes=8_000)
    flash = convert(model_dir, tmp_path / "flash", dtype="f32", progress=False)
    collect(model_dir, [cal], 3000, tmp_path / "acts", ctx=128, rows=2500, progress=False)
    target = 0.97
    cards = train(tmp_path / "acts", flash, target_recall=target, dense_layers=0, steps=150, progress=False)
    assert all(c["recall"] >= target for c in cards)
    ps = load_predictors(flash)
    model, tok = load_reference(model_dir)
    ids = tok.encode(held.read_text(encoding="utf-8"))[:120]
    hits = np.zeros(2)
    total = np.zeros(2)
    pred_n = np.zeros(2)

    def ffn(layer, x):
        f = ffs[layer]
        a = f.activations(x)
        true = a != 0
        pred = ps.predict(layer, x)
        hits[layer] += (pred & true).sum()
        total[layer] += true.sum()
        pred_n[layer] += pred.sum()
        return f(x)
    ffs = model.dense_ffn
    model.ffn = ffn
    model.forward(ids, model.new_cache(len(ids)))
    recall = hits / total
    assert (recall >= target).all(), recall
    assert (pred_n < 120 * 160).all()                 # it does not just predict everything


def test_acts_from_another_model_are_refused(stories, tiny_model, tmp_path):
    from predictors.collect import collect
    from predictors.train import train
    from storage.convert import convert
    other = convert(tiny_model("llama-relu"), tmp_path / "relu_flash", dtype="f32", progress=False)
    with pytest.raises(UserError, match="another model.*config"):
        train(stories["acts"], other, progress=False)
    # same architecture and config, other weights: the fingerprint tells them apart
    a = tmp_path / "acts_seed0"
    collect(tiny_model("llama-relu"), [stories["cal"]], 300, a, ctx=64, rows=200, progress=False)
    twin = convert(build_tiny("llama-relu", tmp_path / "seed1", seed=1), tmp_path / "seed1_flash", dtype="f32",
                   progress=False)
    with pytest.raises(UserError, match="another model.*weights"):
        train(a, twin, progress=False)


def test_empty_corpus_is_a_clear_error(tmp_path):
    from predictors.acts import read_corpus
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    with pytest.raises(UserError, match="empty corpus"):
        read_corpus([empty])
    with pytest.raises(UserError, match="not found"):
        read_corpus([tmp_path / "missing.txt"])


def test_non_utf8_corpus_is_decoded_with_replacement_and_counted(tmp_path):
    from predictors.acts import read_corpus
    f = tmp_path / "latin1.txt"
    f.write_bytes("café crème — naïve\n".encode("latin-1", errors="replace") * 3 + b"ok \xff\xfe\xc3\n")
    c = read_corpus([f])
    # latin-1: é, è, ï are one invalid byte each (the dash became '?'); then \xff \xfe and a truncated \xc3
    assert c.replaced_bytes == 3 * 3 + 3
    assert c.text.count("\ufffd") == c.replaced_bytes and c.text.startswith("caf\ufffd cr\ufffdme")


def test_collect_reports_replaced_bytes(tmp_path, capsys):
    from predictors.collect import collect
    f = tmp_path / "mixed.txt"
    f.write_bytes(TINYSTORIES.read_bytes()[:4000] + b"\n\x80\x81 bad bytes\n")
    out = collect(STORIES, [f], 300, tmp_path / "acts", ctx=64, rows=50, progress=False)
    assert json.loads((out / "manifest.json").read_text())["replaced_bytes"] == 2
    assert "2 bytes of the corpus are not valid UTF-8" in capsys.readouterr().err
    with pytest.raises(UserError, match="already exists"):
        collect(STORIES, [f], 300, tmp_path / "acts", progress=False)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(UserError, match="empty corpus"):
        collect(STORIES, [empty], 300, tmp_path / "acts2", progress=False)


def test_lookahead_prefetch_changes_bytes_not_results(stories):
    """The lookahead only starts reads early: the exact predictor still decides, so logits equal the run without it,
    and at a budget small enough to miss, part of the misses are served from the prefetched rows."""
    from flashinfer_lite.runtime import load_runtime
    ids = [1, 403, 261, 324, 281, 384, 265, 427, 298, 410, 327, 261, 368, 287]
    runs = {}
    # the smallest budget the plan allows (process base left out so it does not depend on this process's RSS)
    probe = load_runtime(stories["flash"], "predicted", ctx=64, base_bytes=0, lookahead=True)[2]
    minimum = probe.plan.minimum_bytes
    for ahead in (False, True):
        model, _, rt = load_runtime(stories["flash"], "predicted", dram_budget=minimum, ctx=64, base_bytes=0,
                                    lookahead=ahead)
        kv = model.new_cache(64)
        runs[ahead] = (np.stack([model.forward([t], kv) for t in ids]), rt.stats)
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-5)
    st = runs[True][1]
    assert runs[False][1].prefetched == 0
    assert 0 < st.prefetch_used <= st.prefetched
    # served-early rows are still misses of the exact set (the staging rows come out of the same budget, so the
    # window is a little smaller than without lookahead)
    assert st.prefetch_used <= st.misses


def test_prefill_streaming_computes_the_same_function_as_the_cache_path(stories):
    """Streaming a layer only changes how bundles are read: each row still gets its predicted set, thresholded."""
    from flashinfer_lite.runtime import load_runtime
    ids = [1, 403, 261, 324, 281, 384, 265, 427, 298, 410, 327, 261]
    out = {}
    for stream in (True, False):
        model, _, rt = load_runtime(stories["flash"], "predicted", ctx=64)
        rt.prefer_streaming = lambda layer, sets, s=stream: s
        out[stream] = model.forward(ids, model.new_cache(64), all_logits=True)
        assert rt.stats.streamed_layers == (5 if stream else 0)
    assert np.array_equal(out[True], out[False])   # the same kernel in the same order: the same bits


def test_predicted_mode_same_logits_at_every_budget(stories, monkeypatch):
    """Issue 14 on a trained model: the predictor sees the FFN outputs of earlier layers, so any rounding difference
    between budgets would change its choices; with one summation order nothing differs at all."""
    ids = [1, 403, 261, 324, 281, 384, 265, 427, 298, 410]
    assert_same_bits_at_every_budget(stories["flash"], "predicted", ids, 10, monkeypatch)


def test_predicted_ffn_equals_float64_dense_math_on_the_predicted_set(stories):
    """Issue 14 goal 3, an oracle outside the runtime: for every layer's FFN call of a real decode (bounded budget,
    so reads, pieces and the window all take part), float64 dense math on the source checkpoint's weights,
    restricted to the neurons the predictor chose and thresholded as calibrated, equals the runtime's output."""
    from flashinfer_lite.model import open_any
    src = open_any(STORIES)                        # the HF checkpoint, not the FLASHDIR the runtime reads
    cfg = src.config
    W = {n: src.tensor(n).astype(np.float64) for n in src.names() if ".ffn." in n}
    calls, rt = predicted_ffn_calls(stories["flash"], [1, 403, 261, 324, 281, 384, 265, 427])
    assert rt.stats.read_bytes > 0 and len(calls) == 8 * cfg.n_layers
    preds = rt.selector.predictors
    restricted_differs = 0
    for layer, x, y in calls:
        mask = preds.predict(layer, x, count=False)[0]        # the set the runtime computed (the same x, same bits)
        p = f"layers.{layer}.ffn."
        x64 = x[0].astype(np.float64)
        g = W[p + "gate.weight"] @ x64
        a = g / (1 + np.exp(-g)) * (W[p + "up.weight"] @ x64)
        a_pred = np.where(mask & (np.abs(a) > preds.act_threshold(layer)), a, 0.0)
        want = W[p + "down.weight"] @ a_pred
        assert np.linalg.norm(y[0] - want) <= 1e-5 * np.linalg.norm(want), layer
        full = W[p + "down.weight"] @ np.where(np.abs(a) > preds.act_threshold(layer), a, 0.0)
        restricted_differs += np.linalg.norm(full - want) > 1e-3 * np.linalg.norm(want)
    assert mask.mean() < 1.0 and restricted_differs > 0    # the predicted set really is a subset that matters


def test_a_predictor_that_would_read_nearly_everything_is_dropped(stories):
    """--max-read-share: a layer whose predictor selects more than that share of its neurons on held-out rows gets
    none: every neuron is read and the exact threshold decides, so that layer computes what the oracle computes."""
    from predictors import train
    from flashinfer_lite.predictor_set import load_predictors, read_manifest
    flash = stories["tmp"] / "flash_max_read"
    shutil.copytree(stories["flash"], flash)
    kept = [c for c in stories["cards"] if not c.get("dense")]
    cut = float(np.median([c["pred_share"] for c in kept]))          # some layers above it, some at or below
    cards = train.train(stories["acts"], flash, sparsity=0.5, steps=150, max_read_share=cut, progress=False)
    want_dense = {0} | {c["layer"] for c in kept if c["pred_share"] > cut}
    assert {c["layer"] for c in cards if c.get("dense")} == want_dense and len(want_dense) < len(cards)
    assert read_manifest(flash)["dense_layers"] == sorted(want_dense)
    ps = load_predictors(flash)
    x = np.random.default_rng(0).standard_normal((7, 64)).astype(np.float32)
    for i in range(len(cards)):
        assert (ps.rank(i) == 0) == (i in want_dense)
        if i in want_dense:
            assert ps.predict(i, x).all()


def test_keep_selects_the_top_share_of_the_scores(stories, tmp_path):
    """Issue 44: `train-predictor --keep F` sets a read budget in place of a recall target. Per layer past the dense
    one, the stored predictor selects, on the rows its cut was tuned on, the entries whose float64 score (from the
    stored weights) is among the top share F of that layer's scores; on the reporting rows (text neither training
    nor tuning saw) it reads about F of the neurons; no threshold is left (every selected neuron counts)."""
    from flashinfer_lite.predictor_set import load_predictors, read_manifest
    from predictors import train
    from predictors.acts import Acts
    flash = tmp_path / "flash"
    shutil.copytree(stories["flash"], flash)
    keep = 0.3
    cards = train.train(stories["acts"], flash, keep=keep, steps=20, progress=False, threads=1)
    m, ps, acts = read_manifest(flash), load_predictors(flash), Acts(stories["acts"])
    assert m["keep"] == keep and m["dense_layers"] == [0] and m["act_threshold"] == [0.0] * 5
    for i in range(1, 5):
        x, _ = acts.layer(i)
        _, tune, report = train.split_rows(len(x))
        w_in, w_out, bias = (np.asarray(a, np.float64) for a in ps._w[i])     # [d, r], [r, n], [n]
        score = (x[tune].astype(np.float64) @ w_in) @ w_out + bias
        k = int(round(keep * score.size))
        top = np.zeros(score.size, bool)
        top[np.argsort(score, axis=None)[::-1][:k]] = True
        got = ps.predict(i, x[tune], count=False).ravel()
        near = np.abs(score.ravel()) < 1e-4 * np.abs(score).max()             # float32 vs float64 at the cut
        assert np.array_equal(got[~near], top[~near]) and near.sum() < 0.001 * score.size, i
        share = ps.predict(i, x[report], count=False).mean()
        assert abs(share - keep) < 0.1 and abs(cards[i]["pred_share"] - share) < 1e-3, (i, share)
        assert 0 < cards[i]["mass_kept"] <= 1
    with pytest.raises(UserError, match="--keep must be in"):
        train.train(stories["acts"], flash, keep=1.0, steps=1, progress=False)
    with pytest.raises(SystemExit):      # one selection target: a budget or a recall, not both
        parse(train, [str(stories["acts"]), "-o", str(flash), "--keep", "0.5", "--target-recall", "0.9"])


def test_a_flipped_predictor_byte_is_found_by_verify_and_at_launch(stories, tmp_path):
    from flashinfer_lite.runtime import load_runtime
    from storage.format import verify
    flash = shutil.copytree(stories["flash"], tmp_path / "flash")
    verify(flash, progress=False)                                      # intact: passes, and stamps
    w = flash / "predictors" / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0x01
    w.write_bytes(bytes(data))
    with pytest.raises(UserError, match="weights.safetensors: checksum mismatch: the predictor file is damaged"):
        verify(flash, progress=False)
    with pytest.raises(UserError, match="predictor file is damaged"):
        load_runtime(flash, "predicted", base_bytes=0)


def test_collect_removes_what_a_killed_collect_left(tmp_path):
    """SIGKILL skips every cleanup: the next collect beside it removes the dead process's temp directory, and keeps
    a live process's."""
    import os
    import subprocess
    import sys
    from predictors.collect import collect
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                            # its pid names no process now
    stale = tmp_path / f".acts.tmp-{dead.pid}"
    live = tmp_path / f".other.tmp-{os.getppid()}"
    for d in (stale, live):
        d.mkdir()
        (d / "shard-00000.safetensors").write_bytes(b"half")
    collect(STORIES, [TINYSTORIES], 300, tmp_path / "acts", ctx=64, rows=50, progress=False)
    assert not stale.exists() and live.exists() and (tmp_path / "acts" / "manifest.json").is_file()


def _edit_predictor_manifest(flash, edit, rechecksum: bool):
    from storage.format import manifest_checksum
    path = flash / "predictors" / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    if rechecksum:
        m["manifest_checksum"] = manifest_checksum(m)
    path.write_text(json.dumps(m))


def test_an_edited_predictor_manifest_is_found_by_verify_and_at_launch(stories, tmp_path):
    """act_threshold 100 everywhere passed verify before the manifest checksummed itself (then: "upon upon upon")."""
    from test_untrusted import assert_one_line_error
    from test_cli import cli
    flash = shutil.copytree(stories["flash"], tmp_path / "flash")
    assert cli("verify", str(flash)).returncode == 0
    _edit_predictor_manifest(flash, lambda m: m.__setitem__("act_threshold", [100] * len(m["act_threshold"])),
                             rechecksum=False)
    assert_one_line_error(cli("verify", str(flash)), "predictors/manifest.json: checksum mismatch")
    assert_one_line_error(cli("generate", "-m", str(flash), "-p", "Once", "-n", "4", "--ffn", "predicted"),
                          "predictors/manifest.json: checksum mismatch")


@pytest.mark.parametrize("field,value", [("act_threshold", ["high"] * 5), ("act_threshold", [float("nan")] * 5),
                                         ("n_layers", "5"), ("dense_layers", ["0"]), ("dense_layers", [99]),
                                         ("dense_layers", 3), ("has_predictors", "yes"), ("calibration", [1])])
def test_predictor_manifest_fields_of_the_wrong_type_are_one_line(stories, tmp_path, field, value):
    """Even with the manifest's own checksum recomputed (a hostile file, not a damaged one)."""
    from test_untrusted import assert_one_line_error
    from test_cli import cli
    flash = shutil.copytree(stories["flash"], tmp_path / "flash")
    _edit_predictor_manifest(flash, lambda m: m.__setitem__(field, value), rechecksum=True)
    assert_one_line_error(cli("generate", "-m", str(flash), "-p", "Once", "-n", "4", "--ffn", "predicted"),
                          "malformed predictor manifest")
