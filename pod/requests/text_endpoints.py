"""The tokenizer and chat template as endpoints, in llama.cpp's and vLLM's shapes at once:
/tokenize (llama.cpp's `content`; vLLM's `prompt` or `messages`), /detokenize, and llama.cpp's
/apply-template. Pure functions of a request body: the routes run them off the event loop.
"""

from __future__ import annotations

from typing import Any

from ..core.text_output import token_piece
from ..model.tokenizer import Tokenizer
from .errors import ApiError
from .field_values import boolean_field
from .input_limits import InputLimits
from .prompts import chat_prompt_ids, render_chat


def _text(body: dict[str, Any], name: str, limits: InputLimits) -> str:
    text = body[name]
    if not isinstance(text, str):
        raise ApiError(400, f"'{name}': expected a string", param=name)
    if len(text) > limits.max_prompt_chars:
        raise ApiError(400, f"'{name}': more than {limits.max_prompt_chars} characters "
                       "(--max-prompt-chars)", param=name)
    return text


def tokenize(body: dict[str, Any], tokenizer: Tokenizer, limits: InputLimits) -> dict[str, Any]:
    """llama.cpp: {"content", "add_special", "with_pieces"} -> {"tokens"}; vLLM: {"prompt",
    "add_special_tokens"} or {"messages", "add_generation_prompt", ...} -> {"tokens", "count",
    "max_model_len"}. Every answer carries all three keys (and `token_strs` when asked)."""
    if "messages" in body:
        ids = chat_prompt_ids(body, tokenizer, limits)  # the template adds the special tokens
    else:
        name = "content" if "content" in body else "prompt"
        if name not in body:
            raise ApiError(400, "'content': expected a string (or vLLM's 'prompt' or "
                           "'messages')", param="content")
        text = _text(body, name, limits)
        # each server's own name and default
        add_special = (boolean_field(body, "add_special", False) if name == "content"
                       else boolean_field(body, "add_special_tokens", True))
        ids = tokenizer.encode(text, add_special)
    answer: dict[str, Any] = {"tokens": ids, "count": len(ids),
                              "max_model_len": limits.max_context}
    if boolean_field(body, "with_pieces", False):
        answer["tokens"] = [{"id": i, "piece": token_piece(tokenizer, i)} for i in ids]
    if boolean_field(body, "return_token_strs", False):
        answer["token_strs"] = [tokenizer.token_text(i) for i in ids]
    return answer


def detokenize(body: dict[str, Any], tokenizer: Tokenizer, limits: InputLimits
               ) -> dict[str, Any]:
    """{"tokens"} -> llama.cpp's {"content"} and vLLM's {"prompt"}: the same text. No more
    tokens than one request's context holds: no sequence of this server is longer."""
    tokens = body.get("tokens")
    vocab = tokenizer.vocab_size
    if isinstance(tokens, list) and len(tokens) > limits.max_context:
        raise ApiError(400, f"'tokens': {len(tokens)} tokens; at most {limits.max_context} "
                       "(the context)", param="tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise ApiError(400, f"'tokens': expected a list of token ids in [0, {vocab})",
                       param="tokens")
    text = tokenizer.decode(tokens, False)
    return {"content": text, "prompt": text}


def apply_template(body: dict[str, Any], tokenizer: Tokenizer, limits: InputLimits
                   ) -> dict[str, Any]:
    """llama.cpp's /apply-template: the text a chat request with these messages would run."""
    return {"prompt": render_chat(body, tokenizer, limits)}


def tokenizer_info(tokenizer: Tokenizer, max_context: int) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's configuration, as tokenizer_config.json holds it
    (lm-evaluation-harness's remote tokenizer reads it, then uses /tokenize and /detokenize)."""
    def special(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.token_text(token_id)

    info: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special(tokenizer.bos_token_id),
        "eos_token": special(tokenizer.eos_token_id),
        "add_bos_token": tokenizer.add_bos, "add_eos_token": False,
        "model_max_length": max_context, "vocab_size": tokenizer.vocab_size,
        "clean_up_tokenization_spaces": False}
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info
