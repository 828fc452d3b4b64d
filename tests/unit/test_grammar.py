"""Grammar constraints against SmolLM2's real tokenizer (mask, accept, done, EOS), the grammar
cache, and tool calling's pure parts (the plan, the history, parsing the output)."""

import copy

import pytest
import torch

from kvpark.pod.args import parse_args
from kvpark.pod.model.loader import builtin_tokenizer
from kvpark.pod.requests import parsers as protocol
from kvpark.pod.requests import tools
from kvpark.pod.requests.errors import ApiError
from kvpark.pod.requests.input_limits import InputLimits
from kvpark.pod.sampling.grammar import Grammar, GrammarError, Grammars

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
LIMITS = InputLimits.of(4096, 100)


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(tok, cache_size=2)


def allowed(constraint, vocab: int) -> torch.Tensor:
    row = torch.zeros(vocab)
    constraint.mask(row)
    return row == 0


def test_a_valid_document_is_never_masked_and_ends_the_grammar(tok, grammars):
    constraint = grammars.constraint(Grammar.from_json_schema(SCHEMA))
    ids = tok.encode('{"name": "Ada", "age": 36}', add_bos=False)
    for token in ids:
        ok = allowed(constraint, tok.vocab_size)
        assert ok[token], f"token {tok.token_text(token)!r} was masked"
        assert not ok[sorted(tok.eos_token_ids)].any(), "EOS allowed inside the object"
        assert not constraint.is_done()
        constraint.accept(token)
    assert constraint.is_done()


def test_tokens_that_break_the_schema_are_masked(tok, grammars):
    constraint = grammars.constraint(Grammar.from_json_schema(SCHEMA))
    ok = allowed(constraint, tok.vocab_size)
    for text in ("hello", "[", '"', "1"):
        assert not ok[tok.encode(text, add_bos=False)[0]], text
    for token in tok.encode('{"name": "Ada", "', add_bos=False):
        constraint.accept(token)
    ok = allowed(constraint, tok.vocab_size)
    assert ok[tok.encode("age", add_bos=False)[0]]
    assert not ok[tok.encode("name", add_bos=False)[0]]  # required once, no extra keys


def test_eos_only_where_the_grammar_may_end_and_padded_rows_stay_masked(tok, grammars):
    constraint = grammars.constraint(Grammar.from_gbnf('root ::= "yes" | "yes" [!]+'))
    eos = sorted(tok.eos_token_ids)
    for token in tok.encode("yes", add_bos=False):
        assert not allowed(constraint, tok.vocab_size)[eos].any()
        constraint.accept(token)
    row = torch.zeros(tok.vocab_size + 64)  # a model whose embedding is padded past the vocab
    constraint.mask(row)
    assert (row[eos] == 0).all() and not constraint.is_done()
    assert (row[tok.vocab_size:] == float("-inf")).all()
    constraint.accept(eos[0])
    assert constraint.is_done()


def test_constraints_from_one_cached_grammar_are_independent(tok, grammars):
    grammar = Grammar.from_json_schema(SCHEMA)
    assert grammars.compile(grammar) is grammars.compile(grammar)
    first, second = grammars.constraint(grammar), grammars.constraint(grammar)
    for token in tok.encode('{"name"', add_bos=False):
        first.accept(token)
    brace = tok.encode("{", add_bos=False)[0]
    assert allowed(second, tok.vocab_size)[brace] and not allowed(first, tok.vocab_size)[brace]
    # the LRU keeps cache_size grammars: the oldest is compiled again
    for schema in ({"type": "integer"}, {"type": "boolean"}):
        grammars.compile(Grammar.from_json_schema(schema))
    assert grammar.text not in grammars._compiled


@pytest.mark.parametrize("make", [
    lambda: Grammar.from_json_schema({"type": "nonsense"}),
    lambda: Grammar.from_gbnf("root ::= missing"),
    lambda: Grammar.from_json_schema({"$ref": "#/nowhere"}),
])
def test_grammars_that_do_not_compile_raise(grammars, make):
    with pytest.raises(GrammarError):
        grammars.compile(make())


CYCLES = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"anyOf": [{"$ref": "#"}]},
]


@pytest.mark.parametrize("grammar", [Grammar.from_json_schema(s) for s in CYCLES] + [
    Grammar.from_gbnf('root ::= root "a"'), Grammar.from_gbnf("root ::= x\nx ::= x"),
], ids=["ref-root", "defs-self", "defs-mutual", "anyof-self", "gbnf-left", "gbnf-self"])
def test_a_grammar_whose_rules_only_lead_back_to_themselves_matches_nothing(grammars, grammar):
    """llguidance compiles these; only a first mask finds no token fits, and the output would
    be an empty string ending on EOS, which no schema allows."""
    with pytest.raises(GrammarError, match="only lead"):
        grammars.compile(grammar)


@pytest.mark.parametrize("regex", [r"[^\s\S]", "[a&&b]"])
def test_a_regex_no_text_can_match_is_a_grammar_error(grammars, regex):
    """Not a KeyError (a 500): the client is told its regex matches nothing."""
    with pytest.raises(GrammarError, match="no text can match this regex"):
        grammars.compile(Grammar.from_regex(regex))


def test_a_recursive_schema_with_a_way_out_still_compiles(tok, grammars):
    tree = {"type": "object", "properties": {
        "v": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v"], "additionalProperties": False}
    empty = Grammar.from_gbnf('root ::= ""')  # matches the empty text: EOS at once is right
    assert grammars.compile(empty) is not None
    constraint = grammars.constraint(Grammar.from_json_schema(tree))
    for token in tok.encode('{"v": 1, "children": [{"v": 2}]}', add_bos=False):
        assert allowed(constraint, tok.vocab_size)[token], tok.token_text(token)
        constraint.accept(token)
    assert constraint.is_done()


# ---- the request ----------------------------------------------------------------------------

def test_response_format_and_llama_fields_name_the_field_at_fault(tok):
    def error(body):
        with pytest.raises(ApiError) as exc:
            protocol.structured_output(body, tok)
        return exc.value

    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    assert error({"response_format": bad}).param == "response_format.json_schema.schema"
    assert error({"response_format": {"type": "xml"}}).param == "response_format"
    assert error({"grammar": "root ::= ("}).param == "grammar"
    assert error({"json_schema": {"type": "nope"}}).param == "json_schema"
    assert error({"grammar": 'root ::= "a"', "json_schema": SCHEMA}).param == "grammar"
    assert protocol.structured_output({"response_format": {"type": "text"}}, tok) is None
    assert protocol.structured_output({"json_schema": SCHEMA}, tok).source == "json_schema"


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    # a name a call cannot hold unescaped: it would force <|im_end|> (EOS) into the output
    ({"tools": [{"type": "function", "function": {"name": 'a"b\n<|im_end|>'}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": "get_weather"}, "tools"),
])
def test_bad_tools_name_the_field(body, param):
    with pytest.raises(tools.ToolError) as exc:
        tools.get_tool_plan(body)
    assert exc.value.param == param


def test_the_output_schema_follows_tool_choice():
    auto = tools.get_tool_plan({"tools": [WEATHER]}).output_schema()
    assert [list(s["properties"]) for s in auto["anyOf"]] == [["tool_calls"], ["response"]]
    required = tools.get_tool_plan({"tools": [WEATHER], "tool_choice": "required",
                                    "parallel_tool_calls": False}).output_schema()
    assert list(required["properties"]) == ["tool_calls"]
    assert required["properties"]["tool_calls"]["maxItems"] == 1
    other = {"type": "function", "function": {"name": "other"}}
    named = tools.get_tool_plan({"tools": [WEATHER, other], "tool_choice": {
        "type": "function", "function": {"name": "other"}}}).output_schema()
    items = named["properties"]["tool_calls"]["items"]["anyOf"]
    assert [i["properties"]["name"]["const"] for i in items] == ["other"]
    assert not tools.get_tool_plan({"tools": [WEATHER], "tool_choice": "none"}).can_call


def test_tool_output_is_parsed_into_openai_calls():
    out = tools.parse_output('{"tool_calls": [{"name": "get_weather", "arguments": '
                             '{"city": "Paris"}}, {"name": "f", "arguments": {}}]}')
    assert out.content is None and len(out.tool_calls) == 2
    call = out.tool_calls[0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert out.tool_calls[0]["id"] != out.tool_calls[1]["id"]
    assert tools.parse_output('{"response": "Hi!"}') == tools.ParsedOutput("Hi!")
    assert tools.parse_output('{"response": {"a": 1}}').content == '{"a": 1}'
    assert tools.parse_output('{"tool_calls": [{"na') == tools.ParsedOutput("")  # cut short


def test_a_tool_round_trip_is_rendered_into_the_prompt(tok):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = {"tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]}
    gen = protocol.parse_chat(body, tok, LIMITS)
    text = tok.decode(gen.prompt_ids, skip_special=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call any of the following")
    assert '"name": "get_weather"' in text and "Respond in JSON format" in text
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}' in text
    assert ('<|im_start|>user\n{"tool_response": {"tool": "get_weather", "tool_call_id": '
            '"call_1", "content": "sunny, 24 C"}}<|im_end|>') in text
    assert gen.tools is not None and gen.grammar is not None
    none = protocol.parse_chat({**body, "tool_choice": "none"}, tok, LIMITS)
    assert none.tools is None and none.grammar is None
    assert "You can call" not in tok.decode(none.prompt_ids, skip_special=False)


@pytest.mark.parametrize("message,param", [
    ({"role": "user", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
     "messages[0].content"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"type": "function"}]}, "messages[0].tool_calls[0]"),
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
])
def test_bad_tool_history_names_the_message(tok, message, param):
    with pytest.raises(ApiError) as exc:
        protocol.parse_chat({"messages": [message]}, tok, LIMITS)
    assert exc.value.param == param


def test_chat_template_flag_reads_and_checks_a_jinja_file(tmp_path, tok):
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | list }}"
                    "{% endif %}")
    assert parse_args([], env={"KVPARK_CHAT_TEMPLATE": str(good)}).chat_template == str(good)
    (tmp_path / "bad.jinja").write_text("{% for %}")
    for bad in ("bad.jinja", "missing.jinja"):
        with pytest.raises(SystemExit):
            parse_args(["--chat-template", str(tmp_path / bad)], env={})
    custom = copy.copy(tok)  # builtin_tokenizer() is shared: its template must stay
    custom.set_chat_template(good.read_text())
    ids = custom.encode_chat([{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert custom.decode(ids) == "[user] hi\nTOOLS ['get_weather']"
    assert "[user]" not in tok.decode(tok.encode_chat([{"role": "user", "content": "hi"}]))


def test_a_grammar_the_checker_cannot_finish_in_time_is_refused_and_the_next_one_compiles(tok):
    """The child is killed past its time limit and a new one checks the next grammar."""
    grammars = Grammars(tok)
    grammars.checker.timeout = 1e-6
    with pytest.raises(GrammarError, match="took longer than"):
        grammars.compile(Grammar.from_regex("[a-z]{1,40}@[a-z]{1,40}"))
    grammars.checker.timeout = 60
    assert grammars.compile(Grammar.from_regex("[0-9]+")) is not None
    grammars.checker.close()


def test_a_grammar_that_kills_the_checker_is_refused_and_the_next_one_compiles(tok):
    chain = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(4000)) + 'r4000: "a"'
    grammars = Grammars(tok)
    with pytest.raises(GrammarError, match="crashed compiling it"):
        grammars.compile(Grammar.from_gbnf(chain))
    assert grammars.compile(Grammar.from_regex("[0-9]+")) is not None
    grammars.checker.close()
