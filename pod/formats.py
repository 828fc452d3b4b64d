"""Wire formats: one formatter per API (OpenAI chat, OpenAI completions, llama.cpp /completion)
for whole responses and stream chunks, and what a client is told when a sequence failed.
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar

from .bridge import Event, PromptProgress, RequestStream, StreamEvent
from .handover import SeqResult
from .model.tokenizer import Tokenizer
from .request_errors import ApiError
from .sampling import SamplingParams, TokenLogprob
from .slot import FinishReason
from .tools import ParsedOutput, parse_output

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


# ---- logprobs ----------------------------------------------------------------------------------

MIN_LOGPROB = -9999.0  # what OpenAI and vLLM send for -inf (JSON has no infinity)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: a vocabulary character -> the byte it stands for."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


BYTE_OF = _byte_decoder()


class TokenNames:
    """A token's text and UTF-8 bytes, as logprobs show them (cached per request)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            text = self.tokenizer.token_text(token_id)
            self._cache[token_id] = (text, self._bytes(token_id, text))
        return self._cache[token_id]

    def _bytes(self, token_id: int, text: str) -> list[int]:
        # a token that is part of a UTF-8 character decodes to U+FFFD; its bytes are in the
        # byte-level vocabulary entry (or a sentencepiece <0xNN> byte token)
        piece = self.tokenizer.backend.id_to_token(token_id) or ""
        if "\ufffd" in text and len(piece) == 6 and piece.startswith("<0x") and piece[-1] == ">":
            return [int(piece[3:5], 16)]
        if "\ufffd" in text and piece and all(ch in BYTE_OF for ch in piece):
            return [BYTE_OF[ch] for ch in piece]
        return list(text.encode("utf-8"))


class TokenIdNames(TokenNames):
    """vLLM's `return_tokens_as_token_ids`: tokens named `token_id:N` in logprobs, so a client
    can tell tokens apart whose text is not whole UTF-8."""

    def get(self, token_id: int) -> tuple[str, list[int]]:
        name = f"token_id:{token_id}"
        return name, list(name.encode())


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def chat_logprobs(names: TokenNames, entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat: `choice.logprobs`."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        text, raw = names.get(token)
        return {"token": text, "logprob": _lp(logprob), "bytes": raw}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(names: TokenNames, entries: list[TokenLogprob], offset: int
                        ) -> dict[str, Any]:
    """OpenAI completions: `choice.logprobs`; `offset` is where the first token's text starts in
    the completion. As vLLM, each `top_logprobs` dict holds the k best and the sampled token."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        text = names.get(e.token)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top = {names.get(t)[0]: _lp(lp) for t, lp in e.top}
        top.setdefault(text, _lp(e.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def echoed_logprobs(names: TokenNames, prompt_ids: list[int], entries: list[TokenLogprob],
                    k: int) -> dict[str, Any]:
    """Completions' `echo` with `logprobs`: the prompt's tokens in `choice.logprobs`' shape,
    the first without a logprob (no row comes before it), each top cut to the `k` asked."""
    first = names.get(prompt_ids[0])[0]
    rest = completion_logprobs(names, [TokenLogprob(e.token, e.logprob, e.top[:k])
                                       for e in entries], len(first))
    return {"tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]]}


def joined_logprobs(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    return {key: first[key] + (then[key] if then else []) for key in first}


def vllm_prompt_logprobs(names: TokenNames, entries: list[TokenLogprob]
                         ) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first: null), its own logprob and rank
    and the k most likely, keyed by token id."""
    def one(token: int, logprob: float, rank: int) -> tuple[str, dict[str, Any]]:
        return str(token), {"logprob": _lp(logprob), "rank": rank,
                            "decoded_token": names.get(token)[0]}

    shaped: list[dict[str, Any] | None] = [None]
    for e in entries:
        shaped.append(dict([one(t, lp, rank) for rank, (t, lp) in enumerate(e.top, 1)]
                           + [one(e.token, e.logprob, e.rank)]))
    return shaped


def llama_probabilities(names: TokenNames, entries: list[TokenLogprob],
                        post_sampling: bool = False) -> list[dict[str, Any]]:
    """llama.cpp /completion's `completion_probabilities`: logprobs of the model's own
    distribution, or with `post_sampling_probs` probabilities of the one the draw used (tokens
    the filters removed are left out of the tops)."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        text, raw = names.get(token)
        value = {"prob": math.exp(logprob)} if post_sampling else {"logprob": _lp(logprob)}
        return {"id": token, "token": text, **value, "bytes": raw}

    tops = "top_probs" if post_sampling else "top_logprobs"
    return [{**one(e.token, e.logprob),
             tops: [one(t, lp) for t, lp in e.top if not (post_sampling and lp == -math.inf)]}
            for e in entries]


class WireFormat:
    """One API's shapes for a request: the whole response, or the chunks of a stream."""

    ends_with_done: ClassVar[bool] = True  # `data: [DONE]` closes the stream

    def __init__(self, model: str, stream: RequestStream, fingerprint: str = "") -> None:
        self.model = model
        self.stream = stream
        self.fingerprint = fingerprint  # OpenAI's system_fingerprint
        self.names = (TokenIdNames if stream.request.tokens_as_ids else TokenNames)(
            stream.tokenizer)
        self._num_sent: dict[int, int] = {}  # per choice: logprobs already in a chunk
        self._offset: dict[int, int] = {}  # per choice: text length those tokens cover
        self._opened: set[int] = set()  # choices whose first text chunk went out
        self._generated: dict[int, int] = {}  # per choice: tokens generated, as events said

    def observe(self, event: Event) -> None:
        """Counts from the events (values taken on the engine thread), for usage in chunks."""
        if event.kind is StreamEvent.TEXT:
            self._generated[event.index] = event.num_generated
        elif event.kind is StreamEvent.FINISHED:
            self._generated[event.index] = event.result.num_generated

    def progress(self, progress: PromptProgress) -> dict[str, Any]:
        """llama.cpp's prompt progress chunk (return_progress)."""
        raise NotImplementedError

    def first_chunk_of(self, index: int) -> bool:
        """True once per choice: the chunk that carries its echo and prompt logprobs."""
        first = index not in self._opened
        self._opened.add(index)
        return first

    def prompt_logprobs(self, index: int) -> list[dict[str, Any] | None] | None:
        if not self.stream.request.show_prompt_logprobs:
            return None
        return vllm_prompt_logprobs(self.names, self.stream.choices[index].prompt_logprobs)

    @property
    def wants_logprobs(self) -> bool:
        return self.stream.request.params.logprobs is not None

    def take_logprobs(self, index: int, upto: int | None = None) -> list[TokenLogprob]:
        """The choice's logprobs not sent yet, up to `upto` (a TEXT event's count; None: all,
        for a finished sequence). A chunk carries those of the tokens sampled since the
        previous one: its text's tokens, or a stop string's, or text still held back."""
        received = self.stream.choices[index].logprobs
        start = self._num_sent.get(index, 0)
        end = len(received) if upto is None else upto
        self._num_sent[index] = max(start, end)
        return received[start:end]

    @property
    def include_usage(self) -> bool:
        return self.stream.request.include_usage

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before the first text (or notice)."""
        return []

    def text(self, index: int, text: str, num_logprobs: int | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def finish(self, seq: SeqResult) -> dict[str, Any]:
        raise NotImplementedError

    def finish_chunks(self, seq: SeqResult) -> list[dict[str, Any]]:
        """What a stream sends when `seq` ended: its last delta and finish reason."""
        return [self.finish(seq)]

    def usage(self) -> dict[str, Any]:
        raise NotImplementedError


class OpenAIFormat(WireFormat):
    object_name: ClassVar[str]
    chunk_object_name: ClassVar[str]

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.stream.request_id, "object": self.chunk_object_name,
                 "created": int(time.time()), "model": self.model,
                 "system_fingerprint": self.fingerprint, "choices": choices}
        if self.include_usage:
            chunk["usage"] = self.usage_so_far() if self.stream.request.continuous_usage else None
        return chunk

    def usage_so_far(self) -> dict[str, int]:
        """vLLM's continuous usage stats: the prompt, and the tokens the events reported."""
        prompt = sum(len(p) for p in self.stream.prompts)
        completion = sum(self._generated.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def progress(self, progress: PromptProgress) -> dict[str, Any]:
        return {**self._chunk([]), "prompt_progress": progress.as_json()}

    def body(self) -> dict[str, Any]:
        seqs = self.stream.results
        return {"id": self.stream.request_id, "object": self.object_name,
                "created": int(time.time()), "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [self.choice(s) for s in seqs], "usage": usage(seqs),
                "timings": timings(seqs[0]), "preempt": self.stream.preempt_summary()}

    def choice(self, seq: SeqResult) -> dict[str, Any]:
        raise NotImplementedError

    def usage(self) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage(self.stream.results)
        return chunk


class ChatFormat(OpenAIFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def logprobs(self, index: int, upto: int | None) -> dict[str, Any] | None:
        entries = self.take_logprobs(index, upto) if self.wants_logprobs else []
        return chat_logprobs(self.names, entries) if entries else None

    def body(self) -> dict[str, Any]:
        body = super().body()
        if self.stream.request.show_prompt_logprobs:  # vLLM: one list, beside the choices
            body["prompt_logprobs"] = self.prompt_logprobs(0)
        return body

    def with_prompt_logprobs(self, chunk: dict[str, Any], index: int) -> dict[str, Any]:
        if self.first_chunk_of(index) and index == 0 and self.stream.request.show_prompt_logprobs:
            chunk["prompt_logprobs"] = self.prompt_logprobs(0)
        return chunk

    def choice(self, seq: SeqResult) -> dict[str, Any]:
        logprobs = (chat_logprobs(self.names, seq.logprobs) if self.wants_logprobs else None)
        return {"index": seq.index, "message": {"role": "assistant",
                                                "content": seq.text},
                "logprobs": logprobs, "finish_reason": finish_reason(seq)}

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                             for i in range(self.stream.num_seqs)])]

    def text(self, index: int, text: str, num_logprobs: int | None = None) -> dict[str, Any]:
        return self.with_prompt_logprobs(self._chunk([
            {"index": index, "delta": {"content": text},
             "logprobs": self.logprobs(index, num_logprobs), "finish_reason": None}]), index)

    def finish(self, seq: SeqResult) -> dict[str, Any]:
        return self.with_prompt_logprobs(self._chunk([
            {"index": seq.index, "delta": {}, "logprobs": self.logprobs(seq.index, None),
             "finish_reason": finish_reason(seq)}]), seq.index)


class ToolChatFormat(ChatFormat):
    """A chat whose output may be tool calls: JSON in the generic format, parsed once complete
    into OpenAI's `tool_calls`; a stream sends the calls (or the answer) with its last chunk
    (deltas before it are empty, so a client sees progress)."""

    def __init__(self, model: str, stream: RequestStream, fingerprint: str = "") -> None:
        super().__init__(model, stream, fingerprint)
        self._parsed: dict[int, ParsedOutput] = {}  # one parse (and one set of call ids) each

    def parsed(self, seq: SeqResult) -> ParsedOutput:
        if seq.index not in self._parsed:
            self._parsed[seq.index] = parse_output(seq.text)
        return self._parsed[seq.index]

    def finish_reason(self, seq: SeqResult) -> str:
        if seq.finish_reason is FinishReason.STOP and self.parsed(seq).tool_calls:
            return "tool_calls"
        return finish_reason(seq)

    def choice(self, seq: SeqResult) -> dict[str, Any]:
        parsed = self.parsed(seq)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        return {"index": seq.index, "message": message, "logprobs": None,
                "finish_reason": self.finish_reason(seq)}

    def opening(self) -> list[dict[str, Any]]:
        # content null, not "": a call has no content (clients keep the first value they see)
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": None},
                              "logprobs": None, "finish_reason": None}
                             for i in range(self.stream.num_seqs)])]

    def text(self, index: int, text: str, num_logprobs: int | None = None) -> dict[str, Any]:
        return self._chunk([{"index": index, "delta": {}, "logprobs": None,
                             "finish_reason": None}])

    def finish(self, seq: SeqResult) -> dict[str, Any]:
        return self._chunk([{"index": seq.index, "delta": {}, "logprobs": None,
                             "finish_reason": self.finish_reason(seq)}])

    def finish_chunks(self, seq: SeqResult) -> list[dict[str, Any]]:
        # the calls before the finish reason, as OpenAI sends them: clients close a call's
        # arguments when the next call or the finish reason comes
        parsed = self.parsed(seq)
        delta: dict[str, Any] = {}
        if parsed.tool_calls:
            delta["tool_calls"] = [{"index": i, **call}
                                   for i, call in enumerate(parsed.tool_calls)]
        elif parsed.content:
            delta["content"] = parsed.content
        last = [self._chunk([{"index": seq.index, "delta": delta, "logprobs": None,
                              "finish_reason": None}])] if delta else []
        return [*last, self.finish(seq)]


class CompletionFormat(OpenAIFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def logprobs(self, index: int, upto: int | None) -> dict[str, Any] | None:
        entries = self.take_logprobs(index, upto) if self.wants_logprobs else []
        if not entries:
            return None
        shaped = completion_logprobs(self.names, entries, self._offset.get(index, 0))
        last = entries[-1]
        self._offset[index] = shaped["text_offset"][-1] + len(self.names.get(last.token)[0])
        return shaped

    def echoed(self, index: int) -> dict[str, Any] | None:
        """The echoed prompt's part of `logprobs` (None: no echo, or no logprobs asked)."""
        if index not in self.stream.echoes or not self.wants_logprobs:
            return None
        k = self.stream.request.params.logprobs or 0
        return echoed_logprobs(self.names, self.stream.prompt_ids(index),
                               self.stream.choices[index].prompt_logprobs, k)

    def choice(self, seq: SeqResult) -> dict[str, Any]:
        echo, echoed = self.stream.echoes.get(seq.index, ""), self.echoed(seq.index)
        offset = len("".join(echoed["tokens"])) if echoed else 0
        logprobs = (completion_logprobs(self.names, seq.logprobs, offset) if self.wants_logprobs
                    else None)
        if echoed:
            logprobs = joined_logprobs(echoed, logprobs)
        choice = {"index": seq.index, "text": echo + seq.text,
                  "logprobs": logprobs, "finish_reason": finish_reason(seq)}
        if self.stream.request.show_prompt_logprobs:
            choice["prompt_logprobs"] = self.prompt_logprobs(seq.index)
        return choice

    def shaped(self, index: int, text: str, upto: int | None, reason: str | None
               ) -> dict[str, Any]:
        """A stream's chunk; a choice's first one opens with its echo and prompt logprobs."""
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                                  "finish_reason": reason}
        if self.first_chunk_of(index):
            echoed = self.echoed(index)
            choice["text"] = self.stream.echoes.get(index, "") + text
            if echoed:
                self._offset[index] = len("".join(echoed["tokens"]))
            if self.stream.request.show_prompt_logprobs:
                choice["prompt_logprobs"] = self.prompt_logprobs(index)
            choice["logprobs"] = (joined_logprobs(echoed, self.logprobs(index, upto))
                                  if echoed else self.logprobs(index, upto))
        else:
            choice["logprobs"] = self.logprobs(index, upto)
        return self._chunk([choice])

    def text(self, index: int, text: str, num_logprobs: int | None = None) -> dict[str, Any]:
        return self.shaped(index, text, num_logprobs, None)

    def finish(self, seq: SeqResult) -> dict[str, Any]:
        return self.shaped(seq.index, "", None, finish_reason(seq))


def generation_settings(params: SamplingParams, stream: bool = False) -> dict[str, Any]:
    """llama.cpp's `generation_settings` (and /props' defaults): a request's sampling settings
    in its names."""
    return {"n_predict": -1 if params.max_tokens is None else params.max_tokens,
            "seed": -1 if params.seed is None else params.seed,
            "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
            "min_p": params.min_p, "repeat_last_n": params.repeat_last_n,
            "repeat_penalty": params.repeat_penalty,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty, "stop": list(params.stop),
            "ignore_eos": params.ignore_eos, "min_tokens": params.min_tokens,
            "n_probs": params.logprobs or 0, "post_sampling_probs": params.post_sampling_probs,
            # a banned token as llama.cpp writes it: JSON has no -inf
            "logit_bias": [[token, False if bias == -math.inf else bias]
                           for token, bias in params.logit_bias], "stream": stream}


class LlamaFormat(WireFormat):
    """llama.cpp's /completion: one sequence, `timings`, no [DONE]."""

    ends_with_done = False

    def __init__(self, model: str, stream: RequestStream, fingerprint: str = "") -> None:
        super().__init__(model, stream, fingerprint)
        self._tokens_sent = 0  # generated ids already in a chunk (return_tokens)

    @property
    def post_sampling(self) -> bool:
        return self.stream.request.params.post_sampling_probs

    def new_tokens(self) -> list[int]:
        """return_tokens: the ids generated since the last chunk, as far as the events told
        (a finished sequence's: all of them)."""
        if not self.stream.request.return_tokens:
            return []
        choice = self.stream.choices[0]
        received = choice.result.generated_ids if choice.result else choice.token_ids
        upto = self._generated.get(0, 0)
        start, self._tokens_sent = self._tokens_sent, max(self._tokens_sent, upto)
        return list(received[start:upto])

    def body(self) -> dict[str, Any]:
        seq = self.stream.result(0)
        text = seq.text
        body = {"content": text, "model": self.model, "stop": True,
                "stop_type": stop_type(seq), "tokens_predicted": seq.num_generated,
                "tokens_evaluated": seq.num_prompt, "tokens_cached": seq.num_cached,
                "truncated": False,  # kvpark never cuts a prompt to fit: it parks or refuses
                "has_new_line": "\n" in text, "timings": timings(seq), "id_slot": seq.slot_id,
                "generation_settings": generation_settings(self.stream.request.params),
                "tokens": list(seq.generated_ids) if self.stream.request.return_tokens else []}
        if self.wants_logprobs:
            body["completion_probabilities"] = llama_probabilities(self.names, seq.logprobs,
                                                                   self.post_sampling)
        body["preempt"] = self.stream.preempt_summary()
        return body

    def with_probabilities(self, chunk: dict[str, Any], index: int, upto: int | None
                           ) -> dict[str, Any]:
        if self.wants_logprobs:
            entries = self.take_logprobs(index, upto)
            if entries:
                chunk["completion_probabilities"] = llama_probabilities(self.names, entries,
                                                                        self.post_sampling)
        return chunk

    def text(self, index: int, text: str, num_logprobs: int | None = None) -> dict[str, Any]:
        return self.with_probabilities({"content": text, "tokens": self.new_tokens(),
                                        "stop": False, "index": index,
                                        "id_slot": self.stream.choices[0].slot_id},
                                       index, num_logprobs)

    def finish(self, seq: SeqResult) -> dict[str, Any]:
        text = seq.text
        return self.with_probabilities(
            {"content": "", "tokens": self.new_tokens(), "stop": True, "index": seq.index,
             "id_slot": seq.slot_id, "model": self.model, "stop_type": stop_type(seq),
             "tokens_predicted": seq.num_generated, "tokens_evaluated": seq.num_prompt,
             "tokens_cached": seq.num_cached, "truncated": False,
             "has_new_line": "\n" in text,
             "generation_settings": generation_settings(self.stream.request.params, True),
             "timings": timings(seq)}, seq.index, None)

    def usage(self) -> dict[str, Any]:
        return {"usage": usage(self.stream.results)}

    def progress(self, progress: PromptProgress) -> dict[str, Any]:
        return {"index": 0, "content": "", "tokens": [], "stop": False,
                "prompt_progress": progress.as_json()}


def stop_type(seq: SeqResult) -> str:
    """llama.cpp's stop_type: a stop string matched ("word"), the length limit, or EOS."""
    if seq.finish_reason is FinishReason.LENGTH:
        return "limit"
    return "word" if seq.stopped_by_word else "eos"


FORMATS: dict[str, type[WireFormat]] = {
    "chat": ChatFormat, "completion": CompletionFormat, "llama": LlamaFormat}


def get_format(model: str, stream: RequestStream, fingerprint: str = "") -> WireFormat:
    if stream.request.tools is not None:
        return ToolChatFormat(model, stream, fingerprint)
    return FORMATS[stream.request.kind](model, stream, fingerprint)
