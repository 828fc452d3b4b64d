"""The engine thread's side of the thread boundary: what happened to a sequence, turned into
values (`messages.Event`, `SeqResult`, `SlotView`) and handed to its request's sink. Reading the
sequence here, on the thread that writes it, is what lets the other side hold values only."""

from __future__ import annotations

from .messages import Event, PromptProgress, SeqEvent, SeqResult, SlotView, StreamEvent
from .sequence import Sequence


def report(seq: Sequence, event: SeqEvent, text: str = "") -> None:
    """Tell the request's owner. `text` is what a TOKEN (or the end) adds to the visible
    output; the owner learns the logprobs and ids since its last TEXT event with it."""
    sink = seq.request.sink
    if event is SeqEvent.PROGRESS:
        if seq.request.return_progress:
            sink(Event(StreamEvent.PROGRESS, seq.index, progress=progress_of(seq)))
        return
    if text:
        sink(text_event(seq, text))
    if event is SeqEvent.FINISHED:
        sink(Event(StreamEvent.FINISHED, seq.index, result=result_of(seq)))
    elif event is not SeqEvent.TOKEN:
        sink(Event(StreamEvent(event.value), seq.index))


def progress_of(seq: Sequence) -> PromptProgress:
    return PromptProgress(seq.num_prompt, seq.num_cached, min(seq.num_computed, seq.num_prompt),
                          seq.output.prompt_seconds * 1e3)


def text_event(seq: Sequence, text: str) -> Event:
    """A TEXT event with what the sequence produced since its previous one."""
    output = seq.output
    first = output.num_reported_tokens is None
    logprobs_from, tokens_from = output.num_reported_logprobs, output.num_reported_tokens or 0
    output.num_reported_logprobs = len(output.logprobs)
    output.num_reported_tokens = seq.num_generated
    return Event(StreamEvent.TEXT, seq.index, text, seq.num_generated,
                 tuple(output.logprobs[logprobs_from:]),
                 tuple(seq.tokens[seq.num_prompt + tokens_from:]),
                 tuple(output.prompt_logprobs) if first else (), seq.slot_id,
                 num_logprobs=len(output.logprobs))


def result_of(seq: Sequence) -> SeqResult:
    """Once the sequence finished (nothing writes it after)."""
    output, visible = seq.output, seq.output.visible
    assert output.finish_reason is not None, "a result is taken when the sequence ended"
    return SeqResult(
        seq.index, seq.family_size, output.finish_reason, output.error,
        visible.text if visible is not None else "", visible is not None and visible.stopped,
        seq.prompt_ids, tuple(seq.generated_ids), seq.num_cached, seq.slot_id,
        output.prompt_seconds, output.first_token_at, output.finished_at,
        tuple(output.logprobs), tuple(output.prompt_logprobs), seq.spec.num_drafts,
        seq.spec.num_drafted, seq.spec.num_accepted, seq.parking.n_preempt,
        seq.parking.n_recompute)


def slot_view(seq: Sequence) -> SlotView:
    phase = ("parked" if seq.is_parked else "replay" if seq.is_replaying
             else "prompt" if seq.in_prompt else "generating")
    mode = seq.parking.mode
    return SlotView(seq.request_id, seq.is_parked, seq.parking.n_preempt,
                    seq.parking.n_recompute, mode.value if mode else None, seq.parking.manual,
                    seq.parking.for_reader, seq.num_computed, seq.num_prompt,
                    seq.num_generated, seq.priority, phase, seq.parking.resumed_from,
                    seq.cached_from)
