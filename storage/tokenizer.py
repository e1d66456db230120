"""Tokenizer and chat template: `tokenizers` does the text <-> ids work, jinja2 renders Hugging Face chat templates.

A GGUF file carries its vocabulary as metadata; we rebuild an equivalent `tokenizers` object from it so that every model,
whatever it came from, ends up with a standard tokenizer.json next to it.
"""
from __future__ import annotations

import functools
import json
import re
import sys
from datetime import datetime
from pathlib import Path

from .config import check_token_id
from .errors import UserError
from .untrusted import read_bytes, read_json

MAX_TOKENIZER_BYTES = 64 * 1024 * 1024
MAX_TEMPLATE_BYTES = 1 << 20      # the largest HF chat templates are ~20 KB
MIN_TEXT_CAP = 1 << 20            # text_cap's floor: a prompt (or corpus) of this many bytes is always read
LENGTH_CHECK_CHARS = 1 << 14      # check_length tokenizes this much text at a time

# Pre-tokenizer regexes by GGUF `tokenizer.ggml.pre` name: the splits each vocabulary's merges were learned on.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_GGUF_CONTROL, _GGUF_USER_DEFINED, _GGUF_BYTE = 3, 4, 6


def _token_text(t) -> str | None:
    if t is None:
        return None
    if isinstance(t, dict):
        return t.get("content")
    return str(t)


class Tokenizer:
    def __init__(self, tok, *, bos_id: int | None, eos_ids: list[int], chat_template: str | None):
        if chat_template is not None and not isinstance(chat_template, str):   # from a model file: anything
            raise UserError(f"the model's chat template is not a string (got {type(chat_template).__name__})")
        self.tok = tok
        self.bos_id = bos_id
        self.eos_ids = list(eos_ids)
        self.chat_template = chat_template
        self.bos_token = tok.id_to_token(bos_id) if bos_id is not None else None
        self.eos_token = tok.id_to_token(self.eos_ids[0]) if self.eos_ids else None

    # -- loading and saving ------------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: Path, config=None) -> "Tokenizer":
        """tokenizer.json (+ tokenizer_config.json, chat_template.jinja) as Hugging Face saves them."""
        from tokenizers import Tokenizer as HFTokenizer
        path = Path(path)
        tj = path / "tokenizer.json"
        if not (tj.exists() or tj.is_symlink()):
            raise UserError(f"no tokenizer.json in {path}")
        data = read_bytes(tj, "tokenizer.json", MAX_TOKENIZER_BYTES)
        try:
            tok = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as e:
            raise UserError(f"cannot read {tj}: {e}") from None
        tc = {}
        if (path / "tokenizer_config.json").exists() or (path / "tokenizer_config.json").is_symlink():
            tc = read_json(path / "tokenizer_config.json", "tokenizer_config.json")
        template = tc.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = path / "chat_template.jinja"
        if jinja.exists() or jinja.is_symlink():
            try:
                template = read_bytes(jinja, "chat_template.jinja", MAX_TEMPLATE_BYTES).decode("utf-8")
            except UnicodeDecodeError:
                raise UserError(f"chat_template.jinja is not valid UTF-8: {jinja}") from None
        bos_id = config.bos_id if config is not None else None
        eos_ids = list(config.eos_ids) if config is not None else []
        for key, ids in (("bos_token", None), ("eos_token", eos_ids)):
            tid = tok.token_to_id(_token_text(tc.get(key)) or "")
            if tid is None:
                continue
            if key == "bos_token" and bos_id is None:
                bos_id = tid
            if ids is not None and tid not in ids:
                ids.append(tid)
        return cls(tok, bos_id=bos_id, eos_ids=eos_ids, chat_template=template)

    @classmethod
    def from_gguf(cls, field, config) -> "Tokenizer":
        from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
        from tokenizers import Tokenizer as HFTokenizer
        # field(key, default) -> a GGUF metadata value, from the checkpoint reader
        kind = field("tokenizer.ggml.model")
        tokens = list(field("tokenizer.ggml.tokens") or [])
        types = list(field("tokenizer.ggml.token_type") or [1] * len(tokens))
        if not tokens:
            raise UserError("GGUF file has no tokenizer.ggml.tokens")
        vocab = {t: i for i, t in enumerate(tokens)}
        if kind == "gpt2":
            merges = gguf_merges(field("tokenizer.ggml.merges") or [])
            try:
                tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False))
            except Exception as e:      # a merge of tokens not in the vocabulary: the library's own message
                raise UserError(f"GGUF tokenizer.ggml.merges cannot build the tokenizer: {e}") from None
            pre = field("tokenizer.ggml.pre", "default")
            if pre in _GGUF_SPLITS:
                tok.pre_tokenizer = pre_tokenizers.Sequence([
                    pre_tokenizers.Split(Regex(_GGUF_SPLITS[pre]), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            elif pre == "smollm":  # llama.cpp: each digit alone, then GPT-2's split
                tok.pre_tokenizer = pre_tokenizers.Sequence([
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
            else:
                if pre not in ("default", "gpt2"):
                    print(f"note: GGUF pre-tokenizer '{pre}' unknown, using GPT-2's split", file=sys.stderr)
                tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            tok.decoder = decoders.ByteLevel()
            add_bos_default = False
        elif kind == "llama":
            scores = list(field("tokenizer.ggml.scores") or [0.0] * len(tokens))
            merges = spm_merges(tokens, scores, types)
            unk = field("tokenizer.ggml.unknown_token_id", 0)
            check_token_id("GGUF tokenizer.ggml.unknown_token_id", unk, len(tokens))
            tok = HFTokenizer(models.BPE(vocab, merges, unk_token=tokens[unk], fuse_unk=True, byte_fallback=True))
            prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
            steps = [normalizers.Prepend("\u2581")] if prefix else []
            tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                            + ([decoders.Strip(" ", 1, 0)] if prefix else []))
            add_bos_default = True
        else:
            raise UserError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _GGUF_USER_DEFINED])
        bos = config.bos_id
        if bos is not None:       # in the embeddings (ModelConfig checked), and a token of this vocabulary too
            check_token_id("GGUF tokenizer.ggml.bos_token_id", bos, len(tokens))
        for eos in config.eos_ids:
            check_token_id("GGUF tokenizer.ggml.eos_token_id", eos, len(tokens))
        if bool(field("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], bos)])
        eos_ids = list(config.eos_ids)
        eot = field("tokenizer.ggml.eot_token_id")
        if eot is not None:
            check_token_id("GGUF tokenizer.ggml.eot_token_id", eot, min(len(tokens), config.vocab_size))
            eos_ids += [eot] if eot not in eos_ids else []
        return cls(tok, bos_id=bos, eos_ids=eos_ids, chat_template=field("tokenizer.chat_template"))

    def save(self, path: Path) -> None:
        """tokenizer.json + tokenizer_config.json, readable back by from_dir and by Hugging Face."""
        path = Path(path)
        self.tok.save(str(path / "tokenizer.json"), pretty=False)    # half the bytes of the indented JSON
        cfg = {"bos_token": self.bos_token, "eos_token": self.eos_token, "chat_template": self.chat_template,
               "tokenizer_class": "PreTrainedTokenizerFast"}
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False), encoding="utf-8")

    # -- text <-> ids ----------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes a token of the vocabulary is spelled with. A token stands for at most that many
        bytes of text: byte-level vocabularies spell a byte with 1-2 bytes, SentencePiece spells a space as 3."""
        return max((len(t.encode("utf-8")) for t in self.tok.get_vocab()), default=1)

    def text_cap(self, n_tokens: int) -> int:
        """Bytes of text enough to hold n_tokens tokens (a prompt longer than a context's cap cannot fit in it)."""
        return max(MIN_TEXT_CAP, n_tokens * self.longest_token_bytes)

    def check_length(self, text: str, ctx: int) -> None:
        """Refuse a prompt of more than ctx tokens, tokenizing it a piece at a time, so that a long one is refused
        for the cost of its first pieces, not of all of it. A cut can change the tokens next to it (SentencePiece
        starts each piece with a space), so each piece is allowed a few more: the exact count is the caller's."""
        check_utf8(text, "input text")
        n = 0
        for k, piece in enumerate(corpus_chunks(text, LENGTH_CHECK_CHARS)):
            n += len(self.tok.encode(piece, add_special_tokens=False).ids)
            if n > ctx + 4 * (k + 1):
                raise PromptTooLong(f"prompt is too long (over {n - 4 * (k + 1)} tokens, context is {ctx}); "
                                f"raise -c or shorten the prompt")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_utf8(text, "input text")
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_after(self, context, ids) -> str:
        """The text ids add after context. SentencePiece decoders drop the leading space of the first piece, so a
        continuation decoded alone loses the space at the join ("Once upon" + "▁a" -> "Once upona")."""
        before = self.decode(context)
        text = self.decode(list(context) + list(ids))
        return text[len(before):] if text.startswith(before) else self.decode(ids)

    @functools.cached_property
    def _piece_bytes(self):
        """piece -> bytes for the vocabulary's decoder: byte-level BPE (GPT-2's alphabet of 256 printable characters,
        one a byte), else SentencePiece's (U+2581 a space, <0xNN> the byte NN)."""
        if type(self.tok.decoder).__name__ == "ByteLevel":
            printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
            shifted = [b for b in range(256) if b not in printable]
            byte_of = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}
            return lambda piece: bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) \
                else piece.encode("utf-8")
        byte = re.compile(r"<0x([0-9A-Fa-f]{2})>")
        return lambda piece: bytes([int(byte.fullmatch(piece).group(1), 16)]) if byte.fullmatch(piece) \
            else piece.replace("\u2581", " ").encode("utf-8")

    @functools.cached_property
    def _added_ids(self) -> set[int]:
        return set(self.tok.get_added_tokens_decoder())

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text one token stands for (a piece of a UTF-8 character, for some): an added token's own
        text, any other's piece through the decoder's alphabet."""
        piece = self.tok.id_to_token(int(token_id)) or ""
        return piece.encode("utf-8") if token_id in self._added_ids else self._piece_bytes(piece)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """tools: OpenAI's function tools ({"type": "function", "function": {...}}), as Hugging Face passes them."""
        if not self.chat_template:
            raise UserError("this model has no chat template (use `generate` with a plain prompt)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt, tools=tools,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        # The rendered template already spells BOS where the model wants it, as Hugging Face does.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False)

    @functools.cached_property
    def takes_tools(self) -> bool:
        """The chat template renders the tools it is given (Qwen2.5's and Llama 3.x's do; ChatML without them does
        not): a conversation renders differently with a tool than without. Rendered once per tokenizer."""
        msgs = [{"role": "user", "content": "hello"}]
        tool = {"type": "function", "function": {"name": "tool_probe", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}
        return bool(self.chat_template) and self.apply_chat_template(msgs, tools=[tool]) != \
            self.apply_chat_template(msgs)

    @functools.cached_property
    def template_opening(self) -> str:
        """What the chat template writes before the first role's name (ChatML's "<|im_start|>", Llama 3's
        "<|begin_of_text|><|start_header_id|>"): the mark of a prompt templated already. "" without a template, or
        when it starts with a role's name (nothing to tell a templated text by)."""
        if not self.chat_template:
            return ""
        text = self.apply_chat_template([{"role": "user", "content": "x"}])
        at = min((i for i in (text.find("system"), text.find("user")) if i >= 0), default=0)
        return text[:at] if text[:at].strip() else ""

    def is_templated(self, text: str) -> bool:
        """text starts with the template's own opening: apply_chat_template's output, not a plain prompt."""
        return bool(self.template_opening) and text.lstrip().startswith(self.template_opening)


class PromptTooLong(UserError):
    """A prompt of more tokens than the context holds (Tokenizer.check_length): a server answers it as
    context_length_exceeded, other input errors as plain bad requests."""


def check_utf8(text: str, what: str) -> None:
    """Text from argv or a file read with surrogateescape keeps undecodable bytes as lone surrogates: refuse them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{what} is not valid UTF-8 (bad byte at character {e.start})") from None


def gguf_merges(merges: list) -> list[tuple[str, str]]:
    """A GGUF's tokenizer.ggml.merges as pairs: each entry two tokens joined by one space ("Ġ t"), as llama.cpp writes
    it. Split in one pass and checked after (a 151k-merge vocabulary: 0.06 s less than a call per entry)."""
    try:
        pairs = [m.partition(" ")[::2] for m in merges]
    except AttributeError:          # an entry that is not a string
        pairs = [m.partition(" ")[::2] if isinstance(m, str) else ("", "") for m in merges]
    if not all(a and b for a, b in pairs):
        i = next(i for i, (a, b) in enumerate(pairs) if not (a and b))
        raise UserError(f"GGUF tokenizer.ggml.merges entry {i} is not two tokens separated by a space: "
                        f"{merges[i]!r:.80}")
    return pairs


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two known tokens, best score first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for t, score, ty in zip(tokens, scores, types):
        if ty in (_GGUF_CONTROL, _GGUF_BYTE) or len(t) < 2:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                found.append((-score, vocab[a], vocab[b], a, b))
    found.sort()
    return [(a, b) for _, _, _, a, b in found]


TEMPLATE_STEPS = 200_000      # lines of compiled template code one render may run (SmolLM2's template: 5 per message,
                              # so a conversation of 40000 messages)
TEMPLATE_CHARS = 1 << 20      # the most characters a render may output or build into one value, plus four times the
                              # messages' text


def value_size(v, limit: int) -> int:
    """Characters (or list items) of v with all it holds, counted as str() or tojson would spell them out: a list
    holding another twice, 40 levels deep, counts 2^40. The count stops once over limit: it costs at most limit
    steps."""
    n, todo = 0, [v]
    while todo and n <= limit:
        x = todo.pop()
        if isinstance(x, (str, bytes)):
            n += len(x)
        elif isinstance(x, int) and not isinstance(x, bool):
            n += x.bit_length() // 3 + 1          # decimal digits, roughly
        elif isinstance(x, (list, tuple, set, frozenset)):
            n += len(x) + 1
            todo.extend(x)
        elif isinstance(x, dict):
            n += len(x) + 1
            todo.extend(x.keys())
            todo.extend(x.values())
        else:
            n += 1
    return n


_LONG_NUMBER = re.compile(r"\d{8,}")   # a field width of 10^7 or more in a format string ("%99999999s")


def _sandbox(limit: int):
    """A jinja2 ImmutableSandboxedEnvironment whose renders are bounded (render_chat_template)."""
    import jinja2
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def refuse(what: str):
        raise UserError(f"chat template {what}; refusing it (the model file's template is not trusted)")

    def checked(v):
        if value_size(v, limit) > limit:
            refuse(f"builds a value of over {limit} characters")
        return v

    def check_arguments(args, kwargs):
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > limit:
                refuse(f"passes a number over {limit} ({a})")
            checked(a)

    def check_format(fmt):
        if isinstance(fmt, str) and _LONG_NUMBER.search(fmt):
            refuse(f"formats with a field width over 10^7 ({_LONG_NUMBER.search(fmt).group()})")

    def bounded(name, f):
        """A filter whose arguments and result are checked."""
        @functools.wraps(f)
        def run(*args, **kwargs):
            if name == "format":                  # "%99999999s"|format(x)
                check_format(next((a for a in args if isinstance(a, str)), None))
            check_arguments(args, kwargs)
            return checked(f(*args, **kwargs))
        return run

    class Concat(CodeGenerator):
        """`a ~ b` checked too: the code generator joins them with no call the sandbox sees."""
        def visit_Concat(self, node, frame):
            self.write("environment.checked(")
            super().visit_Concat(node, frame)
            self.write(")")

    class Sandbox(ImmutableSandboxedEnvironment):
        code_generator_class = Concat
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def checked(self, v):
            return checked(v)

        def call_binop(self, context, operator, left, right):
            ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (left, right))
            if operator == "*" and ints:
                size = (left.bit_length() + right.bit_length()) // 3
            elif operator == "*":
                n, seq = (left, right) if isinstance(left, int) else (right, left)
                size = value_size(seq, limit) * n if isinstance(n, int) else 0
            elif operator == "**" and ints and right > 0:
                size = left.bit_length() * right // 3
            else:
                size = 0
            if size > limit:
                refuse(f"computes {left!r:.40} {operator} {right!r:.40}, over {limit} characters")
            if operator == "%":
                check_format(left)
                check_arguments(right if isinstance(right, tuple) else (right,), {})
            return checked(super().call_binop(context, operator, left, right))

        def wrap_str_format(self, value):
            if getattr(value, "__name__", None) in ("format", "format_map"):     # "{:>99999999}".format(x)
                check_format(getattr(value, "__self__", None))
            return super().wrap_str_format(value)

        def call(__self, __context, __obj, *args, **kwargs):
            check_arguments(args, kwargs)
            return checked(super().call(__context, __obj, *args, **kwargs))

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], finalize=checked)
    return env, bounded, jinja2


class _Steps:
    """A line counter for the template's compiled code (sys.settrace, this thread only): a template is a program, and
    no loop of it (over a range, a string, a list) runs past TEMPLATE_STEPS lines in all."""

    def __init__(self):
        self.left = TEMPLATE_STEPS

    def __call__(self, frame, event, arg):
        return self.line if frame.f_code.co_filename == "<template>" else None

    def line(self, frame, event, arg):
        if event == "line":
            self.left -= 1
            if self.left < 0:
                raise UserError(f"chat template runs over {TEMPLATE_STEPS} steps; refusing it (the model file's "
                                    f"template is not trusted)")
        return self.line


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool,
                         tools: list[dict] | None = None, **special) -> str:
    """Render a Hugging Face chat template in a sandbox, with the globals and filters HF templates rely on. The
    template comes with the model file, so its render is bounded in work (TEMPLATE_STEPS lines of its code) and in
    size (no value built and no output over TEMPLATE_CHARS past four times the messages' text and tools' JSON): one
    line otherwise. tools, when given, is the template's `tools`."""
    given = [m.get("content") for m in messages if isinstance(m, dict)] + list(special.values())
    given += [json.dumps(m.get("tool_calls")) for m in messages if isinstance(m, dict) and m.get("tool_calls")]
    if tools is not None:
        special["tools"], given = tools, given + [json.dumps(tools)]
    limit = TEMPLATE_CHARS + 4 * sum(len(t) for t in given if isinstance(t, str))
    env, bounded, jinja2 = _sandbox(limit)

    def raise_exception(msg):
        raise UserError(f"chat template: {msg}")

    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **kw: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, **kw)
    env.filters = {name: bounded(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    tracer = sys.gettrace()
    try:
        compiled = env.from_string(template)
        out, n = [], 0
        sys.settrace(_Steps())
        for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt, **special):
            n += len(piece)
            if n > limit:
                raise UserError(f"chat template writes over {limit} characters; refusing it (the model file's "
                                    f"template is not trusted)")
            out.append(piece)
        return "".join(out)
    except UserError:
        raise
    except jinja2.TemplateError as e:
        raise UserError(f"chat template failed: {e}") from None
    except Exception as e:   # the template's own errors at render time ({{ 1 + 'a' }}: TypeError), from the sandbox
        raise UserError(f"chat template failed: {type(e).__name__}: {e}") from None
    finally:
        sys.settrace(tracer)


class StreamDecoder:
    """Turns ids into text deltas as they arrive, holding back bytes of a character that is not complete yet.
    context: the ids already shown (the prompt's last few), so that the first delta keeps its leading space."""

    CONTEXT_IDS = 8

    def __init__(self, tokenizer: Tokenizer, context=()):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context)[-self.CONTEXT_IDS:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset])
        text = dec(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""


class StopStrings:
    """Cuts streamed text before the first stop string to appear, as the OpenAI API's `stop` does: the one that ends
    first (of two ending together, the longer), so the cut is the same however the text comes in pieces. push()
    returns the text that is safe to show: a tail that may be the start of a stop string is held back until the next
    piece decides it, and flush() gives it at the end of the output. `stopped` once a stop string has appeared."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        text = self.held + piece
        hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[:min(hits)[1]]
        # the longest tail of text that begins some stop string
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


# ----------------------------------------------------------------------------------------------------------------------
# Text into token windows (collect, eval, the gate's calibration)

def corpus_chunks(text: str, chunk_chars: int = 1 << 16):
    """The text in pieces that end at a newline, so the tokenizer sees whole lines and memory stays bounded."""
    i = 0
    while i < len(text):
        j = min(len(text), i + chunk_chars)
        if j < len(text):
            nl = text.rfind("\n", i, j)
            j = nl + 1 if nl > i else j
        yield text[i:j]
        i = j


def token_segments(tokenizer, text: str, n_tokens: int, ctx: int, bos: int | None):
    """Segments of ctx tokens ([bos] + text tokens), n_tokens in all (the last segment may be shorter)."""
    body = ctx - (bos is not None)
    buf: list[int] = []
    left = n_tokens
    for chunk in corpus_chunks(text):
        buf.extend(tokenizer.encode(chunk, add_special_tokens=False))
        while len(buf) >= body and left > 0:
            w = ([bos] if bos is not None else []) + buf[:body]
            w = w[:left]
            del buf[:body]
            left -= len(w)
            yield w
        if left <= 0:
            return
    if buf and left > (bos is not None):
        yield (([bos] if bos is not None else []) + buf)[:left]
