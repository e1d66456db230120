"""Make tests/data/gguf: tiny random Qwen2, Qwen3 and Gemma 3 models converted to GGUF by llama.cpp's own converter
(and one quantized into K-quants by its own quantizer), with llama.cpp's logits on each file recorded next to it, so
that the tests compare against llama.cpp without it.

    python tools/make_gguf_fixtures.py LLAMA_CPP_DIR [-o tests/data/gguf] [--only NAME ...]

LLAMA_CPP_DIR: a llama.cpp checkout (or the vendor/llama.cpp of the llama-cpp-python sdist) holding
convert_hf_to_gguf.py, its conversion/ package and gguf-py/. Needs torch, transformers, sentencepiece and
llama-cpp-python (the `bench` extra) to run; the tests that read what it writes need none of them.

Each model gets a real tokenizer, trained here on the corpus excerpts in tests/data/corpus (no tokenizer file of
these families ships with an installed package):
- Qwen2/Qwen3: transformers' Qwen2Tokenizer (byte-level BPE, NFC, Qwen2's split regex as transformers defines it)
  over merges learned on the corpus with the `tokenizers` library, with Qwen's special tokens. llama.cpp names a BPE
  pre-tokenizer by hashing the ids of a test string, which only the real 151k vocabulary reproduces, so its converter
  is told "qwen2" when its hash check does not know ours.
- Gemma 3: a SentencePiece BPE with byte fallback and no dummy prefix, Gemma's special tokens (<pad> <eos> <bos>
  <unk>, <start_of_turn> <end_of_turn>), trained with `sentencepiece`; its tokenizer.json is transformers' conversion
  of the same tokenizer.model, as Google's repositories ship both.

Written per model NAME: NAME.gguf and NAME.llama_cpp.npz (ids: the prompt; greedy: the prompt then llama.cpp's 32
greedy tokens; logits [len(greedy), V]: llama.cpp's logits at each position of greedy, the prompt's evaluated as one
batch, then each greedy token's as it was decoded), and per family the HF tokenizer of the source directory
(qwen.tokenizer.json, gemma3.tokenizer.json: the same for every model of the family, trained deterministically);
NAME.transformers.npz: transformers' greedy tokens on the float32 source directory (greedy) and its logits where it
chose each (logits [32, V], float16).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CORPUS = [REPO / "tests/data/corpus" / f for f in ("tinystories_cased_197KB.txt", "wikitext2_valid.txt")]
PROMPT = "Once upon a time, there was a robot. 1, 2, 3"
GREEDY_TOKENS = 32
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GEMMA_TURNS = ["<start_of_turn>", "<end_of_turn>"]

# name -> (family, llama.cpp --outtype, config fields). dim 64, 4 heads: a few hundred KB per file. Gemma 3 has 6
# layers because llama.cpp reads no layer pattern from a gemma3 GGUF: every 6th layer is global.
MODELS = {
    "qwen2-f16": ("qwen2", "f16", dict(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-q8_0": ("qwen2", "q8_0", dict(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-f32": ("qwen3", "f32", dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=24,
                                       tie_word_embeddings=True)),
    "qwen3-q8_0": ("qwen3", "q8_0", dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=24,
                                         tie_word_embeddings=False)),
    "gemma3-f16": ("gemma3", "f16", dict(num_hidden_layers=6, num_key_value_heads=2, head_dim=16,
                                         query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=1.0)),
    "gemma3-q8_0": ("gemma3", "q8_0", dict(num_hidden_layers=6, num_key_value_heads=2, head_dim=16,
                                           query_pre_attn_scalar=16, sliding_window=8)),
    # llama.cpp's K-quants need rows of 256 weights: dim 256, ffn 512. Converted to F32, then quantized by
    # llama.cpp's own quantizer (llama_model_quantize) into its Q4_K_M mix, as it picks the kinds: q4_k attention
    # and gate/up, down q4_k in layer 0 and q6_k in layer 1, the embeddings (tied) q6_k
    "qwen2-q4_k_m": ("qwen2", "q4_k_m", dict(num_hidden_layers=2, num_key_value_heads=1, hidden_size=256,
                                             intermediate_size=512, tie_word_embeddings=True)),
}
# outtypes that llama.cpp's converter does not write: F32 first, then llama_model_quantize into this llama_ftype
QUANTIZE = {"q4_k_m": 15}


def qwen_tokenizer(dest: Path) -> int:
    """transformers' Qwen2Tokenizer (its byte-level BPE, NFC, pre-tokenizer regex) over merges learned on the corpus
    with that same split; returns the vocabulary size."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.NFC()
    learner.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    learner.train([str(f) for f in CORPUS], trainers.BpeTrainer(
        vocab_size=800, special_tokens=QWEN_SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    learned = json.loads(learner.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=learned["vocab"], merges=[tuple(m) for m in learned["merges"]],
                         unk_token=None, eos_token="<|im_end|>", extra_special_tokens=["<|im_start|>"])
    tok.save_pretrained(dest)
    return len(tok)


def gemma_tokenizer(dest: Path) -> int:
    """A SentencePiece BPE with Gemma's settings and special tokens, and transformers' tokenizer.json of it."""
    import sentencepiece as spm
    from transformers import AutoTokenizer
    text = dest / "corpus.txt"
    text.write_text("\n".join(f.read_text(encoding="utf-8") for f in CORPUS), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(dest / "tokenizer"), model_type="bpe", vocab_size=640,
        byte_fallback=True, add_dummy_prefix=False, split_digits=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
        eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", user_defined_symbols=GEMMA_TURNS,
        character_coverage=1.0, minloglevel=2)
    text.unlink()
    (dest / "tokenizer.vocab").unlink()
    (dest / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GemmaTokenizer",
                                                            "add_bos_token": True}))
    tok = AutoTokenizer.from_pretrained(dest, mask_token=None, extra_special_tokens=GEMMA_TURNS)
    tok.save_pretrained(dest)                                     # transformers' conversion: tokenizer.json
    # and its special tokens listed in tokenizer_config.json, as Google's Gemma 3 repositories do (llama.cpp's
    # converter reads their types there)
    added = json.loads((dest / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    config = json.loads((dest / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {str(t.pop("id")): t for t in added}
    (dest / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return spm.SentencePieceProcessor(model_file=str(dest / "tokenizer.model")).get_piece_size()


def build_model(family: str, extra: dict, dest: Path, seed: int) -> None:
    """A seeded random transformers model with a tokenizer, saved as an HF directory (safetensors, float32)."""
    import torch
    import transformers as tf
    vocab = qwen_tokenizer(dest) if family.startswith("qwen") else gemma_tokenizer(dest)
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    common = {k: v for k, v in common.items() if k not in extra}
    if family == "gemma3":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(pad_token_id=0, eos_token_id=1, bos_token_id=2,
                                                         **common, **extra))
    else:
        cls_cfg, cls = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[family]
        model = cls(cls_cfg(bos_token_id=None, eos_token_id=QWEN_SPECIAL.index("<|im_end|>"), **common, **extra))
    with torch.no_grad():   # biases and norms off their 0/1 init, and an FFN loud enough to matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if "mlp" in name and name.endswith("weight"):
                p.mul_(8.0)
    model.eval().save_pretrained(dest, safe_serialization=True)


CONVERT = """
import sys, runpy
llama = sys.argv[1]
sys.path[:0] = [llama, llama + "/gguf-py"]
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:   # our tiny vocabulary's hash: the pre-tokenizer it was built with
        return "qwen2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [llama + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def quantize(src: Path, dest: Path, ftype: int) -> None:
    """src quantized into dest by llama.cpp's quantizer (as tools/make_kquants.py, from a float file here)."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dest).encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize failed for {dest.name}")


def llama_cpp_outputs(gguf_path: Path, ids: list[int]) -> dict:
    """llama.cpp's greedy continuation of ids and its logits at every position, through llama-cpp-python."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(gguf_path), n_ctx=256, n_batch=256, logits_all=True, verbose=False, n_threads=1,
                seed=0)
    llm.eval(ids)
    out = list(ids)
    for _ in range(GREEDY_TOKENS):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return dict(ids=np.array(ids, np.int64), greedy=np.array(out, np.int64),
                logits=np.array(llm.scores[:len(out)], np.float32))


def transformers_outputs(hf: Path, ids: list[int]) -> dict:
    """transformers' greedy continuation of ids on the float32 source, and its logits (float16: what a near tie needs)
    where it chose each of the 32 tokens."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                             do_sample=False)[0]
        logits = model(out[None]).logits[0, len(ids) - 1:-1].numpy()
    return dict(greedy=out.numpy().astype(np.int64), logits=logits.astype(np.float16))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("llama_cpp", type=Path, help="llama.cpp source directory (convert_hf_to_gguf.py, conversion/, "
                                                 "gguf-py/)")
    ap.add_argument("-o", "--out", type=Path, default=REPO / "tests/data/gguf")
    ap.add_argument("--only", nargs="*", choices=sorted(MODELS), help="make only these")
    args = ap.parse_args(argv)
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        print(f"error: no convert_hf_to_gguf.py in {args.llama_cpp}", file=sys.stderr)
        return 1
    from transformers import AutoTokenizer
    args.out.mkdir(parents=True, exist_ok=True)
    for seed, (name, (family, outtype, extra)) in enumerate(MODELS.items()):
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            hf = Path(tmp) / name
            hf.mkdir()
            build_model(family, extra, hf, seed)
            gguf_path = args.out / f"{name}.gguf"
            converted = Path(tmp) / "f32.gguf" if outtype in QUANTIZE else gguf_path
            subprocess.run([sys.executable, "-c", CONVERT, str(args.llama_cpp), str(hf), "--outfile", str(converted),
                            "--outtype", "f32" if outtype in QUANTIZE else outtype], check=True,
                           stdout=subprocess.DEVNULL)
            if outtype in QUANTIZE:
                quantize(converted, gguf_path, QUANTIZE[outtype])
            ids = AutoTokenizer.from_pretrained(hf)(PROMPT).input_ids
            np.savez(args.out / f"{name}.llama_cpp.npz", **llama_cpp_outputs(gguf_path, ids))
            np.savez(args.out / f"{name}.transformers.npz", **transformers_outputs(hf, ids))
            shutil.copy(hf / "tokenizer.json", args.out / f"{'qwen' if family.startswith('qwen') else family}"
                                                          f".tokenizer.json")
        print(f"{name}: {gguf_path.stat().st_size / 1024:.0f} KB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
