"""tools/make_large_model.py --gguf: a tiny model written as HF safetensors and as f16 / Q4_0 GGUF holds the same
weights. Oracles: the HF copy read by storage.checkpoint (f16: bit-equal; Q4_0: the gguf package's reference
quantizer applied to the HF values), and, where llama_cpp imports, llama.cpp's logits on the GGUF against
flashinfer-lite's dense float32 model of the same file (GGUF's llama computes SwiGLU, in both engines)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from storage.checkpoint import open_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "tiny"
    p = subprocess.run([sys.executable, str(REPO / "tools" / "make_large_model.py"), str(out), "--layers", "2",
                        "--dim", "64", "--ffn", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
                        "--gguf", "f16,q4_0", "--check-tokens", "0"], env=dict(os.environ, PYTHONPATH=str(REPO)),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads(p.stdout)
    assert info["gguf_f16"] == str(out / "model.f16.gguf") and info["gguf_q4_0"] == str(out / "model.q4_0.gguf")
    return out


def test_gguf_holds_the_hf_weights(tiny):
    import gguf
    Q = gguf.GGMLQuantizationType
    hf = open_checkpoint(tiny)
    f16, q4 = open_checkpoint(tiny / "model.f16.gguf"), open_checkpoint(tiny / "model.q4_0.gguf")
    assert sorted(f16.names()) == sorted(q4.names()) == sorted(hf.names())
    for c in (f16.config, q4.config):
        assert (c.n_layers, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == \
            (2, 64, 128, 2, 1, 32, 512)
        assert c.act == "silu" and hf.config.act == "relu"       # FATReLU has no GGUF spelling
    for name in hf.names():
        want = hf.tensor(name)                                   # float16 values, widened
        assert np.array_equal(f16.tensor(name), want), name
        if want.ndim == 1:
            assert np.array_equal(q4.tensor(name), want), name   # norms stay float32
        else:
            ref = gguf.quants.dequantize(gguf.quants.quantize(want.astype(np.float16), Q.Q4_0), Q.Q4_0)
            assert np.array_equal(q4.tensor(name), ref.reshape(want.shape)), name
    assert (tiny / "model.q4_0.gguf").stat().st_size < 0.4 * (tiny / "model.f16.gguf").stat().st_size


@pytest.mark.parametrize("kind, atol", [("f16", 1e-2), ("q4_0", 0.2)])
def test_llama_cpp_runs_the_gguf(tiny, kind, atol):
    try:
        import llama_cpp
    except Exception as e:
        pytest.skip(f"llama_cpp does not import: {e}")
    sys.path.insert(0, str(REPO))
    from bench.harness import llama_model
    from flashinfer_lite.model import load_reference
    path = tiny / f"model.{kind}.gguf"
    model, tok = load_reference(path)
    ids = tok.encode("Once upon a time")
    ours = model.forward(ids, model.new_cache(32)).reshape(-1)[-512:]
    llm = llama_model(path, 32, 2)
    assert llm.tokenize(b"Once upon a time") == ids
    llm.eval(ids)
    theirs = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    # llama.cpp rounds activations to f16 (f16 weights) or 8-bit blocks (Q4_0 weights) before each matmul
    np.testing.assert_allclose(theirs, ours, atol=atol)
