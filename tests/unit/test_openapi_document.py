"""The OpenAPI document and the request validator agree on the limits they both state."""

import jsonschema
import pytest

from kvpark.pod.http.openapi import get_openapi
from kvpark.pod.requests.errors import ApiError
from kvpark.pod.requests.fields import MAX_STOP_CHARS
from kvpark.pod.requests.input_limits import InputLimits
from kvpark.pod.requests.sampling_fields import sampling_params

MAX_CONTEXT = 512


def schema_accepts(request: str, name: str, value) -> bool:
    schemas = get_openapi(InputLimits.of(MAX_CONTEXT, 4096))["components"]["schemas"]
    schema = schemas[request]["properties"][name]
    return jsonschema.Draft4Validator(schema).is_valid(value)


def validator_accepts(body: dict, names: tuple[str, ...]) -> bool:
    try:
        sampling_params(body, MAX_CONTEXT, names)
    except ApiError as exc:
        assert exc.status == 400 and exc.param in body
        return False
    return True


@pytest.mark.parametrize("value", [-2, -1, 0, 1, 7, MAX_CONTEXT, MAX_CONTEXT + 1])
def test_n_predict_schema_matches_the_validator(value):
    """-1 is unlimited, 1..max_context a limit; 0 is refused by both (the document said -1)."""
    accepted = validator_accepts({"n_predict": value}, ("n_predict", "max_tokens"))
    assert schema_accepts("LlamaCompletionRequest", "n_predict", value) == accepted
    assert accepted == (value == -1 or 1 <= value <= MAX_CONTEXT)


@pytest.mark.parametrize("stop", ["x" * MAX_STOP_CHARS, "x" * (MAX_STOP_CHARS + 1),
                                  ["a", "x" * (MAX_STOP_CHARS + 1)], ["a"] * 9])
def test_stop_schema_matches_the_validator(stop):
    accepted = validator_accepts({"stop": stop}, ("max_tokens",))
    assert schema_accepts("CompletionRequest", "stop", stop) == accepted


@pytest.mark.parametrize("kind,request_name", [("chat", "ChatRequest"),
                                               ("completion", "CompletionRequest"),
                                               ("llama", "LlamaCompletionRequest")])
def test_each_request_body_states_exactly_the_fields_its_parser_reads(kind, request_name):
    from kvpark.pod.requests.fields import API_FIELDS

    schemas = get_openapi(InputLimits.of(MAX_CONTEXT, 4096))["components"]["schemas"]
    assert set(schemas[request_name]["properties"]) == API_FIELDS[kind].known
