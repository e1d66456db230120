"""A llama-architecture GGUF with a SentencePiece (`llama`) vocabulary, as ReluLLaMA / ProSparse GGUFs ship: written
here with the gguf package from stories260K (whose HF tokenizer is SentencePiece-style BPE with byte fallback), then
read back by our loader. Oracles: the HF tokenizer.json and the HF checkpoint of the same weights."""
import numpy as np
import pytest

from conftest import STORIES, write_llama_gguf
from storage.checkpoint import open_checkpoint
from flashinfer_lite.model import load_reference


TEXTS = ["Once upon a time, there was a little girl named Lily.", "  two  spaces\nand a newline!",
         "Zebra quizzed 123 émigrés", "<s>not a control token</s>"]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    return write_llama_gguf(open_checkpoint(STORIES), tmp_path_factory.mktemp("gguf") / "stories-spm.gguf")


def test_sentencepiece_gguf_tokenizer_equals_the_hf_tokenizer(spm_gguf):
    from tokenizers import Tokenizer as HFTokenizer
    hf = HFTokenizer.from_file(str(STORIES / "tokenizer.json"))
    tok = open_checkpoint(spm_gguf).tokenizer()
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text).ids), text


def test_sentencepiece_gguf_weights_equal_the_hf_checkpoint(spm_gguf):
    ids = [1, 403, 407, 261, 378, 432, 383]
    from_gguf, _ = load_reference(spm_gguf)
    la = from_gguf.forward(ids, from_gguf.new_cache(16), all_logits=True)
    from_hf, _ = load_reference(STORIES)
    lb = from_hf.forward(ids, from_hf.new_cache(16), all_logits=True)
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-5)  # q/k un-permuted correctly, tied embeddings detected
