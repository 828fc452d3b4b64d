"""Reasoning models (issue 43): the think block split from the answer the same way whatever
pieces a stream cuts the text into; the budget that forces the block's end and the grammar that
waits for it (`ReasoningGate`), on a real tokenizer; the reasoning flags and fields as the chat
template and the parser see them."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from kvpark.pod.args import parse_args
from kvpark.pod.model.loader import builtin_tokenizer
from kvpark.pod.requests import parsers
from kvpark.pod.requests.errors import ApiError
from kvpark.pod.requests.generation_defaults import defaults_for
from kvpark.pod.requests.input_limits import InputLimits
from kvpark.pod.sampling.reasoning import ReasoningSplitter, ThinkingRule, split_reasoning
from kvpark.pod.sampling.reasoning_gate import ReasoningGate, ThinkingGate, gated

LIMITS = InputLimits.of(4096, 100)
OPENED, PLAIN = ThinkingRule(opened=True), ThinkingRule(opened=False)
# a template in the shape of Qwen3's: an earlier turn's reasoning rendered in a think block, the
# generation prompt opening one unless enable_thinking is false (then an empty block)
THINKING_TEMPLATE = """\
{%- for message in messages -%}
<|im_start|>{{ message.role }}
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{%- endif -%}"""

CASES = [  # (rule, output text, reasoning, content)
    (OPENED, "Let me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    (OPENED, "\n  a </think>b", "a", "b"),
    (OPENED, "cut short by the limit   ", "cut short by the limit", ""),
    (OPENED, "ends on part of a tag </thi", "ends on part of a tag </thi", ""),
    (OPENED, "</think>", None, ""),
    (PLAIN, "<think>\nplan\n</think>\n\nanswer", "plan", "answer"),
    (PLAIN, "  \n<think>x</think>y", "x", "y"),
    (PLAIN, "no block at all", None, "no block at all"),
    (PLAIN, "<thin but not a tag", None, "<thin but not a tag"),
    (PLAIN, "  <th", None, "  <th"),
    (PLAIN, "answer first <think>then</think>", None, "answer first <think>then</think>"),
    (OPENED, "a </think> b </think> c", "a", "b </think> c"),
]


@pytest.mark.parametrize("rule,text,reasoning,content", CASES)
def test_the_whole_output_splits_as_llama_servers_deepseek_format(rule, text, reasoning, content):
    split = split_reasoning(text, rule)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("rule,text,reasoning,content", CASES)
def test_any_pieces_a_stream_cuts_give_the_same_split(rule, text, reasoning, content):
    rng = random.Random(len(text))
    cuttings = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuttings += [list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        cuttings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in cuttings:
        splitter = ReasoningSplitter(rule)
        out = [splitter.push(piece) for piece in pieces] + [splitter.finish()]
        assert "".join(r for r, _ in out) == (reasoning or ""), pieces
        assert "".join(c for _, c in out) == content, pieces


def test_legacy_keeps_the_tags_in_the_content_and_none_splits_nothing():
    text = "plan</think>answer"
    legacy = split_reasoning(text, ThinkingRule(opened=True, keep_tags=True))
    assert (legacy.reasoning, legacy.content) == ("plan", text)
    assert split_reasoning(text, None).content == text


# ---- the gate: budget and a grammar that waits -----------------------------------------------

@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


class RecordingConstraint:
    """A grammar stand-in: bans token 0 and records what it was fed."""

    def __init__(self) -> None:
        self.fed: list[int] = []

    def mask(self, logits: torch.Tensor) -> None:
        logits[0] = float("-inf")

    def accept(self, token: int) -> None:
        self.fed.append(token)

    def is_done(self) -> bool:
        return False


def run_gate(gate: ReasoningGate, free: list[int], steps: int) -> list[int]:
    """Greedy over logits that prefer `free` tokens in turn: what the gate lets through."""
    out: list[int] = []
    for i in range(steps):
        logits = torch.zeros(gate.tokenizer.vocab_size)
        logits[free[i % len(free)]] = 5.0
        gate.mask(logits)
        token = int(torch.argmax(logits))
        gate.accept(token)
        out.append(token)
    return out


def forced_end(tok, message: str = "") -> tuple[int, ...]:
    return tuple(tok.encode(message + "</think>", add_bos=False))


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_a_spent_budget_forces_the_end_tag_then_lets_the_model_answer(tok, budget):
    word = tok.encode(" word", add_bos=False)[0]
    forced = forced_end(tok, " Enough.")
    gate = ReasoningGate(ThinkingGate(True, budget, forced), tok, None)
    out = run_gate(gate, [word], budget + len(forced) + 3)
    assert out[:budget] == [word] * budget
    assert tuple(out[budget:budget + len(forced)]) == forced
    assert out[budget + len(forced):] == [word] * 3  # answering: nothing forced any more
    split = split_reasoning(tok.decode(out), OPENED)
    assert split.reasoning == (" word" * budget + " Enough.").strip()
    assert split.content == "word word word"


def test_an_end_the_model_writes_itself_stops_the_count(tok):
    end = tok.encode("</think>", add_bos=False)
    word = tok.encode(" word", add_bos=False)[0]
    gate = ReasoningGate(ThinkingGate(True, 4, forced_end(tok)), tok, None)
    free = [word, *end, *[word] * 8]  # ends the block before the budget, then answers long
    assert run_gate(gate, free, len(free)) == free  # nothing forced, before or after


def test_a_block_the_model_opens_itself_is_counted_from_its_tag(tok):
    opening = tok.encode("<think>", add_bos=False)
    word = tok.encode(" word", add_bos=False)[0]
    forced = forced_end(tok)
    gate = ReasoningGate(ThinkingGate(False, 2, forced), tok, None)
    out = run_gate(gate, [*opening, word, word, word], len(opening) + 2 + len(forced))
    assert tuple(out[len(opening) + 2:]) == forced


def test_a_grammar_waits_for_the_end_of_an_opened_block(tok):
    inner = RecordingConstraint()
    forced = forced_end(tok)
    gate = ReasoningGate(ThinkingGate(True, 2, forced), tok, inner)
    out = run_gate(gate, [0], 2 + len(forced) + 3)
    assert out[:2] == [0, 0]  # while it reasons the grammar does not apply (it bans 0)
    assert inner.fed == out[2 + len(forced):] and 0 not in inner.fed


def test_without_a_budget_or_a_grammar_behind_a_block_there_is_no_gate(tok):
    inner = RecordingConstraint()
    assert gated(ThinkingGate(True, None, ()), tok, None) is None
    assert gated(ThinkingGate(False, None, ()), tok, inner) is inner  # the grammar from token 1
    assert isinstance(gated(ThinkingGate(True, None, ()), tok, inner), ReasoningGate)
    assert gated(None, tok, inner) is inner


# ---- fields, flags and the template ----------------------------------------------------------

@pytest.fixture
def thinking_tok():
    tok = copy.copy(builtin_tokenizer())  # the builtin one is shared: not changed in place
    tok.set_chat_template(THINKING_TEMPLATE)
    return tok


ASK = [{"role": "user", "content": "What is 2+2?"}]


def render(tok, body, argv=()):
    defaults = defaults_for(parse_args(["--model", "synthetic:tiny", *argv], env={}))
    parsers.check_defaults(defaults)
    chat = defaults.under_chat(body, LIMITS.max_context)
    request = parsers.parse_chat(chat, tok, LIMITS)
    return tok.decode(request.prompt_ids, skip_special=False), request


def test_the_template_opens_a_block_and_the_request_knows_it(thinking_tok):
    prompt, request = render(thinking_tok, {"messages": ASK})
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert request.thinking == ThinkingRule(opened=True)  # auto: the template has think tags
    assert request.thinking_gate.opened and request.thinking_gate.budget is None


@pytest.mark.parametrize("argv,body", [
    (["--reasoning", "off"], {}),
    (["--chat-template-kwargs", '{"enable_thinking": false}'], {}),
    ([], {"chat_template_kwargs": {"enable_thinking": False}}),
    ([], {"reasoning_effort": "none"}),
    (["--reasoning", "on"], {"chat_template_kwargs": {"enable_thinking": False}}),
])
def test_thinking_turned_off_renders_an_empty_block(thinking_tok, argv, body):
    prompt, request = render(thinking_tok, {"messages": ASK, **body}, argv)
    assert prompt.endswith("<think>\n\n</think>\n\n")  # llama.cpp's test_reasoning expects it
    assert not request.thinking.opened


def test_the_request_wins_over_the_flags_key_by_key(thinking_tok):
    argv = ["--chat-template-kwargs", '{"enable_thinking": false, "other": 1}']
    prompt, _ = render(thinking_tok, {"messages": ASK,
                                      "chat_template_kwargs": {"enable_thinking": True}}, argv)
    assert prompt.endswith("<think>\n")


def test_earlier_reasoning_reaches_the_template_under_either_name(thinking_tok):
    for name in ("reasoning_content", "reasoning"):
        history = [*ASK, {"role": "assistant", "content": "4", name: "two and two"},
                   {"role": "user", "content": "And 3+3?"}]
        prompt, _ = render(thinking_tok, {"messages": history})
        assert "<think>\ntwo and two\n</think>\n\n4<|im_end|>" in prompt


def test_budget_from_the_flag_and_the_request_and_none_format(thinking_tok):
    _, request = render(thinking_tok, {"messages": ASK}, ["--reasoning-budget", "7",
                                                           "--reasoning-budget-message", "Ok."])
    assert request.thinking_gate.budget == 7
    assert thinking_tok.decode(list(request.thinking_gate.forced_ids)) == "Ok.</think>"
    _, request = render(thinking_tok, {"messages": ASK, "thinking_budget_tokens": 3},
                        ["--reasoning-budget", "7"])
    assert request.thinking_gate.budget == 3
    _, request = render(thinking_tok, {"messages": ASK, "reasoning_format": "none"})
    assert request.thinking is None


def test_a_template_without_think_tags_has_no_rule_unless_asked(tok):
    _, request = render(tok, {"messages": ASK})
    assert request.thinking is None and request.thinking_gate is None
    _, request = render(tok, {"messages": ASK, "reasoning_format": "deepseek"})
    assert request.thinking == ThinkingRule(opened=False)


@pytest.mark.parametrize("body,param", [
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs"),
    ({"reasoning_format": "deepseek2"}, "reasoning_format"),
    ({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens"),
    ({"thinking_budget_tokens": 1.5}, "thinking_budget_tokens"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"reasoning_budget_message": "x" * 5000}, "reasoning_budget_message"),
])
def test_bad_reasoning_fields_are_a_400_naming_them(thinking_tok, body, param):
    with pytest.raises(ApiError) as info:
        render(thinking_tok, {"messages": ASK, **body})
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("argv", [["--chat-template-kwargs", "[1]"],
                                  ["--reasoning-budget", "-2"],
                                  ["--reasoning-parser", "mistral"],
                                  ["--reasoning", "maybe"]])
def test_bad_reasoning_flags_exit_2(argv):
    with pytest.raises(SystemExit) as info:
        parse_args(["--model", "synthetic:tiny", *argv], env={})
    assert info.value.code == 2


def test_reserved_template_variables_from_the_flag_fail_at_start():
    defaults = defaults_for(parse_args(["--chat-template-kwargs", '{"tools": 1}'], env={}))
    with pytest.raises(ValueError, match="tools cannot be set"):
        parsers.check_defaults(defaults)


def test_vllms_reasoning_parser_flag_is_the_deepseek_format():
    assert parse_args(["--reasoning-parser", "qwen3"], env={}).reasoning_format == "deepseek"
    assert parse_args([], env={"LLAMA_ARG_THINK": "none"}).reasoning_format == "none"
