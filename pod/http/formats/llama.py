"""llama.cpp's /completion shape: `timings`, `generation_settings`, `stop_type`, no [DONE]."""

from __future__ import annotations

import math
from typing import Any

from ...core.messages import FinishReason, PromptProgress, SeqResult
from ...sampling.sampler import SamplingParams
from ..stream import RequestStream
from .logprobs import llama_probabilities
from .results import timings, usage
from .wire import WireFormat


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
        self._tokens_sent: dict[int, int] = {}  # per prompt: ids already in a chunk

    @property
    def post_sampling(self) -> bool:
        return self.stream.request.params.post_sampling_probs

    def new_tokens(self, index: int) -> list[int]:
        """return_tokens: the ids generated since the last chunk, as far as the events told
        (a finished sequence's: all of them)."""
        if not self.stream.request.return_tokens:
            return []
        choice = self.stream.choices[index]
        received = choice.result.generated_ids if choice.result else choice.token_ids
        upto = self._generated.get(index, 0)
        start = self._tokens_sent.get(index, 0)
        self._tokens_sent[index] = max(start, upto)
        return list(received[start:upto])

    def body(self) -> dict[str, Any] | list[dict[str, Any]]:  # type: ignore[override]
        """One prompt's result; several prompts' as a list (llama-server's shape)."""
        results = [self.result_body(seq) for seq in self.stream.results]
        return results[0] if len(results) == 1 else results

    def result_body(self, seq: SeqResult) -> dict[str, Any]:
        text = seq.text
        body = {"index": seq.index, "content": text, "model": self.model, "stop": True,
                "stop_type": stop_type(seq), "tokens_predicted": seq.num_generated,
                "tokens_evaluated": seq.num_prompt, "tokens_cached": seq.num_cached,
                "truncated": False,  # kvpark never cuts a prompt to fit: it parks or refuses
                "has_new_line": "\n" in text, "timings": timings(seq), "id_slot": seq.slot_id,
                "generation_settings": generation_settings(self.stream.request.params),
                "tokens": list(seq.generated_ids) if self.stream.request.return_tokens else []}
        if self.wants_logprobs:
            body["completion_probabilities"] = llama_probabilities(self.names, seq.logprobs,
                                                                   self.post_sampling)
        body["preempt"] = {"parks": seq.n_preempt, "recomputes": seq.n_recompute}
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
        return self.with_probabilities({"content": text, "tokens": self.new_tokens(index),
                                        "stop": False, "index": index,
                                        "id_slot": self.stream.choices[index].slot_id},
                                       index, num_logprobs)

    def finish(self, seq: SeqResult) -> dict[str, Any]:
        text = seq.text
        return self.with_probabilities(
            {"content": "", "tokens": self.new_tokens(seq.index), "stop": True,
             "index": seq.index,
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
