"""GGUF files made by llama.cpp's own converter (tools/make_gguf_fixtures.py), with llama.cpp's logits on each recorded
next to it: our dense logits and greedy tokens against llama.cpp's, with no llama.cpp installed.

Tolerance. llama.cpp's CPU matmuls round their activations to the weights' type first (F16 weights: x to float16;
Q8_0: x to Q8_0 blocks, 8 bits per value), its attention rounds q and the softmax weights to float16 (the KV cache's
type), and its GELU is a float16 table. We round Q8_0's activations as llama.cpp does (quant.set_act8) and compute
the rest in float32. TOL is the largest difference that this makes on these fixtures (measured at every position of
llama.cpp's greedy path: F32 2.4e-4, F16 2.8e-3, Q8_0 1.6e-2 (2.2e-2 with float32 activations), on logits of
magnitude ~0.7; Q4_K_M, llama.cpp's quantizer's K-quant mix, 3.4e-2 on logits of ~1.6), about doubled (F32's
quadrupled). test_the_difference_is_llama_cpps_rounding shows that
the difference is that rounding: applied to our activations too, it leaves Qwen's logits equal to llama.cpp's to
float32's last bits at most positions, and halves Gemma's (the rest: GELU-table steps that float32
summation order decides).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import flashinfer_lite.ffn.dense as dense_module
import flashinfer_lite.model as model_module
from conftest import assert_same_bits_at_every_budget, greedy_tokens
from glu_twin import activation
from flashinfer_lite.kernels.blocks import set_act8
from flashinfer_lite.runtime import load_runtime
from storage.checkpoint import open_checkpoint
from storage.convert import convert
from storage.errors import UserError
from storage.format import read_layout
from storage.tokenizer import token_segments

DATA = Path(__file__).resolve().parent / "data" / "gguf"
FIXTURES = sorted(p.stem for p in DATA.glob("*.gguf"))
TOL = {"f32": 1e-3, "f16": 6e-3, "q8_0": 3.5e-2, "q4_k_m": 7e-2}
K_QUANT_MIXES = ("q4_k_m",)      # made by llama.cpp's quantizer (tools/make_gguf_fixtures.py)


def weight_type(name: str) -> str:
    return name.rsplit("-", 1)[1]


def recorded(name: str) -> dict:
    with np.load(DATA / f"{name}.llama_cpp.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def ours(name: str, path: list[int]) -> tuple[np.ndarray, list[int]]:
    """Our dense logits at every position of `path` [len(path), V], as llama.cpp computed its own: the prompt as one
    batch, then one token at a time; and our own greedy continuation of the prompt, as long."""
    n_prompt = len(recorded(name)["ids"])
    model, _, _ = load_runtime(DATA / f"{name}.gguf", "dense")
    kv = model.new_cache(128)
    rows = [model.forward(path[:n_prompt], kv, all_logits=True)]
    rows += [model.forward([t], kv)[None] for t in path[n_prompt:]]
    return np.concatenate(rows), greedy_tokens(model, path[:n_prompt], len(path) - n_prompt)


def test_the_fixtures_are_there():
    assert {n.split("-")[0] for n in FIXTURES} == {"qwen2", "qwen3", "gemma3"}
    assert {weight_type(n) for n in FIXTURES} == set(TOL)


@pytest.mark.parametrize("name", FIXTURES)
def test_dense_logits_and_greedy_tokens_equal_llama_cpps(name):
    ref = recorded(name)
    path = ref["greedy"].tolist()
    logits, tokens = ours(name, path)
    assert np.abs(ref["logits"]).max() > 0.3 and len(set(path[len(ref["ids"]):])) > 3   # says something
    np.testing.assert_allclose(logits, ref["logits"], rtol=0, atol=TOL[weight_type(name)])
    # greedy: at every step, our choice is llama.cpp's, or llama.cpp's own logits put the two within the rounding
    # (a tiny random model's top two logits are often that close: then either rounding may pick either)
    for p in range(len(ref["ids"]) - 1, len(path) - 1):
        mine, theirs = int(np.argmax(logits[p])), path[p + 1]
        assert mine == theirs or ref["logits"][p, theirs] - ref["logits"][p, mine] < 2 * TOL[weight_type(name)], p
    if weight_type(name) in ("f32", "f16"):   # float rounding alone: no near tie on these paths, the same 32 tokens
        assert tokens == path


@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_tokens_equal_transformers_on_the_source(name):
    """The GGUF against transformers on the float32 HF directory it was converted from (recorded by the same script):
    the same 32 greedy tokens where transformers' choice is clear; F32 weights: all of them, and the same logits."""
    hf = np.load(DATA / f"{name}.transformers.npz", allow_pickle=False)
    n_prompt = len(recorded(name)["ids"])
    ids = hf["greedy"][:n_prompt].tolist()
    model, _, _ = load_runtime(DATA / f"{name}.gguf", "dense")
    tokens = greedy_tokens(model, ids, len(hf["greedy"]) - n_prompt)
    if weight_type(name) == "f32":
        assert tokens == hf["greedy"].tolist()
        kv = model.new_cache(128)
        logits = model.forward(tokens[:-1], kv, all_logits=True)[n_prompt - 1:]
        np.testing.assert_allclose(logits, hf["logits"].astype(np.float32), rtol=0, atol=2e-3)  # float16-recorded
    for step in range(len(hf["logits"])):       # to the first difference: after it the two continue other texts
        mine, theirs = tokens[n_prompt + step], int(hf["greedy"][n_prompt + step])
        if mine != theirs:     # the GGUF's rounded weights (F16, Q8_0) may pick the other of a near tie
            assert hf["logits"][step, theirs] - hf["logits"][step, mine] < 2 * TOL[weight_type(name)], step
            break


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def q8_0(x: np.ndarray) -> np.ndarray:
    """x through Q8_0 blocks as ggml's CPU quantize_row_q8_0 rounds them: times 127 / max|x| (not divided by the
    scale), ties to even, the scale stored as float16."""
    blocks = np.ascontiguousarray(x, np.float32).reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    return (np.rint(blocks * inv) * f16(amax / np.float32(127))).reshape(x.shape)


def llama_cpp_rounding(monkeypatch, kind: str) -> None:
    """Round our activations where llama.cpp's CPU backend rounds them, for weights of type kind."""
    # K-quant mixes: our 8-bit activations round x as llama.cpp does already (q8_K blocks; q8_0 for 32-weight kinds)
    rnd = {"f32": lambda x: x, "f16": f16, "q8_0": q8_0, "q4_k_m": lambda x: x}[kind]
    linear, attention_mask = model_module.linear, model_module.attention_mask

    def attention(q, kv, slot, pos0, window, scale):                # q and the softmax weights in float16
        K, V = (b.view(np.float16).astype(np.float32) for b in kv.rows(slot, 0, pos0 + q.shape[0]))
        g = q.shape[1] // K.shape[1]
        out = np.empty(q.shape, np.float32)
        for h in range(q.shape[1]):
            s = f16(q[:, h]) @ K[:, h // g].T * scale + attention_mask(pos0, q.shape[0], window)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, h] = f16(p / p.sum(-1, keepdims=True)) @ V[:, h // g]
        return out

    activations = dense_module.activations

    def gating(act, g, u, threshold):            # GELU through a float16 table, between -10 and 10 (0 below, x above)
        if act != "gelu_tanh":
            return activations(act, g, u, threshold)
        return np.where(g <= -10, 0, np.where(g >= 10, g, f16(activation(act, f16(g))))).astype(np.float32) * u
    for module in (model_module, dense_module):                      # attention's products, and the FFN's
        monkeypatch.setattr(module, "linear", lambda x, w, b=None: linear(rnd(x), w, b))
    monkeypatch.setattr(model_module, "prompt_attention", attention)
    monkeypatch.setattr(model_module, "ATTENTION_KERNEL_MAX_T", 0)   # decode steps through these too, not through
    monkeypatch.setattr(dense_module, "DENSE_ROW_KERNEL_MAX_T", 0)   # the Numba kernels
    monkeypatch.setattr(dense_module, "activations", gating)


@pytest.mark.parametrize("name", FIXTURES)
def test_the_difference_is_llama_cpps_rounding(name, monkeypatch):
    ref = recorded(name)
    path = ref["greedy"].tolist()
    plain = np.abs(ours(name, path)[0] - ref["logits"]).max(axis=1)           # per position
    llama_cpp_rounding(monkeypatch, weight_type(name))
    logits, tokens = ours(name, path)
    err = np.abs(logits - ref["logits"]).max(axis=1)
    if name.startswith("gemma3"):
        # GELU's float16 table turns float32 summation-order differences (1e-7) into whole float16 steps of some
        # neurons' activations, and 6 layers and attention carry them on: rounding as llama.cpp does removes about
        # half of the difference, not all (measured median per position: f16 7.3e-4 -> 3.6e-4, q8_0 1.2e-2 ->
        # 6.5e-3; a 1-layer Gemma 3 agreed to 2e-7 at 35 of 36 positions in f32 and f16)
        assert np.median(err) < np.median(plain) / 1.5
    else:
        # to float32's last bits (1e-7), but for the value on a float16 rounding boundary that float32 summation
        # order rounds the other way (qwen2-f16: 9 positions of 52 moved by 1e-5 to 3e-4)
        assert np.median(err) < 1e-6 and np.mean(err < 1e-5) >= 0.75, err
    assert tokens == path


@pytest.mark.parametrize("name", [n for n in FIXTURES if weight_type(n) == "q8_0"])
def test_8_bit_activations_bring_the_q8_0_logits_to_llama_cpps(name, float32_activations):
    """Our Q8_0 dot products round x as llama.cpp's do (quant.set_act8, the default; tests/test_act8.py): against
    float32 activations the logits move closer to llama.cpp's (max 2.2e-2 -> 1.6e-2; median per position: qwen2
    9.1e-3 -> 1.2e-7, qwen3 9.7e-3 -> 7.0e-3, gemma3 1.2e-2 -> 1.0e-2). What is left is attention's and GELU's
    float16 rounding (test_the_difference_is_llama_cpps_rounding)."""
    ref = recorded(name)
    path = ref["greedy"].tolist()
    plain = np.abs(ours(name, path)[0] - ref["logits"]).max(axis=1)
    set_act8(True)
    err = np.abs(ours(name, path)[0] - ref["logits"]).max(axis=1)
    assert err.max() < TOL["q8_0"] and np.median(err) < np.median(plain) / 1.15, (err.max(), np.median(err))
    if name.startswith("qwen2"):
        assert np.median(err) < 1e-6


@pytest.mark.parametrize("name", FIXTURES)
def test_the_gguf_config_is_the_source_models(name):
    """What llama.cpp's converter wrote is read as the architecture it is (spot checks of the fields that matter)."""
    c = open_checkpoint(DATA / f"{name}.gguf").config
    arch = name.split("-")[0]
    assert c.qk_norm == (None if arch == "qwen2" else "head") and c.qkv_bias == (arch == "qwen2")
    assert c.post_norms == (arch == "gemma3") and c.act == ("gelu_tanh" if arch == "gemma3" else "silu")
    if arch == "gemma3":
        assert c.sliding_layers == [True] * 5 + [False] and c.sliding_window == 8 and c.embed_scale == 8.0


TRICKY = ["Hello world", "  two  spaces, three   and a tab\there", "\n\nnewlines\r\n and CR\n",
          "digits 1234567 3.14 1,000",
          "unicode: émigré naïve Ünïcödé 日本語 😀 ﬁ", "don't I'll we've THEY'RE", "<|im_start|>user\nHi<|im_end|>",
          "<start_of_turn>user\nHi<end_of_turn>\n", "<bos>not at the start <eos>", " leading space", "trailing space ",
          "", "a" * 50, "  \n  ", "$%^&*()_+{}|:\"<>?~`"]


@pytest.mark.parametrize("family, name", [("qwen", "qwen2-f16"), ("qwen", "qwen3-q8_0"), ("gemma3", "gemma3-f16")])
def test_the_gguf_tokenizer_gives_the_hf_tokenizers_ids(family, name):
    """The tokenizer rebuilt from the GGUF's metadata (llama.cpp wrote it: Qwen's `qwen2` byte-level BPE, Gemma's
    SentencePiece with byte fallback and no space prefix) against `tokenizers` on the source's tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer
    hf = HFTokenizer.from_file(str(DATA / f"{family}.tokenizer.json"))
    tok = open_checkpoint(DATA / f"{name}.gguf").tokenizer()
    for text in TRICKY:
        assert tok.encode(text) == hf.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text).ids), text
    ids = hf.encode("".join(TRICKY)).ids
    assert len(set(ids)) > 50      # the vocabulary is exercised, not just bytes


@pytest.mark.parametrize("name", ["qwen2-q8_0", "gemma3-q8_0"])
def test_the_gguf_from_flash_gives_the_dense_tokens_at_every_budget(name, tmp_path, monkeypatch,
                                                                   float32_activations):
    """Its FLASHDIR (the GGUF's gate/up blocks kept, down as columns) in oracle mode gives the FLASHDIR's dense greedy
    tokens, and the same bits at every DRAM budget. With float32 activations: the dense FFN is the GGUF's row
    kernel, which rounds the coefficients to 8-bit blocks before the down product (llama.cpp's numerics,
    test_a_k_quant_gguf_and_its_flashdir_compute_one_function), where the sparse kernels sum c * w in float32."""
    ids = recorded(name)["ids"].tolist()
    flash = convert(DATA / f"{name}.gguf", tmp_path / "flash", progress=False)
    dense, _, rt = load_runtime(flash, "dense")
    assert rt is None
    want = greedy_tokens(dense, ids, 32)
    model, _, rt = load_runtime(flash, "oracle")
    assert rt is not None and greedy_tokens(model, ids, 32) == want
    assert_same_bits_at_every_budget(flash, "oracle", ids, 8, monkeypatch)


@pytest.mark.parametrize("name", [n for n in FIXTURES if weight_type(n) in K_QUANT_MIXES])
def test_a_k_quant_gguf_and_its_flashdir_compute_one_function(name, tmp_path):
    """--ffn dense on a GGUF in llama.cpp's K-quants (its quantizer's Q4_K_M) and on its FLASHDIR (convert, dtype
    auto: the gate/up blocks kept, the down blocks kept exactly as columns) compute one function, the GGUF's: eval
    prints the same perplexity, and that is the perplexity of the runtime's dense model on the GGUF (8-bit
    activations, as llama.cpp); generate's greedy tokens are the same, and so are the logits, bit for bit, of the
    prompt and of every decoded token.
    (The FLASHDIR's dense FFN summed its down columns in float32 where the GGUF's row kernel rounds the coefficients
    to q8_K blocks, and eval's dense reference dequantized the GGUF's matrices where the FLASHDIR's kept theirs.)"""
    gguf = DATA / f"{name}.gguf"
    flash = convert(gguf, tmp_path / "flash", progress=False)
    layout = read_layout(flash)
    assert {layout.down_column(i) for i in range(layout.n_layers)} == {"q4_k", "q6_k"}   # both, exactly
    corpus = DATA.parent / "corpus" / "wikitext2_test.txt"
    printed = []
    for path in (gguf, flash):
        r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "eval", "-m", str(path), "--ffn", "dense",
                            "--tokens", "200", "--ctx", "100", "--corpus", str(corpus)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        printed.append(re.search(r"perplexity=(\S+)", r.stdout)[1])
    assert printed[0] == printed[1], printed
    # the oracle of what eval printed: the runtime's dense model on the GGUF, each segment as one batch
    gguf_model, tokenizer, _ = load_runtime(gguf, "dense")
    segments = list(token_segments(tokenizer, corpus.read_text(encoding="utf-8"), 200, 100, gguf_model.cfg.bos_id))
    nll = 0.0
    for w in segments:
        z = gguf_model.forward(w, gguf_model.new_cache(len(w)), all_logits=True)[:-1].astype(np.float64)
        z -= z.max(axis=-1, keepdims=True)
        nll -= float((z[np.arange(len(w) - 1), w[1:]] - np.log(np.exp(z).sum(axis=-1))).sum())
    assert f"{np.exp(nll / sum(len(w) - 1 for w in segments)):.4f}" == printed[0]
    runs = []
    for model in (gguf_model, load_runtime(flash, "dense")[0]):
        ids = recorded(name)["ids"].tolist()
        kv = model.new_cache(64)
        logits = [model.forward(ids, kv, all_logits=True)]
        for _ in range(16):
            ids.append(int(np.argmax(logits[-1][-1])))
            logits.append(model.forward(ids[-1:], kv)[None])
        runs.append((ids, np.concatenate(logits)))
    assert runs[0][0] == runs[1][0] and len(set(runs[0][0][-16:])) > 3
    assert np.array_equal(runs[0][1], runs[1][1]), np.abs(runs[0][1] - runs[1][1]).max()


def test_an_unsupported_gguf_architecture_is_one_line_naming_the_supported(tmp_path):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError) as e:
        open_checkpoint(tmp_path / "phi3.gguf")
    assert str(e.value) == "unsupported GGUF architecture 'phi3' (supported: llama, qwen2, qwen3, gemma3, qwen2moe, qwen3moe)"
