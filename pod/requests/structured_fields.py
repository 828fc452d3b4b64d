"""Constrained output and tools as requests ask for them: OpenAI's `response_format`, llama.cpp's
`grammar` and `json_schema`, vLLM's `structured_outputs` (and its older `guided_*`), and the
tool plan; each compiled here, so a schema or grammar that cannot work is the client's 400.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..model.tokenizer import Tokenizer
from ..sampling.grammar import ANY_JSON_OBJECT, Grammar, GrammarError, get_grammars
from ..sampling.grammar_check import GrammarCheckUnavailable
from . import tools
from .errors import MAX_SHOWN, ApiError, clip
from .errors import bad_field as _bad
from .json_body import decode_field_text


def _response_format(body: dict) -> tuple[str, Grammar] | None:
    """OpenAI's `response_format`: (the field to blame, its grammar), None for text."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", _from_schema("response_format", ANY_JSON_OBJECT)
    if kind != "json_schema":
        raise _bad("response_format", "expected {'type': 'text'}, {'type': 'json_object'} or "
                   "{'type': 'json_schema', 'json_schema': {...}}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "expected an object with 'name' and 'schema'")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise _bad("response_format.json_schema.schema", "expected a JSON schema object")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise _bad("response_format.json_schema.strict", "expected true or false")
    # strict or not, the output is made to match the schema
    where = "response_format.json_schema.schema"
    return where, _from_schema(where, schema)


def _from_schema(field_name: str, schema: Any) -> Grammar:
    try:
        return Grammar.from_json_schema(schema)
    except GrammarError as exc:
        raise _bad(field_name, f"does not compile: {clip(str(exc), 2 * MAX_SHOWN)}") from None


def _llama_grammar(body: dict) -> tuple[str, Grammar] | None:
    """llama.cpp's `grammar` (GBNF) or `json_schema` (a schema object)."""
    grammar, schema = body.get("grammar"), body.get("json_schema")
    if grammar not in (None, "") and schema not in (None, {}):
        raise _bad("grammar", "send either 'grammar' or 'json_schema', not both")
    if grammar not in (None, ""):
        if not isinstance(grammar, str):
            raise _bad("grammar", "expected GBNF text")
        try:
            return "grammar", Grammar.from_gbnf(grammar)
        except GrammarError as exc:
            raise _bad("grammar", clip(str(exc), 2 * MAX_SHOWN)) from None
    if schema not in (None, {}):
        if not isinstance(schema, dict):
            raise _bad("json_schema", "expected a JSON schema object")
        return "json_schema", _from_schema("json_schema", schema)
    return None


# vLLM's `structured_outputs` keys (and its older top-level `guided_*` fields) -> grammar makers
VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def _vllm_constraint(kind: str, value: Any, where: str) -> Grammar:
    try:
        if kind == "json":
            schema = decode_field_text(value, where) if isinstance(value, str) else value
            if not isinstance(schema, (dict, bool)):
                raise _bad(where, "expected a JSON schema (an object, or its JSON text)")
            return Grammar.from_json_schema(schema)
        if kind == "json_object":
            if value is not True:
                raise _bad(where, "expected true")
            return Grammar.from_json_schema(ANY_JSON_OBJECT)
        if kind == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
                raise _bad(where, "expected a non-empty list of strings")
            return Grammar.from_choice(value)
        if not isinstance(value, str) or not value:
            raise _bad(where, "expected a non-empty string")
        return Grammar.from_regex(value) if kind == "regex" else Grammar.from_gbnf(value)
    except GrammarError as exc:
        raise _bad(where, f"does not compile: {clip(str(exc), 2 * MAX_SHOWN)}") from None


def _structured_outputs(body: dict) -> tuple[str, Grammar] | None:
    """vLLM's `structured_outputs` object (one constraint kind in it), or a `guided_*` field."""
    given = {GUIDED[name]: body[name] for name in GUIDED if body.get(name) is not None}
    value = body.get("structured_outputs")
    if value is not None:
        if not isinstance(value, dict):
            raise _bad("structured_outputs", "expected an object such as {\"json\": {...}}, "
                       "{\"regex\": ...}, {\"choice\": [...]} or {\"grammar\": ...}")
        given.update({k: v for k, v in value.items() if k in VLLM_KINDS and v not in (None, False)})
    if not given:
        return None
    if len(given) > 1:  # vLLM's rule
        raise _bad("structured_outputs", "You can only use one kind of structured outputs "
                   f"constraint but multiple are specified: {', '.join(sorted(given))}")
    (kind, spec), = given.items()
    where = f"structured_outputs.{kind}"
    return where, _vllm_constraint(kind, spec, where)


def structured_output(body: dict, tokenizer: Tokenizer) -> Grammar | None:
    """The grammar the output must match (compiled here: an error is the client's 400)."""
    chosen = [c for c in (_response_format(body), _llama_grammar(body),
                          _structured_outputs(body)) if c is not None]
    if len(chosen) > 1:
        raise _bad("response_format", "send one of 'response_format', 'grammar', "
                   "'json_schema' and 'structured_outputs'")
    if not chosen:
        return None
    field_name, grammar = chosen[0]
    return compiled(field_name, grammar, tokenizer)


def compiled(field_name: str, grammar: Grammar, tokenizer: Tokenizer) -> Grammar:
    try:
        get_grammars(tokenizer).compile(grammar)
    except GrammarError as exc:
        raise _bad(field_name, f"does not compile: {clip(str(exc), 2 * MAX_SHOWN)}") from None
    except GrammarCheckUnavailable as exc:
        raise ApiError(503, str(exc), param=field_name, error_type="unavailable") from None
    return grammar


def tool_plan(body: dict, grammar: Grammar | None) -> tools.ToolPlan | None:
    try:
        plan = tools.get_tool_plan(body)
    except tools.ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    if plan is None or not plan.can_call:
        return plan
    if grammar is not None and grammar.source != "json_schema":
        raise _bad("grammar", "a grammar cannot be combined with tools")
    if grammar is None:
        return plan
    # a plain answer (tool_choice auto) holds the asked-for JSON in `response`
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        schema = fmt["json_schema"].get("schema", {})
    else:
        schema = body.get("json_schema") or ANY_JSON_OBJECT
    return dataclasses.replace(plan, response_schema=schema)
