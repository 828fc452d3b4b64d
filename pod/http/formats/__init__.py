"""Wire formats: one formatter per API (OpenAI chat, OpenAI completions, llama.cpp /completion,
Anthropic messages, OpenAI responses) for whole responses and stream chunks (`wire.py`,
`openai.py`, `llama.py`, `anthropic.py`, `responses.py`), logprobs in each
API's shape (`logprobs.py`), and what a client is told of a finished or failed sequence
(`results.py`). `get_format` picks the one a request needs."""

from __future__ import annotations

from ..stream import RequestStream
from .anthropic import AnthropicFormat
from .llama import LlamaFormat
from .openai import ChatFormat, CompletionFormat, ToolChatFormat
from .responses import ResponsesFormat
from .wire import WireFormat

FORMATS: dict[str, type[WireFormat]] = {
    "chat": ChatFormat, "completion": CompletionFormat, "llama": LlamaFormat,
    "messages": AnthropicFormat, "responses": ResponsesFormat}


def get_format(model: str, stream: RequestStream, fingerprint: str = "") -> WireFormat:
    if stream.request.tools is not None and stream.request.kind == "chat":
        return ToolChatFormat(model, stream, fingerprint)
    return FORMATS[stream.request.kind](model, stream, fingerprint)
