"""collect / train-predictor / eval on mixtures of experts (issue 30, item 6): the router's choices and the perplexity
are transformers' on the same tokens; eval runs the model from flash under the minimum budget; collect's counts pin
the expert cache through train-predictor."""
import json

import numpy as np
import pytest

from conftest import CORPUS, transformers_model
from flashinfer_lite.runtime import load_runtime
from storage.convert import convert
from storage.errors import UserError

TEXT = CORPUS / "tinystories_cased_197KB.txt"
TOKENS, CTX = 120, 48            # three segments: 48, 48 and 24 tokens


def segments_of(model):
    from predictors.acts import read_corpus
    from storage.tokenizer import token_segments
    from flashinfer_lite.model import open_any
    ckpt = open_any(model)
    return list(token_segments(ckpt.tokenizer(), read_corpus([TEXT]).text, TOKENS, CTX, ckpt.config.bos_id))


def transformers_run(src, segments):
    """(perplexity over every next token of every segment, [L, E] how often transformers' routers picked each
    expert): each segment alone from an empty cache, the routers' top-k read off their forward outputs."""
    import torch
    hf = transformers_model(src)
    E = hf.config.num_experts if hasattr(hf.config, "num_experts") else hf.config.num_local_experts
    counts = np.zeros((hf.config.num_hidden_layers, E), np.int64)
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, args, out, i=i: np.add.at(counts[i], out[2].reshape(-1).numpy(), 1))
        for i, layer in enumerate(hf.model.layers)]
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in segments:
            logits = hf(torch.tensor([list(w)])).logits[0].double()
            lp = torch.log_softmax(logits[:-1], dim=-1)[torch.arange(len(w) - 1), torch.tensor(list(w[1:]))]
            nll -= float(lp.sum())
            n += len(w) - 1
    for h in hooks:
        h.remove()
    return float(np.exp(nll / n)), counts


@pytest.fixture(scope="module", params=["qwen3moe", "qwen2moe"])
def moe(request, tiny_model, tmp_path_factory):
    """(kind, also its GGUF architecture; HF directory; f32 FLASHDIR; transformers' perplexity and router counts on
    the test's segments) of a tiny Qwen3-MoE (q/k norms, renormalised top-k) and Qwen2-MoE (a shared expert with its
    sigmoid gate)."""
    src = tiny_model(request.param)
    flash = convert(src, tmp_path_factory.mktemp(f"{request.param}_f32") / "flash", dtype="f32", progress=False)
    segments = segments_of(src)
    assert [len(w) for w in segments] == [48, 48, 24]
    return request.param, src, flash, *transformers_run(src, segments)


def test_eval_from_flash_under_the_minimum_budget_has_transformers_perplexity(moe, monkeypatch):
    """eval's dense reference (one expert loaded at a time) and its auto mode (the expert cache, experts read from
    flash under the smallest budget the model runs in) give transformers' perplexity."""
    import flashinfer_lite.runtime as runtime
    from predictors.evaluate import evaluate
    _, src, flash, want, _ = moe
    dense = evaluate(src, [TEXT], "dense", n_tokens=TOKENS, ctx=CTX, progress=False)
    assert dense["tokens"] == 117 and dense["perplexity"] == pytest.approx(want, rel=1e-5)
    monkeypatch.setattr(runtime, "base_estimate_bytes", lambda *a: 0)   # the process base the minimum is made of
    monkeypatch.setattr(runtime, "measure_base_bytes", lambda *a: (0, 0))     # and the loading's peak
    monkeypatch.setattr(runtime, "loading_excess_bytes", lambda layout: 0)
    minimum = load_runtime(flash, "auto", dram_budget=None, ctx=CTX, base_bytes=0)[2].plan.minimum_bytes
    res = evaluate(flash, [TEXT], "auto", n_tokens=TOKENS, ctx=CTX, dram_budget=minimum, progress=False)
    assert res["ffn_source"] == "ExpertFFN" and res["hit_rate"] < 0.8 and res["flash_mb_per_token"] > 0
    assert res["perplexity"] == pytest.approx(want, rel=1e-5)
    assert res["dense_perplexity"] == pytest.approx(want, rel=1e-5) and res["top1_agreement"] == 1.0
    assert res["active_share"] == pytest.approx(2 / 6)                     # k of E experts per token
    with pytest.raises(UserError, match="below the minimum"):
        evaluate(flash, [TEXT], "auto", n_tokens=TOKENS, ctx=CTX, dram_budget=minimum - 4096, progress=False)


def test_collect_counts_transformers_routing_and_train_writes_them_for_the_cache(moe, tmp_path, monkeypatch):
    """collect records per layer how often the router picked each expert (transformers' top-k on the same tokens), from
    the HF directory, its GGUF (3-D expert tensors) and its FLASHDIR, with the FFN run over small groups of segments
    as well as over all of them; train-predictor writes those counts into the FLASHDIR, where they pin the most routed
    experts."""
    import shutil
    import predictors.layerwise as layerwise
    from predictors.collect import collect
    from predictors.train import train
    from flashinfer_lite.predictor_set import load_expert_freq
    kind, src, flash0, _, want = moe
    assert want.sum() == 120 * 2 * 2                                         # tokens x k x layers
    out = collect(src, [TEXT], TOKENS, tmp_path / "acts", ctx=CTX, progress=False)
    m = json.loads((out / "manifest.json").read_text())
    assert np.array_equal(m["expert_counts"], want) and m["shards"] == [] and m["rows"] == 0
    assert np.array_equal(np.sum(m["hist_count"], axis=1), [120 * 2 * 64] * 2)   # every routed expert's |a|
    monkeypatch.setattr(layerwise, "MOE_FFN_BYTES", 50 * 2 * 64 * 4)       # one segment per FFN group
    flash = shutil.copytree(flash0, tmp_path / "flash")
    from moe_gguf import write_moe_gguf
    for k, model in enumerate((flash, write_moe_gguf(src, tmp_path / "m.gguf", kind))):
        again = collect(model, [TEXT], TOKENS, tmp_path / f"acts{k}", ctx=CTX, progress=False)
        assert json.loads((again / "manifest.json").read_text())["expert_counts"] == m["expert_counts"], model
    assert train(out, flash, progress=False) == []                          # no neuron predictor
    assert np.array_equal(load_expert_freq(flash), want)
    from flashinfer_lite.budget import kv_minimum_bytes
    whole, _, rt = load_runtime(flash, "auto", dram_budget=None, base_bytes=0)
    pages = rt.plan.kv_bytes - kv_minimum_bytes(whole.cfg, rt.plan.ctx)      # every KV page in DRAM (they come first)
    budget = rt.plan.minimum_bytes + pages + 2 * rt.plan.n_layers * rt.plan.chunk    # 4 slots a layer: 2 pinned
    _, _, rt = load_runtime(flash, "auto", dram_budget=budget, base_bytes=0)
    assert [sorted(p) for p in rt.cache.pinned] == [sorted(np.argsort(-c, kind="stable")[:2].tolist()) for c in want]
    m["expert_counts"][1][3] = -1                                            # a damaged manifest
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="no expert counts"):
        train(out, flash, progress=False)


def test_collect_holds_one_routed_expert_at_a_time(tmp_path):
    """collect's peak allocation does not grow with a layer's experts (4 against 64 experts of 128 neurons, d 256: the
    60 more are 22.5 MiB in float32), while loading every weight, the control, grows by all of them."""
    import tracemalloc
    from flashinfer_lite.model import load_weights, open_any
    from predictors.collect import collect
    from make_large_model import main as make_model      # tools/ (conftest puts it on the path)

    def peak(run) -> int:
        tracemalloc.start()
        try:
            run()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    models = {}
    for E in (4, 64):
        models[E] = tmp_path / f"e{E}"
        make_model([str(models[E]), "--layers", "1", "--dim", "256", "--ffn", "128", "--heads", "4",
                    "--experts", str(E), "--experts-used", "4", "--check-tokens", "0"])
    run = lambda E, out: collect(models[E], [TEXT], 256, tmp_path / out, ctx=128, progress=False)  # noqa: E731
    run(4, "warm")                                        # what a first call allocates once (tokenizer, kernels)
    streamed = [peak(lambda: run(E, f"acts{E}")) for E in (4, 64)]
    whole = [peak(lambda: load_weights(open_any(models[E]))) for E in (4, 64)]
    more = 60 * 3 * 256 * 128 * 4
    assert whole[1] - whole[0] > 0.9 * more               # the measurement sees the experts' weights
    assert streamed[1] - streamed[0] < more / 16, f"64 experts cost {(streamed[1] - streamed[0]) / 2**20:.1f} MiB more"


def test_make_large_model_experts_take_the_act_asked_for(tmp_path):
    """tools/make_large_model.py --experts writes the activation --act names (SwiGLU unless told FATReLU), and the
    checkpoint reader sees it: FATReLU experts are ReLU with the threshold the tool printed."""
    from make_large_model import main as make_model      # tools/ (conftest puts it on the path)
    from storage.checkpoint import open_checkpoint
    args = ["--layers", "1", "--dim", "64", "--ffn", "32", "--heads", "2", "--experts", "4", "--experts-used", "2"]
    for act, want in ((None, "silu"), ("silu", "silu"), ("fatrelu", "relu")):
        out = tmp_path / f"m_{act}"
        make_model([str(out), *args, *(["--act", act] if act else [])])
        info = json.loads((out / "config.json").read_text())
        cfg = open_checkpoint(out).config
        assert (cfg.act, cfg.n_experts) == (want, 4)
        if act == "fatrelu":
            assert info["hidden_act"] == "fatrelu" and cfg.relu_threshold == info["hidden_act_param"] > 0
        else:
            assert info["hidden_act"] == "silu" and cfg.relu_threshold == 0
