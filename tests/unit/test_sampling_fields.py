"""Penalties, logit bias, min_tokens and logprobs as pure functions, against hand computations."""

import math

import pytest
import torch

from kvpark.pod.core.messages import Submission
from kvpark.pod.core.sequence import Sequence
from kvpark.pod.core.step_plan import ScheduledSeq
from kvpark.pod.core.text_output import StopMatcher
from kvpark.pod.http.formats.logprobs import completion_logprobs
from kvpark.pod.requests.errors import ApiError
from kvpark.pod.requests.sampling_fields import sampling_params
from kvpark.pod.sampling.sampler import (
    SamplingParams,
    TokenLogprob,
    apply_presence_frequency,
    apply_repetition,
    get_logprob,
    make_generator,
    process_logits,
    repeat_window,
)
from kvpark.pod.worker.runner import ModelRunner

ROW = [2.0, -1.0, 0.5, 3.0, 0.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    row = torch.tensor(ROW)
    out = apply_repetition(row, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0, 0.0]
    assert row.tolist() == ROW  # pure: the input row is untouched


def test_presence_and_frequency_penalties_follow_openai_formula():
    out = apply_presence_frequency(torch.tensor(ROW), [0, 0, 2], presence=0.5, frequency=1.0)
    assert out.tolist() == [2.0 - 2 * 1.0 - 0.5, -1.0, 0.5 - 1.0 - 0.5, 3.0, 0.0]


def test_prompt_counts_for_repetition_but_not_for_presence_or_frequency():
    prompt, generated = [3], [1]
    freq = process_logits(torch.tensor(ROW), SamplingParams(frequency_penalty=1.0),
                          prompt + generated, num_prompt=1)
    assert freq.tolist() == [2.0, -2.0, 0.5, 3.0, 0.0]  # token 3 of the prompt is not counted
    rep = process_logits(torch.tensor(ROW), SamplingParams(repetition_penalty=1.5),
                         prompt + generated, num_prompt=1)
    assert rep.tolist() == [2.0, -1.5, 0.5, 2.0, 0.0]


def test_llama_repeat_penalty_sees_only_the_last_n_tokens():
    assert repeat_window([1, 2, 3, 4], 2) == [3, 4]
    assert repeat_window([1, 2, 3, 4], -1) == [1, 2, 3, 4]
    assert repeat_window([1, 2, 3, 4], 0) == []
    params = SamplingParams(repeat_penalty=2.0, repeat_last_n=1)
    out = process_logits(torch.tensor(ROW), params, [0, 3], num_prompt=2)
    assert out.tolist() == [2.0, -1.0, 0.5, 1.5, 0.0]  # token 0 is outside the window
    assert not SamplingParams(repeat_penalty=2.0, repeat_last_n=0).needs_processing


def test_logit_bias_forces_bans_and_adds_up():
    params = SamplingParams(logit_bias=((4, 100.0), (3, float("-inf"))))
    out = process_logits(torch.tensor(ROW), params, [0], num_prompt=1)
    assert out.argmax().item() == 4 and out[3].item() == float("-inf")
    twice = SamplingParams(logit_bias=((1, 1.0), (1, 2.0)))
    assert process_logits(torch.tensor(ROW), twice, [0], 1)[1].item() == 2.0


def test_min_tokens_masks_every_eos_id_until_reached():
    params = SamplingParams(min_tokens=2, eos_ids=frozenset({3, 0}))
    early = process_logits(torch.tensor(ROW), params, [9, 1], num_prompt=1)  # 1 generated
    assert early[0].item() == early[3].item() == float("-inf") and early.argmax().item() == 2
    done = process_logits(torch.tensor(ROW), params, [9, 1, 1], num_prompt=1)
    assert done.tolist() == ROW


def test_default_params_need_no_processing():
    assert not SamplingParams().needs_processing
    for extra in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1},
                  {"repetition_penalty": 1.1}, {"repeat_penalty": 1.1},
                  {"logit_bias": ((1, 1.0),)}, {"min_tokens": 1}):
        assert SamplingParams(**extra).needs_processing, extra


def test_logprob_is_log_softmax_of_raw_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    entry = get_logprob(torch.log_softmax(logits, -1), 1, 2)
    norm = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert entry.token == 1 and entry.logprob == pytest.approx(2 - norm, abs=1e-6)
    assert [t for t, _ in entry.top] == [2, 1]
    assert entry.top[0][1] == pytest.approx(3 - norm, abs=1e-6)


def _seq(params, tokens, num_prompt=1):
    seq = Sequence(Submission("r", tuple(tokens[:num_prompt]), params, 0, lambda *a: None),
                   make_generator(0))
    seq.tokens = list(tokens)
    seq.num_computed = len(tokens) - 1
    return ScheduledSeq(seq, 1)


def test_runner_processes_only_rows_that_ask_and_reports_raw_logprobs():
    logits = torch.tensor([ROW, ROW, ROW])
    plan = [_seq(SamplingParams(temperature=0), [1, 3]),
            _seq(SamplingParams(temperature=0, logit_bias=((1, 100.0),), logprobs=1), [1, 3]),
            _seq(SamplingParams(temperature=0, repetition_penalty=3.0), [3, 3])]
    out = ModelRunner.sample(plan, logits.clone())
    assert [out[id(item)].token for item in plan] == [3, 1, 0]
    assert out[id(plan[0])].logprob is None
    raw = torch.log_softmax(torch.tensor(ROW), -1)
    lp = out[id(plan[1])].logprob  # of the model's distribution: the bias does not show
    assert lp.logprob == pytest.approx(raw[1].item()) and lp.top == ((3, pytest.approx(
        raw[3].item())),)


def test_stop_strings_are_passed_over_before_min_tokens():
    matcher = StopMatcher(("ab",))
    assert matcher.feed("xab", can_stop=False) is None
    assert matcher.feed("a") is None and matcher.held_back == 1
    assert matcher.feed("b") == 2


class _Names:
    def get(self, token):
        return {1: ("He", [72, 101]), 2: ("llo", [108, 108, 111]), 3: ("!", [33])}[token]


def test_completion_logprobs_shape_offsets_and_sampled_token_in_top():
    entries = [TokenLogprob(1, -0.5, ((2, -0.1),)), TokenLogprob(2, -0.2, ((2, -0.2),))]
    shaped = completion_logprobs(_Names(), entries, offset=4)
    assert shaped == {"tokens": ["He", "llo"], "token_logprobs": [-0.5, -0.2],
                      "top_logprobs": [{"llo": -0.1, "He": -0.5}, {"llo": -0.2}],
                      "text_offset": [4, 6]}


def _parse(body, kind="completion", max_context=100):
    return sampling_params(body, max_context, ("max_tokens",), None, kind)


def test_parsing_of_the_new_fields():
    p = _parse({"logit_bias": {"5": 10, "7": -100}, "min_tokens": 3, "presence_penalty": -2,
                "repeat_last_n": -1, "repetition_penalty": 1.2})
    assert p.logit_bias == ((5, 10.0), (7, -100.0)) and p.min_tokens == 3
    assert p.presence_penalty == -2 and p.repeat_last_n == -1 and p.repetition_penalty == 1.2
    assert _parse({"logit_bias": [[5, False], [6, 1.5]]}, "llama").logit_bias == (
        (5, float("-inf")), (6, 1.5))
    assert _parse({"logprobs": True, "top_logprobs": 3}, "chat").logprobs == 3
    assert _parse({"logprobs": True}, "chat").logprobs == 0
    assert _parse({"logprobs": False, "top_logprobs": 0}, "chat").logprobs is None
    assert _parse({"logprobs": 0}).logprobs == 0 and _parse({}).logprobs is None
    assert _parse({"n_probs": 0}, "llama").logprobs is None
    assert _parse({"n_probs": 4}, "llama").logprobs == 4


@pytest.mark.parametrize("body,kind,param", [
    ({"top_logprobs": 2}, "chat", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "chat", "top_logprobs"),
    ({"logprobs": 1}, "chat", "logprobs"),
    ({"logprobs": 6}, "completion", "logprobs"),
    ({"logprobs": True}, "completion", "logprobs"),
    ({"presence_penalty": 2.5}, "completion", "presence_penalty"),
    ({"frequency_penalty": "1"}, "completion", "frequency_penalty"),
    ({"repetition_penalty": 0}, "completion", "repetition_penalty"),
    ({"repetition_penalty": 1e-300}, "completion", "repetition_penalty"),
    ({"repeat_penalty": -1}, "llama", "repeat_penalty"),
    ({"repeat_last_n": -2}, "llama", "repeat_last_n"),
    ({"logit_bias": {"x": 1}}, "chat", "logit_bias"),
    ({"logit_bias": {"5": 101}}, "chat", "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "chat", "logit_bias"),
    ({"logit_bias": {"²": 1}}, "chat", "logit_bias"),
    ({"logit_bias": [[1]]}, "llama", "logit_bias"),
    ({"logit_bias": "5"}, "chat", "logit_bias"),
    ({"min_tokens": -1}, "completion", "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "completion", "min_tokens"),
    ({"n_probs": 101}, "llama", "n_probs"),
])
def test_bad_values_are_refused_by_name(body, kind, param):
    with pytest.raises(ApiError) as exc:
        _parse(body, kind)
    assert exc.value.status == 400 and exc.value.param == param


class _BanToken:
    def __init__(self, token):
        self.token = token

    def mask(self, logits):
        logits[self.token] = float("-inf")


def test_the_constraint_masks_after_bias_on_the_models_inference_tensors():
    """Order: bias and penalties, then the constraint's mask, then the draw; the model's logits
    are inference tensors, which the rows are changed in place in."""
    with torch.inference_mode():
        logits = torch.tensor([ROW])
    item = _seq(SamplingParams(temperature=0, logit_bias=((4, 100.0),)), [1, 3])
    item.seq.constraint = _BanToken(4)
    assert ModelRunner.sample([item], logits)[id(item)].token == 3
