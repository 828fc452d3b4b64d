"""Routes about the model served rather than a generation: /v1/models, llama.cpp's /props,
vLLM's /version, the tokenizer endpoints, and the refusal of embeddings.

None of them touches the step loop; tokenising a long text is CPU-bound, so the tokenizer
endpoints answer off the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...model.tokenizer import Tokenizer
from ...requests import parsers, text_endpoints
from ...requests.errors import ApiError, clip
from ...requests.fields import COMMON_MAX_TOKENS
from ...requests.sampling_fields import sampling_params
from ...serving.stack import ServingStack
from ..auth import check_auth
from ..build_info import build_version
from ..formats.llama import generation_settings
from ..lifecycle import Server
from ..request_body import read_json
from .slots import slot_share


class ModelRoutes:
    def __init__(self, server: Server) -> None:
        self.server = server

    def ready_stack(self, request: Request) -> ServingStack:
        """The stack, once the caller is let in and the model has loaded."""
        check_auth(request, self.server.config.api_key)
        return self.server.ready_stack()

    def model_card(self, stack: ServingStack, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.server.created,
                "owned_by": "kvpark", "root": stack.model_path, "parent": None,
                "max_model_len": stack.max_context}

    async def models(self, request: Request) -> Response:
        stack = self.ready_stack(request)
        return JSONResponse({"object": "list", "data": [
            self.model_card(stack, name) for name in self.server.served_names(stack)]})

    async def model(self, request: Request) -> Response:
        stack = self.ready_stack(request)
        served = self.server.served_names(stack)
        name = request.path_params["model_id"]
        if name not in served:
            raise ApiError(404, f"The model '{clip(name)}' does not exist (served: "
                           f"{', '.join(served)})", param="model",
                           error_type="not_found_error")
        return JSONResponse(self.model_card(stack, name))

    async def tokenize(self, request: Request) -> Response:
        return await self.text_endpoint(request, text_endpoints.tokenize)

    async def count_message_tokens(self, request: Request) -> Response:
        """Anthropic's /v1/messages/count_tokens."""
        return await self.text_endpoint(request, parsers.count_message_tokens)

    async def detokenize(self, request: Request) -> Response:
        return await self.text_endpoint(request, text_endpoints.detokenize)

    async def tokenizer_info(self, request: Request) -> Response:
        stack = self.ready_stack(request)
        return JSONResponse(text_endpoints.tokenizer_info(stack.tokenizer, stack.max_context))

    async def apply_template(self, request: Request) -> Response:
        return await self.text_endpoint(request, text_endpoints.apply_template)

    async def text_endpoint(self, request: Request, answer: Callable[..., Any]) -> Response:
        """A tokenizer endpoint: body -> answer off the event loop (templating, tokenising and
        encoding a long answer are CPU-bound)."""
        stack = self.ready_stack(request)
        # a chat rendered here is rendered as a chat request's would be: the reasoning flags
        body = stack.defaults.chat_layer(await read_json(request, self.server))
        limits = self.server.limits(stack)

        def respond() -> JSONResponse:
            return JSONResponse(answer(body, stack.tokenizer, limits))

        return await run_in_threadpool(respond)

    async def version(self, request: Request) -> Response:
        """vLLM's /version (open without the key, as vLLM's: `auth.OPEN_PATHS`)."""
        check_auth(request, self.server.config.api_key)
        return JSONResponse({"version": build_version()})

    async def props(self, request: Request) -> Response:
        """llama.cpp's /props: what a client needs to know before it sends a request."""
        stack = self.ready_stack(request)
        name = self.server.model_name(stack)
        return JSONResponse({
            "default_generation_settings": {
                "id": 0, "id_task": -1, "n_ctx": slot_share(stack),
                "speculative": self.server.config.speculative,
                "is_processing": False, "model": name, "params": default_params(stack)},
            "total_slots": stack.engine.capacity.num_slots,
            "model_path": stack.model_path,
            "model_alias": name,
            "chat_template": stack.tokenizer.chat_template or "",
            "bos_token": special_text(stack.tokenizer, stack.tokenizer.bos_token_id),
            "eos_token": special_text(stack.tokenizer, stack.tokenizer.eos_token_id),
            "build_info": f"kvpark {build_version()}",
            "modalities": {"vision": False, "audio": False},
        })

    async def embeddings(self, request: Request) -> Response:
        stack = self.ready_stack(request)
        # as vLLM answers a generation model: 400, not a 404 that reads as a wrong URL
        raise ApiError(400, f"The model does not support Embeddings API: "
                       f"{self.server.model_name(stack)} is a text generation model",
                       param="model")


def special_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.token_text(token_id)


def default_params(stack: ServingStack) -> dict[str, Any]:
    """/props' `params` in llama.cpp's names: what a request that sets nothing gets."""
    params = sampling_params(stack.defaults.under({}, stack.max_context),
                             stack.max_context, (COMMON_MAX_TOKENS,), stack.tokenizer)
    return generation_settings(params)
