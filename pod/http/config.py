"""The HTTP side's slice of the flags, built once from `ServerArgs`: what the routes, admission,
auth and the body reader read (the rest of the flags stay with the stack's builder)."""

from __future__ import annotations

from dataclasses import dataclass

from ..args import ServerArgs


@dataclass(frozen=True)
class HttpConfig:
    host: str
    port: int
    api_key: str | None
    admin_key: str | None  # POST /slots actions; they are off without this or api_key
    served_model_name: tuple[str, ...]  # (): the model file's name
    max_queue: int
    max_messages: int
    max_prompt_chars: int  # 0: what the context could ever hold
    max_body_bytes: int
    timeout_body: float  # seconds between two chunks of a request body
    sse_keepalive: float  # seconds between ": keepalive" comments of a quiet stream
    slot_save_path: str | None
    max_stream_backlog: int  # unread events before a stream's sequences are parked; 0: never
    speculative: bool  # /props says whether drafts are verified (--spec-type)

    @classmethod
    def of(cls, args: ServerArgs) -> HttpConfig:
        return cls(args.host, args.port, args.api_key, args.admin_key, args.served_model_name,
                   args.max_queue, args.max_messages, args.max_prompt_chars, args.max_body_bytes,
                   args.timeout_body, args.sse_keepalive, args.slot_save_path,
                   args.max_stream_backlog, args.spec_type != "none")
