"""Constrained decoding: a grammar (a JSON schema, Lark or GBNF) masks the logits before each token is sampled, so the
output stays inside it. The masks are llguidance's (Rust, no Python dependencies; bench/grammar_cost.py measured it
against xgrammar, outlines-core and lm-format-enforcer on a 152k vocabulary: docs/STRUCTURED.md says why this one).

A Constraint is a logits processor as mlx-lm's `logits_processors` take them: a callable (history ids, logits [V]) ->
logits, run by the Sampler after its repetition penalty and before top-k, top-p, min-p and the temperature. Its
done() tells Session.generate when the grammar is complete and allows nothing more: the output ends there, one forward
pass earlier than sampling the end-of-sequence token would.
"""
from __future__ import annotations

import json
import weakref

import numpy as np

from storage.errors import UserError

# JSON spelt as json.dumps spells it (", " and ": ", no other whitespace): a small model given free whitespace can fill
# its answer with newlines, and this is the spelling models see most in their training text
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
INSTALL = "pip install llguidance"

_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GrammarError(UserError, ValueError):
    """A grammar or schema llguidance refuses, or an output that left it: the server answers it with a 400."""


def llguidance():
    """The llguidance module, or one line saying how to install it."""
    try:
        import llguidance
    except ImportError:
        raise UserError(f"structured output (a JSON schema or a grammar) needs llguidance: {INSTALL}") from None
    return llguidance


def checked(grammar: str) -> str:
    """grammar (llguidance's form) when llguidance accepts it, else GrammarError with its message. Needs no tokenizer,
    so a command refuses a bad grammar before its model loads."""
    error = llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"the grammar is refused: {error}")
    return grammar


def json_schema_grammar(schema) -> str:
    """The grammar of the JSON documents a JSON schema (a dict, a bool or its text) allows."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object (or true/false)")
    try:
        return checked(llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
    except ValueError as e:
        raise GrammarError(f"the JSON schema is refused: {e}") from None


def text_grammar(text: str) -> str:
    """The grammar of a GBNF (llama.cpp's) or Lark (llguidance's) grammar text: llguidance tells them apart."""
    try:
        return checked(llguidance().grammar_from("grammar", text))
    except ValueError as e:
        raise GrammarError(f"the grammar is refused: {e}") from None


def ll_tokenizer(tokenizer, n_vocab: int):
    """llguidance's view of the model's vocabulary (its token trie), built once per tokenizer: ~1 s and ~100 MiB for a
    152k vocabulary. Built from the tokenizer's own `tokenizers` JSON, so byte-level and SentencePiece vocabularies
    alike spell their tokens' bytes as the model does; n_vocab is the logits' width, which may pass the vocabulary's."""
    found = _LL_TOKENIZERS.get(tokenizer)
    if found is None or found.vocab_size != n_vocab:
        try:
            found = llguidance().LLTokenizer(tokenizer.tok.to_str(), n_vocab=n_vocab, eos_token=tokenizer.eos_ids or None)
        except ValueError as e:
            raise UserError(f"llguidance cannot read this model's vocabulary: {e}") from None
        _LL_TOKENIZERS[tokenizer] = found
    return found


class Constraint:
    """One generation's grammar, as a logits processor. The first call's history is the prompt; each later call feeds
    the matcher the tokens sampled since, then masks every token the grammar does not allow next (-inf)."""

    def __init__(self, tokenizer, grammar: str, n_vocab: int):
        ll = llguidance()
        self.matcher = ll.LLMatcher(ll_tokenizer(tokenizer, n_vocab), grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar is refused: {self.matcher.get_error()}")
        self.tokenizer, self.grammar, self.n_vocab = tokenizer, grammar, n_vocab
        self.bits = np.zeros((n_vocab + 31) // 32, np.int32)     # llguidance's mask: bit i of word i // 32
        self.start: int | None = None        # where the output begins in the history
        self.fed = 0                         # output tokens the matcher has consumed

    def feed(self, history) -> None:
        if self.start is None:
            self.start = len(history)
        for t in history[self.start + self.fed:]:
            if not self.matcher.consume_token(int(t)):
                raise GrammarError(f"token {t} is outside the grammar: {self.matcher.get_error()}")
            self.fed += 1

    def allowed(self, history) -> np.ndarray:
        """bool [n_vocab]: the tokens the grammar allows after history."""
        self.feed(history)
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed: {self.matcher.get_error()}")
        return np.unpackbits(self.bits.view(np.uint8), count=self.n_vocab, bitorder="little").view(bool)

    def __call__(self, history, logits: np.ndarray) -> np.ndarray:
        ok = self.allowed(history)[:len(logits)]
        if not ok.any():
            raise GrammarError("the grammar allows no next token")
        return np.where(ok, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def done(self, history) -> bool:
        """The grammar is complete and allows nothing more (only the end of the sequence) after history."""
        self.feed(history)
        return self.matcher.is_stopped()

    def accepts(self) -> bool:
        """The output so far is a whole sentence of the grammar."""
        return self.matcher.is_accepting()
