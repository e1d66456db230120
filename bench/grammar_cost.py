"""Issue 46: a grammar's mask per token on CPU with a 152k vocabulary: llguidance (as constrain.Constraint runs it),
xgrammar, outlines-core, lm-format-enforcer. Each is a row in its own process (harness.run_row): its view of the GGUF's
vocabulary (once per model), one JSON schema compiled (once per request), then per token of a document the schema
allows: the mask, the forbidden logits set to -inf (the same numpy for all), the document's token (must be allowed)
consumed. CPU time (all threads) compares on a busy machine; the ratio is to the cheapest CPU time per token.
    PYTHONPATH=. python bench/grammar_cost.py GGUF [--rounds 3] [--md FILE]"""
import argparse
import json
import sys
import time

from harness import add_arguments, emit, fmt, failed, machine, run_row, table, work_dir, command, np

LIBRARIES = ("llguidance", "xgrammar", "outlines-core", "lm-format-enforcer")
OBJ = {"type": "object", "additionalProperties": False}
SCHEMA = {**OBJ, "required": ["name", "address", "tags", "size", "score"], "properties": {   # in the document's order
    "name": {"type": "string", "maxLength": 40},
    "address": {**OBJ, "required": ["city", "zip"], "properties": {"city": {"type": "string"},
                                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}, "size": {"enum": ["S", "M", "L", "XL"]},
    "score": {"type": "number", "minimum": 0}}}
DOCUMENT = {"name": "Ada Lovelace", "address": {"city": "London", "zip": "12345"},
            "tags": ["mathematics", "engines", "poetry"], "size": "M", "score": 97.5}


def byte_vocab(tok) -> dict[bytes, list[int]]:
    """token bytes -> ids of a byte-level BPE vocabulary (GPT-2's byte-to-character map undone), special tokens out."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + k): b for k, b in enumerate(b for b in range(256) if b not in printable)})
    specials = {t.content for t in tok.tok.get_added_tokens_decoder().values() if t.special}
    out: dict[bytes, list[int]] = {}
    for text, i in tok.tok.get_vocab(with_added_tokens=True).items():
        if text not in specials:
            raw = bytes(chars[c] for c in text) if all(c in chars for c in text) else text.encode()
            out.setdefault(raw, []).append(i)
    return out


def vocabulary(lib: str, tok, vocab: int, eos: int):
    """The library's view of the vocabulary: built once per model."""
    if lib == "llguidance":
        from flashinfer_lite.constrain import ll_tokenizer
        return ll_tokenizer(tok, vocab)
    if lib == "xgrammar":
        import transformers
        import xgrammar as xgr
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok)
        return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos]))
    if lib == "outlines-core":
        from outlines_core import Vocabulary
        return Vocabulary(eos, byte_vocab(tok))
    from lmformatenforcer import TokenEnforcerTokenizerData
    # its transformers integration's token list (that module fails to import under transformers 5), by our tokenizer
    zero = tok.encode("0", add_special_tokens=False)[-1]
    special = {i for i, t in tok.tok.get_added_tokens_decoder().items() if t.special}
    regular = [(i, after, len(after) > len(tok.decode([i]))) for i in range(tok.tok.get_vocab_size())
               if i not in special for after in [tok.decode([zero, i])[1:]]]
    return TokenEnforcerTokenizerData(regular, lambda ids: tok.decode(ids).rstrip("\ufffd"), eos, False, vocab)


def unpack(bits, vocab: int) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), count=vocab, bitorder="little").view(bool)
def matcher(lib: str, view, tok, vocab: int, eos: int):
    """(mask() -> bool [vocab], advance(token)) of SCHEMA compiled anew (a request's cost)."""
    schema = json.dumps(SCHEMA)
    if lib == "llguidance":
        from flashinfer_lite.constrain import Constraint, json_schema_grammar
        c, history = Constraint(tok, json_schema_grammar(schema), vocab), [eos]
        return (lambda: c.allowed(history)), history.append
    if lib == "xgrammar":
        import xgrammar as xgr
        m = xgr.GrammarMatcher(view.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": ")))
        bits = xgr.allocate_token_bitmask(1, vocab)
        return (lambda: (m.fill_next_token_bitmask(bits), unpack(bits.numpy()[0], vocab))[1]), m.accept_token
    if lib == "outlines-core":
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema
        guide = Guide(Index(build_regex_from_schema(schema, whitespace_pattern=r"[ ]?"), view))
        bits = np.zeros((vocab + 31) // 32, np.int32)
        return (lambda: (guide.write_mask_into(bits.ctypes.data, bits.size, 4), unpack(bits, vocab))[1]), guide.advance
    from lmformatenforcer import JsonSchemaParser, TokenEnforcer
    te, prefix = TokenEnforcer(view, JsonSchemaParser(SCHEMA)), [eos]
    allowed = (lambda: np.asarray(te.get_allowed_tokens(prefix).allowed_tokens, np.int64))
    return (lambda: np.bincount(allowed(), minlength=vocab).astype(bool)), prefix.append


def since(t=(0.0, 0.0)) -> tuple[float, float]:    # (CPU s of every thread, wall s) since t; since(): now
    return time.process_time() - t[0], time.perf_counter() - t[1]


def measure(gguf: str, lib: str, rounds: int) -> dict:
    from storage.checkpoint import open_checkpoint
    ck = open_checkpoint(gguf)
    tok, vocab = ck.tokenizer(), ck.config.vocab_size
    eos, ids = tok.eos_ids[0], tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    logits = np.random.default_rng(0).normal(0, 4, vocab).astype(np.float32)
    t = since()
    view = vocabulary(lib, tok, vocab, eos)
    view_cpu = since(t)[0]
    compile_cpu, cpu, wall = [], [], []
    for _ in range(rounds):
        t = since()
        mask, advance = matcher(lib, view, tok, vocab, eos)
        compile_cpu.append(since(t)[0])
        for tid in ids:
            t = since()
            ok = mask()
            masked = np.where(ok, logits, np.float32(-np.inf))
            c, w = since(t)
            cpu, wall = cpu + [c], wall + [w]
            if not ok[tid] or masked[tid] != logits[tid]:
                raise AssertionError(f"{lib} forbids token {tid} of the document")
            advance(tid)
    ms = (lambda xs, q=None: round(1e3 * (sum(xs) / len(xs) if q is None else float(np.percentile(xs, q))), 3))
    return {"vocab": vocab, "document_tokens": len(ids), "vocabulary_cpu_s": round(view_cpu, 3),
            "compile_cpu_ms": ms(compile_cpu), "cpu_ms_per_token": ms(cpu), "wall_ms_per_token": ms(wall),
            "wall_p50_ms": ms(wall, 50), "wall_p99_ms": ms(wall, 99)}


def markdown(doc: dict) -> str:
    rows = doc["rows"]
    best = min((r["cpu_ms_per_token"] for r in rows if "cpu_ms_per_token" in r), default=1)
    out = table(["library", "CPU ms/token", "x cheapest", "wall ms/token", "P50", "P99", "vocabulary CPU s",
                 "schema CPU ms", "peak RSS MiB"],
                [[r["mode"], fmt(r["cpu_ms_per_token"], 3), fmt(r["cpu_ms_per_token"] / best, 1),
                  fmt(r["wall_ms_per_token"], 3), fmt(r["wall_p50_ms"], 3), fmt(r["wall_p99_ms"], 3),
                  fmt(r["vocabulary_cpu_s"], 2), fmt(r["compile_cpu_ms"], 1), fmt(r["peak_rss_bytes"] / 2**20, 0)]
                 if "cpu_ms_per_token" in r else [r["mode"], failed(r), *["-"] * 7] for r in rows])
    return "\n".join([f"`{doc['command']}`; load average {doc['machine']['load_avg_start']}", "", *out])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", help="a GGUF whose tokenizer to use (Qwen2.5's: 152k)")
    ap.add_argument("--rounds", type=int, default=3, help="walks of the document per library (default 3)")
    ap.add_argument("--libraries", default=",".join(LIBRARIES))
    add_arguments(ap)
    a = ap.parse_args(argv)
    if a.worker:
        from harness import worker
        return worker(a.out, a.worker, lambda: measure(a.gguf, a.worker, a.rounds))
    work = work_dir(a, "grammar_cost.")
    rows = [run_row(__file__, lib, lib, None, work, [a.gguf, "--rounds", a.rounds]) for lib in a.libraries.split(",")]
    return emit({"command": command("grammar_cost.py", argv), "machine": machine(), "schema": SCHEMA, "rows": rows},
                markdown, a.md, None if a.keep else work)


if __name__ == "__main__":
    sys.exit(main())
