"""What every wire format says of a finished sequence: its HTTP status when it failed, usage,
llama.cpp's timings and the finish reason's name."""

from __future__ import annotations

import time
from typing import Any

from ...core.messages import FinishReason, SeqResult
from ...requests.errors import ApiError

# the HTTP status of each failure (the scheduler says why a sequence ended, not how to say it)
FAILURE_STATUS = {
    FinishReason.PROMPT_TOO_LONG: 400,
    FinishReason.CONTEXT_EXCEEDED: 500,
    FinishReason.ENGINE_ERROR: 500,
    FinishReason.SHUTDOWN: 503,
}


def failure(seq: SeqResult) -> ApiError:
    status = FAILURE_STATUS.get(seq.finish_reason, 500)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, seq.error or "unknown error", error_type=kind)


def usage(seqs: list[SeqResult]) -> dict[str, Any]:
    completion = sum(s.num_generated for s in seqs)
    # the n choices of a prompt share it: count each prompt of a batched request once
    firsts = [s for s in seqs if s.index % s.family_size == 0]
    prompt = sum(s.num_prompt for s in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.num_cached for s in firsts)}}


def timings(seq: SeqResult) -> dict[str, float]:
    """llama.cpp's timings: the prompt as sent (recompute replays are not in here); cache_n of
    its tokens came from the prefix cache (prompt_n still counts them, unlike llama.cpp)."""
    prompt_ms = seq.prompt_seconds * 1e3
    end = seq.finished_at or time.monotonic()
    predicted_ms = (end - seq.first_token_at) * 1e3 if seq.first_token_at else 0.0
    n = seq.num_generated
    return {
        "cache_n": seq.num_cached,
        "prompt_n": seq.num_prompt,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / max(1, seq.num_prompt),
        "prompt_per_second": seq.num_prompt / (prompt_ms / 1e3) if prompt_ms else 0.0,
        "predicted_n": n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / max(1, n),
        # llama.cpp's 0 for one token: its time is the prompt's, a rate over ~0 ms means nothing
        "predicted_per_second": n / (predicted_ms / 1e3) if predicted_ms and n > 1 else 0.0,
        **draft_timings(seq),
    }


def draft_timings(seq: SeqResult) -> dict[str, int]:
    """llama.cpp's speculative-decoding counts, present only when the sequence was drafted."""
    if not seq.num_drafts:
        return {}
    return {"draft_n": seq.num_drafted, "draft_n_accepted": seq.num_accepted}


def finish_reason(seq: SeqResult) -> str:
    return seq.finish_reason.value
