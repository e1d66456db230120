"""A llama-architecture GGUF with a SentencePiece (`llama`) vocabulary, as ReluLLaMA / ProSparse GGUFs ship: written
here with the gguf package from stories260K (whose HF tokenizer is SentencePiece-style BPE with byte fallback), then
read back by our loader. Oracles: the HF tokenizer.json and the HF checkpoint of the same weights."""
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import STORIES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from make_large_model import spm_vocab  # noqa: E402
from storage.checkpoint import open_checkpoint
from flashinfer_lite.loader import load


TEXTS = ["Once upon a time, there was a little girl named Lily.", "  two  spaces\nand a newline!",
         "Zebra quizzed 123 émigrés", "<s>not a control token</s>"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's converter does to q/k rows (pairs rotary dims adjacently); the loader must undo it.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    import gguf
    ckpt = open_checkpoint(STORIES)
    c = ckpt.config
    # SentencePiece scores: a token made by an earlier merge scores higher; the loader rebuilds merges from them.
    tokens, scores, types = spm_vocab(STORIES / "tokenizer.json")
    path = tmp_path_factory.mktemp("gguf") / "stories-spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.n_layers)
    w.add_context_length(c.max_pos)
    w.add_embedding_length(c.dim)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    names = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    for i in range(c.n_layers):
        names.update({f"layers.{i}.attn_norm.weight": f"blk.{i}.attn_norm.weight",
                      f"layers.{i}.ffn_norm.weight": f"blk.{i}.ffn_norm.weight",
                      f"layers.{i}.attn.q.weight": f"blk.{i}.attn_q.weight",
                      f"layers.{i}.attn.k.weight": f"blk.{i}.attn_k.weight",
                      f"layers.{i}.attn.v.weight": f"blk.{i}.attn_v.weight",
                      f"layers.{i}.attn.o.weight": f"blk.{i}.attn_output.weight",
                      f"layers.{i}.ffn.gate.weight": f"blk.{i}.ffn_gate.weight",
                      f"layers.{i}.ffn.up.weight": f"blk.{i}.ffn_up.weight",
                      f"layers.{i}.ffn.down.weight": f"blk.{i}.ffn_down.weight"})
    for ours, theirs in names.items():
        t = ckpt.tensor(ours)
        if ours.endswith("attn.q.weight"):
            t = llama_cpp_permute(t, c.n_heads)
        elif ours.endswith("attn.k.weight"):
            t = llama_cpp_permute(t, c.n_kv_heads)
        w.add_tensor(theirs, np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sentencepiece_gguf_tokenizer_equals_the_hf_tokenizer(spm_gguf):
    from tokenizers import Tokenizer as HFTokenizer
    hf = HFTokenizer.from_file(str(STORIES / "tokenizer.json"))
    tok = open_checkpoint(spm_gguf).tokenizer()
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text).ids), text


def test_sentencepiece_gguf_weights_equal_the_hf_checkpoint(spm_gguf):
    ids = [1, 403, 407, 261, 378, 432, 383]
    from_gguf, _ = load(spm_gguf)
    la = from_gguf.forward(ids, from_gguf.new_cache(16), all_logits=True)
    from_hf, _ = load(STORIES)
    lb = from_hf.forward(ids, from_hf.new_cache(16), all_logits=True)
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-5)  # q/k un-permuted correctly, tied embeddings detected
