"""Whether a generation request gets in: not while draining, not past --max-queue, and never one
that could not finish even alone in the pool (refused up front with 400, as vLLM does).

Of the engine only its facade is read (`num_queued`, `capacity`): the capacity is fixed at
start, so these checks run on the event loop without waiting for a step.
"""

from __future__ import annotations

from ..core.messages import CONTEXT_EXCEEDED
from ..requests.errors import ApiError
from ..requests.parsers import GenerationRequest
from ..serving.stack import ServingStack


def check_admission(stack: ServingStack, draining: bool, num_receiving: int,
                    max_queue: int) -> None:
    """`num_receiving`: admitted requests whose body is still coming in (the engine's queue
    counts them once they are submitted)."""
    if draining:
        raise ApiError(503, "the server is shutting down", error_type="unavailable",
                       headers={"Connection": "close", "Retry-After": "5"})
    if stack.engine.num_queued + num_receiving >= max_queue:
        stack.metrics.rejected.inc()
        raise ApiError(503, f"the queue is full ({max_queue} requests wait for a "
                       "slot); retry later", error_type="unavailable",
                       headers={"Retry-After": "1"})


def check_fits(stack: ServingStack, gen: GenerationRequest, which: str = "") -> None:
    """Refuse up front what could never finish, even alone in the pool (as vLLM does).
    `which`: the prompt's place in a batched `prompt` ("[2]")."""
    room = stack.engine.capacity
    capacity = room.tokens
    limit = min(capacity, stack.max_context)
    prompt = len(gen.prompt_ids)
    if prompt + 1 > limit:
        # llama.cpp's type and numbers: a client branches on them, not on the words
        raise ApiError(400, f"{CONTEXT_EXCEEDED} The prompt has {prompt} tokens; one "
                       f"request can hold {limit} here (pool {capacity}).",
                       param="messages" if gen.kind == "chat" else f"prompt{which}",
                       error_type="exceed_context_size_error",
                       details={"n_prompt_tokens": prompt, "n_ctx": limit})
    # more to generate than the context holds runs until it is full ("length"), as
    # llama-server does (vLLM refuses it): only the room left counts below
    max_tokens = gen.params.max_tokens
    if max_tokens is not None:
        max_tokens = min(max_tokens, limit - prompt)
    # the n sequences are never parked, so as many as get a slot at once must fit the pool
    # together (with the prefix cache they share the prompt's full pages)
    together = min(gen.params.n, room.num_slots)
    each = prompt + (max_tokens or 1)
    if together > 1 and room.pages_for_family(together, prompt, each) > room.num_pages:
        raise ApiError(400, f"'n': {together} sequences run side by side here, each up to "
                       f"{each} tokens ({prompt} prompt + {max_tokens or 1} to generate); "
                       f"together they exceed the {capacity}-token pool",
                       param="n")
