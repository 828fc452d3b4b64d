"""/slots and POST /slots/{id}: what each slot holds (llama-server's fields plus the park
state), and the admin actions on one slot: park and unpark, and llama-server's slot files
(save, restore, erase).

Slots are read under the engine's lock and acted on by the engine thread; both are awaited off
the event loop, and a refused action (the engine's reason as a string) is a 409.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...core.messages import SlotView
from ...memory import slot_files
from ...requests.errors import ApiError, clip
from ...serving.stack import ServingStack
from ..auth import check_admin, check_auth
from ..lifecycle import Server
from ..request_body import read_json

T = TypeVar("T")


class SlotRoutes:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def slots(self, request: Request) -> Response:
        check_auth(request, self.server.config.api_key)
        stack = self.server.ready_stack()
        share = slot_share(stack)
        state_bytes = stack.engine.capacity.state_bytes
        return JSONResponse([slot_entry(i, view, share, state_bytes)
                             for i, view in enumerate(await snapshot(stack))])

    async def slot_action(self, request: Request) -> Response:
        """POST /slots/{id}?action=park|unpark: park by the normal mode decision, or resume;
        save|restore|erase: llama-server's slot files (`slot_file_action`)."""
        config = self.server.config
        check_admin(request, config.admin_key, config.api_key)
        stack = self.server.ready_stack()
        num_slots = stack.engine.capacity.num_slots
        try:
            slot_id = int(request.path_params["slot_id"])
        except ValueError:
            raise ApiError(404, "no such slot", param="id") from None
        if not 0 <= slot_id < num_slots:
            raise ApiError(404, f"no slot {clip(str(slot_id))}: there are "
                           f"{num_slots}", param="id")
        action = request.query_params.get("action")
        if action in ("save", "restore", "erase"):
            return await self.slot_file_action(request, stack, slot_id, action)
        if action not in ("park", "unpark"):
            raise ApiError(400, "'action': expected park, unpark, save, restore or erase",
                           param="action")
        act = stack.engine.park_slot if action == "park" else stack.engine.unpark_slot
        problem = await asyncio.wrap_future(act(slot_id))
        if problem:
            raise ApiError(409, problem, param="id", error_type="conflict")
        return JSONResponse(slot_entry(slot_id, (await snapshot(stack))[slot_id],
                                       slot_share(stack), stack.engine.capacity.state_bytes))

    async def slot_file_action(self, request: Request, stack: ServingStack, slot_id: int,
                               action: str) -> Response:
        """llama-server's answers. The pages are copied on the engine thread; the file is
        written and read in a worker thread, never on the event loop or under the engine lock."""
        started = time.perf_counter()
        engine = stack.engine
        if action == "erase":  # touches no file: needs no --slot-save-path
            erased = await slot_outcome(engine.erase_slot(slot_id))
            return JSONResponse({"id_slot": slot_id, "n_erased": erased})
        save_path = self.server.config.slot_save_path
        if not save_path:
            raise ApiError(400, f"this server does not support slots action {action!r}: start "
                           "it with --slot-save-path DIR", param="action",
                           error_type="not_supported_error")
        body = await read_json(request, self.server)
        name = body.get("filename")
        try:
            path = slot_files.resolve_name(save_path, name)
            if action == "save":
                state = await slot_outcome(engine.save_slot(slot_id))
                size = await asyncio.to_thread(slot_files.write, path, stack.identity, state)
            else:
                state, size = await asyncio.to_thread(slot_files.read, path, stack.identity,
                                                      stack.kv_dtype, stack.state_layout)
                await slot_outcome(engine.restore_slot(slot_id, state))
        except slot_files.SlotFileError as exc:
            raise ApiError(exc.status, str(exc), param="filename") from None
        ms = (time.perf_counter() - started) * 1000
        if action == "save":
            return JSONResponse({"id_slot": slot_id, "filename": name,
                                 "n_saved": len(state.tokens), "n_written": size,
                                 "timings": {"save_ms": ms}})
        return JSONResponse({"id_slot": slot_id, "filename": name,
                             "n_restored": len(state.tokens), "n_read": size,
                             "timings": {"restore_ms": ms}})


async def slot_outcome(future: concurrent.futures.Future[T | str]) -> T:
    """What an engine slot action gave back; a string says why not: 409."""
    result = await asyncio.wrap_future(future)
    if isinstance(result, str):
        raise ApiError(409, result, param="id", error_type="conflict")
    return result


async def snapshot(stack: ServingStack) -> list[SlotView | None]:
    """The slots, read under the engine's lock off the event loop (a step may hold it)."""
    return await run_in_threadpool(stack.engine.snapshot)


def slot_share(stack: ServingStack) -> int:
    """A slot's `n_ctx` as llama-server reports it: the pool's tokens split evenly."""
    capacity = stack.engine.capacity
    return capacity.tokens // capacity.num_slots


def slot_entry(slot_id: int, view: SlotView | None, share: int, state_bytes: int = 0
               ) -> dict[str, Any]:
    """`state_bytes`: a hybrid model's state slot (0 for others); `state_resident` whether the
    occupant holds it now (a parked one gave it up: swapped to host RAM or dropped)."""
    entry: dict[str, Any] = {"id": slot_id, "n_ctx": share, "is_processing": view is not None,
                             "state_bytes": state_bytes, "state_resident": False,
                             "is_preempted": False, "n_preempt": 0, "n_recompute": 0,
                             "preempt_mode": None, "task": None, "n_tokens": 0,
                             "n_prompt_tokens": 0, "n_generated": 0, "priority": 0,
                             "preempt_manual": False, "preempt_for_reader": False,
                             "resumed_from": [], "cached_from": []}
    if view is not None:
        entry.update(
            is_preempted=view.parked, n_preempt=view.n_preempt, n_recompute=view.n_recompute,
            preempt_mode=view.preempt_mode, task=view.request_id, n_tokens=view.num_computed,
            n_prompt_tokens=view.num_prompt, n_generated=view.num_generated,
            priority=view.priority, preempt_manual=view.manual,
            preempt_for_reader=view.for_reader, phase=view.phase,
            resumed_from=list(view.resumed_from), cached_from=list(view.cached_from),
            state_resident=bool(state_bytes) and not view.parked)
    return entry
