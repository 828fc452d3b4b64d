"""The table of each API's field names: every reader (the parsers, the OpenAPI document, the
admission check, the server-wide defaults) agrees with it."""

import jsonschema
import pytest

from kvpark.pod.http.openapi import get_openapi
from kvpark.pod.requests.errors import ApiError
from kvpark.pod.requests.fields import API_FIELDS, COMMON_MAX_TOKENS, UNLIMITED_AT_NO_LIMIT
from kvpark.pod.requests.input_limits import InputLimits
from kvpark.pod.requests.sampling_fields import sampling_params

MAX_CONTEXT = 512
REQUEST_SCHEMA = {"chat": "ChatRequest", "completion": "CompletionRequest",
                  "llama": "LlamaCompletionRequest"}


def request_schema(kind: str) -> dict:
    schemas = get_openapi(InputLimits.of(MAX_CONTEXT, 4096))["components"]["schemas"]
    return schemas[REQUEST_SCHEMA[kind]]


def test_every_api_reads_the_common_name_so_a_server_default_reaches_each_route():
    for fields in API_FIELDS.values():
        assert COMMON_MAX_TOKENS in fields.limit_names


def test_an_error_quotes_a_name_the_api_reads():
    for fields in API_FIELDS.values():
        assert fields.quoted_limit in fields.limit_names


def test_each_api_knows_its_output_limit_names():
    for fields in API_FIELDS.values():
        assert set(fields.limit_names) <= fields.known


@pytest.mark.parametrize("kind", sorted(API_FIELDS))
def test_the_document_describes_each_name_the_api_reads_for_the_output_limit(kind):
    properties = request_schema(kind)["properties"]
    for name in API_FIELDS[kind].limit_names:
        schema = jsonschema.Draft4Validator(properties[name])
        assert schema.is_valid(MAX_CONTEXT) and not schema.is_valid(MAX_CONTEXT + 1)
        assert schema.is_valid(-1) == (name in UNLIMITED_AT_NO_LIMIT)


@pytest.mark.parametrize("kind", sorted(API_FIELDS))
def test_the_first_name_sent_wins(kind):
    names = API_FIELDS[kind].limit_names
    body = {name: 3 + i for i, name in enumerate(names)}
    assert sampling_params(body, MAX_CONTEXT, names).max_tokens == 3


@pytest.mark.parametrize("kind", sorted(API_FIELDS))
def test_a_refused_limit_names_the_field_sent(kind):
    for name in API_FIELDS[kind].limit_names:
        with pytest.raises(ApiError) as caught:
            sampling_params({name: 0}, MAX_CONTEXT, API_FIELDS[kind].limit_names)
        assert caught.value.param == name
