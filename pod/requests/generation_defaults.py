"""Server-wide sampling defaults: llama-server's `--temp`, `--top-k`, ... and vLLM's
`--generation-config` / `--override-generation-config`. A request's own fields always win.

The defaults are request fields (the names the request parsers read), laid under each request
body before it is parsed, so a default goes through the same checks as the field sent by hand.
Precedence, lowest first: the model's `generation_config.json` (`--generation-config auto`, a
Hugging Face directory's own), `--override-generation-config`, then the llama.cpp flags.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from ..args import ServerArgs, json_object
from .fields import COMMON_MAX_TOKENS

log = logging.getLogger("kvpark.defaults")

# generation_config.json keys vLLM takes as sampling defaults -> our request field names
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": COMMON_MAX_TOKENS}
# what --override-generation-config may set: the HF keys and the request fields they map to
OVERRIDE_KEYS = {**HF_KEYS, "seed": "seed", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "max_tokens": COMMON_MAX_TOKENS,
                 "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n"}


# a chat field's other name: a body that sends it has set the field
CHAT_ALIASES = {"reasoning_budget_tokens": "thinking_budget_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """Request fields every request starts from, and where each came from (for the log)."""

    fields: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    chat: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # reasoning

    def under(self, body: dict[str, Any], max_context: int) -> dict[str, Any]:
        """`body` with each default it leaves out (or sends as null) filled in. A default
        `max_tokens` beyond the context is the context: it must never refuse a request."""
        if not self.fields:
            return body
        merged = {name: value for name, value in self.fields.items() if body.get(name) is None}
        if isinstance(merged.get(COMMON_MAX_TOKENS), int):
            merged[COMMON_MAX_TOKENS] = min(merged[COMMON_MAX_TOKENS], max_context)
        return {**body, **merged}

    def under_chat(self, body: dict[str, Any], max_context: int) -> dict[str, Any]:
        """As `under`, and the reasoning flags' fields a chat body takes; the template's
        variables merged, the body's own winning (llama-server's rule)."""
        return self.chat_layer(self.under(body, max_context))

    def chat_layer(self, body: dict[str, Any]) -> dict[str, Any]:
        """The reasoning flags' fields alone (the tokenizer endpoints render chats too)."""
        if not self.chat:
            return body
        merged = {name: value for name, value in self.chat.items()
                  if body.get(name) is None and body.get(CHAT_ALIASES.get(name, "")) is None}
        kwargs = body.get("chat_template_kwargs")
        if isinstance(kwargs, dict) and "chat_template_kwargs" in self.chat:
            merged["chat_template_kwargs"] = {**self.chat["chat_template_kwargs"], **kwargs}
        return {**body, **merged}

    def describe(self) -> str:
        if not self.fields:
            return "none (each request's own fields, else OpenAI's defaults)"
        return ", ".join(f"{name}={value!r} ({self.sources[name]})"
                         for name, value in sorted(self.fields.items()))


def from_generation_config(path: str) -> dict[str, Any]:
    """The sampling keys of a `generation_config.json` as request fields ({} without one)."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config: {path} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config: {path} does not hold a JSON object")
    return {HF_KEYS[key]: value for key, value in config.items() if key in HF_KEYS}


def config_file(choice: str, model: str | None) -> str | None:
    """Which generation_config.json `--generation-config` names: auto = the model directory's
    own (a GGUF or builtin model has none), vllm = none, else a directory holding one."""
    if choice == "vllm":
        return None
    if choice == "auto":
        if model and os.path.isdir(os.path.expanduser(model)):
            return os.path.join(os.path.expanduser(model), "generation_config.json")
        return None
    path = os.path.join(os.path.expanduser(choice), "generation_config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--generation-config {choice}: no generation_config.json there")
    return path


def parse_override(text: str) -> dict[str, Any]:
    """--override-generation-config's JSON object, keys checked (values checked by the parser
    of the request field they become)."""
    try:
        override = json_object(text)
    except ValueError as exc:
        raise ValueError(f"--override-generation-config: {exc}") from None
    unknown = sorted(set(override) - set(OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(OVERRIDE_KEYS))}")
    return {OVERRIDE_KEYS[key]: value for key, value in override.items()}


def build_defaults(layers: list[tuple[str, Mapping[str, Any]]]) -> GenerationDefaults:
    """Layers of (source, fields), lowest precedence first; later layers win."""
    fields: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, layer in layers:
        for name, value in layer.items():
            fields[name], sources[name] = value, source
    return GenerationDefaults(MappingProxyType(fields), MappingProxyType(sources))


def from_flags(args: ServerArgs) -> dict[str, Any]:
    """llama-server's sampling flags as request fields; their "off" values set nothing."""
    named = {"temperature": args.temp, "top_k": args.top_k, "top_p": args.top_p,
             "min_p": args.min_p, "repeat_penalty": args.repeat_penalty,
             "repeat_last_n": args.repeat_last_n, "presence_penalty": args.presence_penalty,
             "frequency_penalty": args.frequency_penalty,
             "seed": None if args.seed == -1 else args.seed,  # -1: a random seed per request
             COMMON_MAX_TOKENS: None if args.n_predict == -1 else args.n_predict}
    return {name: value for name, value in named.items() if value is not None}


def chat_from_flags(args: ServerArgs) -> dict[str, Any]:
    """The reasoning flags as chat request fields (`reasoning_fields.py` reads them)."""
    kwargs = json_object(args.chat_template_kwargs) if args.chat_template_kwargs else {}
    if "enable_thinking" in kwargs:
        log.warning("setting enable_thinking through --chat-template-kwargs: --reasoning on|off "
                    "says the same")
    if args.reasoning != "auto":
        kwargs["enable_thinking"] = args.reasoning == "on"
    named = {"chat_template_kwargs": kwargs or None,
             "reasoning_format": None if args.reasoning_format == "auto" else args.reasoning_format,
             "reasoning_budget_tokens": None if args.reasoning_budget == -1
             else args.reasoning_budget,
             "reasoning_budget_message": args.reasoning_budget_message or None}
    return {name: value for name, value in named.items() if value is not None}


def defaults_for(args: ServerArgs) -> GenerationDefaults:
    path = config_file(args.generation_config, args.model)
    layers: list[tuple[str, Mapping[str, Any]]] = [
        (f"generation config {path}", from_generation_config(path) if path else {}),
        ("--override-generation-config", parse_override(args.override_generation_config)
         if args.override_generation_config else {}),
        ("flag", from_flags(args)),
    ]
    defaults = build_defaults(layers)
    return replace(defaults, chat=MappingProxyType(chat_from_flags(args)))
