"""Tokenizer and chat template: from GGUF metadata or a Hugging Face tokenizer.json.

Both sources end up as a `tokenizers.Tokenizer`, so encode/decode behave the same whichever file
the model came from. We always encode with `add_special_tokens=False` and add BOS ourselves: the
chat template may already put BOS in the text and a second one hurts the model.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

log = logging.getLogger(__name__)

# llama.cpp's token_type values (llama_token_type in llama.h).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp ends generation on these too, whatever the eos id says (llama-vocab.cpp "EOG" list).
END_OF_TURN_TEXTS = frozenset(
    {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>",
     "<end_of_turn>", "<|return|>", "<EOT>"}
)

# Pre-tokenizer regexes from llama.cpp's llm_tokenizer_bpe, keyed by `tokenizer.ggml.pre`.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DIGITS_THEN_GPT2 = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
GPT2_ONLY = frozenset({"gpt-2", "gpt2", "mpt", "olmo", "jais"})
LLAMA3_LIKE = frozenset({"llama-bpe", "llama3", "dbrx", "smaug-bpe"})
QWEN2_LIKE = frozenset({"qwen2", "qwen2.5", "qwen-2.5", "stablelm2", "deepseek-r1-qwen"})

# Put around every character of a special-token text found in message content, so the text no
# longer matches the special token; the chat encoder's normalizer then deletes it before BPE.
# A Unicode noncharacter (reserved for internal use), so real text does not carry it; any that
# does arrive in a chat message is dropped.
DEFUSE_MARK = "\ufdd0"


class RenderedTooLong(ValueError):
    """A chat prompt rendered longer than it may be, refused before it is tokenised."""

    def __init__(self, num_chars: int, max_chars: int) -> None:
        super().__init__(f"{num_chars} characters rendered, at most {max_chars}")
        self.num_chars, self.max_chars = num_chars, max_chars


class Tokenizer:
    """Text <-> ids, plus the model's chat template and its end-of-generation ids."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_id: int | None,
        eos_token_ids: frozenset[int],
        add_bos: bool,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id  # the one templates call `eos_token`
        self.eos_token_ids = eos_token_ids | ({eos_token_id} if eos_token_id is not None else set())
        self.add_bos = add_bos
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None
        self._chat_backend: HFTokenizer | None = None  # prepare_chat (or first use) builds it
        specials = sorted((t.content for t in backend.get_added_tokens_decoder().values()
                           if t.special and t.content), key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Byte-level BPE from a GGUF file's `tokenizer.ggml.*` metadata (`read_gguf`)."""
        meta = {name: value for name, value in metadata.items() if name.startswith("tokenizer.")}
        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} is not supported "
                "(only byte-level BPE, tokenizer.ggml.model == 'gpt2')"
            )
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        pre = meta.get("tokenizer.ggml.pre", "default")
        backend = _byte_level_bpe(tokens, meta["tokenizer.ggml.merges"], pre)
        _register_added_tokens(backend, tokens, token_types)
        control = {i for i, t in enumerate(token_types) if t == TOKEN_TYPE_CONTROL}
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eot = meta.get("tokenizer.ggml.eot_token_id")
        eos_ids = {i for i in (eos, eot) if i is not None}
        eos_ids |= {i for i in control if tokens[i] in END_OF_TURN_TEXTS}
        return cls(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token_id=bos,
            eos_token_id=eos,
            eos_token_ids=frozenset(eos_ids),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ generation_config.json) of a HF model dir."""
        root = Path(path)
        backend = HFTokenizer.from_file(str(root / "tokenizer.json"))
        tok_cfg = _read_json(root / "tokenizer_config.json")
        bos_id = _token_id(backend, tok_cfg.get("bos_token"))
        eos_id = _token_id(backend, tok_cfg.get("eos_token"))
        eos_ids = _hf_eos_ids(root, backend)
        # The tokenizer.json post-processor is the truth about BOS (Llama 3 adds it, Qwen does not).
        with_special = backend.encode("", add_special_tokens=True).ids
        add_bos = bos_id is not None and with_special[:1] == [bos_id]
        return cls(
            backend,
            chat_template=_hf_chat_template(root, tok_cfg),
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            eos_token_ids=frozenset(eos_ids),
            add_bos=add_bos,
        )

    # --- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Special-token texts such as `<|im_start|>` become their single id."""
        # encode_batch releases the GIL and encode does not: a long prompt tokenised on a
        # worker thread must not stall the event loop (encode holds it for the whole text:
        # benchmarks/README.md, "Measurements behind code comments")
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        return self._with_bos(ids, add_bos)

    def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        # Ids past the tokenizer's vocabulary (synthetic models, padded embeddings) render as "".
        known = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.backend.decode(known, skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        """The text one token stands for, special tokens included ("" if unknown)."""
        return self.decode([token_id], skip_special=False)

    # --- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render like transformers' `apply_chat_template(tokenize=False)`."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=[_flatten_content(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special_text(self.bos_token_id),
            eos_token=self._special_text(self.eos_token_id),
            **{**_today(), **kwargs},
        )

    def prepare_chat(self) -> None:
        """Build now what the first chat request would otherwise build on its way in: the
        template compiled and the defusing copy of the backend (a copy of the whole vocabulary,
        so its cost grows with it: benchmarks/README.md, "The first chat request"). A template
        that does not compile is left to fail on use, as before: a server whose clients only
        send completions has no use for it."""
        if self._chat_backend is None:
            self._chat_backend = _defusing_copy(self.backend)
        if self.chat_template is None or self._template is not None:
            return
        try:
            self._template = _compile_template(self.chat_template)
        except jinja2.TemplateError as error:
            log.warning("the model's chat template does not compile (%s); chat requests will "
                        "fail until --chat-template gives one", error)

    def set_chat_template(self, source: str) -> None:
        """Replace the model's template (--chat-template); compiled now, so errors show early."""
        self._template = _compile_template(source)
        self.chat_template = source

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, prefill: str = "",
                    max_chars: int | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The chat prompt's ids: the template's own special-token texts become their ids, the
        same texts inside message content stay ordinary text.

        Content is defused (marks around each character of a special text) before rendering, and
        the rendered text is encoded by a copy of the backend whose normalizer deletes the marks.
        Special tokens are matched before normalization, so a defused one is never matched, and
        content without special texts encodes exactly as `encode(apply_chat_template(...))`
        (for a tokenizer.json special token marked `normalized`, which GGUF ones never are, the
        split around it may move: safety first).
        """
        defused = [_defused_message(m, self._defuse) for m in map(_flatten_content, messages)]
        # templates test `tools is defined` or `if tools`: pass them only when there are some
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        text = self.apply_chat_template(defused, add_generation_prompt=add_generation_prompt,
                                        **extra)
        text += self._defuse(prefill)  # an assistant reply the output continues
        if max_chars is not None and len(text) > max_chars:  # before the costly part
            raise RenderedTooLong(len(text), max_chars)
        if self._chat_backend is None:
            self._chat_backend = _defusing_copy(self.backend)
        ids = self._chat_backend.encode_batch([text], add_special_tokens=False)[0].ids
        return self._with_bos(ids, None)

    def _defuse(self, content: Any) -> Any:
        if not isinstance(content, str) or self._special_re is None:
            return content
        return self._special_re.sub(
            lambda m: DEFUSE_MARK + DEFUSE_MARK.join(m[0]) + DEFUSE_MARK, content)

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.token_text(token_id)


class IncrementalDetokenizer:
    """Streams text token by token without splitting a multi-byte character.

    Decoding is done over a short window of recent ids (not the whole sequence, which would be
    quadratic). Once some text exists, windows are prefixed with an anchor ("a") so decoders that
    strip a leading space from the first piece (SentencePiece-style) strip the anchor's instead.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self._prefix = 0  # window start: ids before it are fully emitted
        self._read = 0  # ids before it have had their text emitted
        self._has_text = False  # until then the window stays at 0: the first piece is stripped
        self._anchor = tokenizer.encode("a", add_bos=False)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._window_text(self._read)
        new_text = self._window_text(len(self.ids))
        incomplete = new_text.endswith("\ufffd") or not new_text.startswith(prefix_text)
        if incomplete and not final:
            return ""  # the next token may complete the character
        self._has_text = self._has_text or bool(new_text)
        self._prefix = self._read if self._has_text else 0
        self._read = len(self.ids)
        return new_text[len(prefix_text):]

    def _window_text(self, end: int) -> str:
        anchor = self._anchor if self._prefix > 0 else []
        text = self.tokenizer.decode(anchor + self.ids[self._prefix:end], self.skip_special)
        anchor_text = self.tokenizer.decode(anchor, self.skip_special) if anchor else ""
        return text[len(anchor_text):]


# --- GGUF helpers ---------------------------------------------------------------------------------


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # llama.cpp looks a whole pre-token up in the vocab first for Llama 3 (ignore_merges).
    model = models.BPE(vocab, pairs, ignore_merges=pre in LLAMA3_LIKE)
    backend = HFTokenizer(model)
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` equivalent of llama.cpp's regex split for this `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in GPT2_ONLY:
        return byte_level
    split = {**dict.fromkeys(LLAMA3_LIKE, LLAMA3_SPLIT), **dict.fromkeys(QWEN2_LIKE, QWEN2_SPLIT)}
    if pre in split:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported")


def _register_added_tokens(backend: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special (matched in text, skipped on decode); user-defined are not."""
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def _defusing_copy(backend: HFTokenizer) -> HFTokenizer:
    """`backend` with DEFUSE_MARK deleted ahead of its own normalizer."""
    copy = HFTokenizer.from_str(backend.to_str())
    # a special token matched after normalization would match again once the marks are gone:
    # match every special token before it (re-adding a token updates it in place)
    copy.add_special_tokens([
        AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                   normalized=False, special=True)
        for t in copy.get_added_tokens_decoder().values() if t.special and t.normalized])
    strip = normalizers.Replace(DEFUSE_MARK, "")
    copy.normalizer = strip if backend.normalizer is None else normalizers.Sequence(
        [strip, backend.normalizer])
    return copy


# --- Hugging Face helpers -------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_id(backend: HFTokenizer, token: str | dict | None) -> int | None:
    if isinstance(token, dict):  # older tokenizer_config.json stores AddedToken dicts
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def _hf_eos_ids(root: Path, backend: HFTokenizer) -> set[int]:
    ids: set[int | None] = set()
    # generation_config.json lists every id that ends a turn (Llama 3: <|end_of_text|>, <|eot_id|>).
    for cfg in (_read_json(root / "generation_config.json"), _read_json(root / "config.json")):
        eos = cfg.get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else {eos}
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    ids |= {backend.token_to_id(t) for t in special & END_OF_TURN_TEXTS}
    return {i for i in ids if i is not None}


def _hf_chat_template(root: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"  # newer transformers save the template on its own
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t["name"]: t["template"] for t in template}
        return named.get("default", next(iter(named.values()), None))
    return template


# --- chat template helpers ------------------------------------------------------------------------


def _compile_template(source: str) -> jinja2.Template:
    """The same sandbox, options and helpers as transformers' chat template renderer."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _today() -> dict[str, str]:
    """The dates llama-server hands every template (Llama 3's system prompt shows
    `date_string`; without it the template writes its own fixed date)."""
    now = datetime.now()
    return {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; templates are written against transformers' version.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _defused_message(message: dict, defuse: Any) -> dict:
    """A message's client text (content, an earlier turn's reasoning) with special texts
    defused."""
    return {**message, **{key: defuse(message[key]) for key in ("content", "reasoning_content")
                          if key in message}}


def _flatten_content(message: dict) -> dict:
    """OpenAI content parts -> one string: llama-family templates concatenate `content`."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    text = "".join(p.get("text", "") for p in content if p.get("type") == "text")
    return {**message, "content": text}
