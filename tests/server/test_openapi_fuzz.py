"""schemathesis against the server's own /openapi.json: no 5xx, no schema violation.

One slot and a 128-token pool keep every generated request small and its run short; the
examples per operation are bounded so the run fits in CI. (schemathesis' pytest plugin does not
load under this pytest, so the operations are driven through hypothesis directly.)
"""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks
from serverproc import ServerProcess

CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_server():
    with ServerProcess(["-np", "1", "-c", "128", "--max-queue", "64"]) as server:
        yield server


def operations(url):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/completion",
                                  "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
                                  "/v1/models", "/slots", "/health", "/metrics"])
def test_no_server_errors_and_responses_match_the_schema(fuzz_server, path):
    (operation,) = [op for op in operations(fuzz_server.url) if op.path == path]

    @given(case=operation.as_strategy())
    @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    def exercise(case):
        case.call_and_validate(base_url=fuzz_server.url, timeout=60, checks=CHECKS)

    exercise()
    assert fuzz_server.proc.poll() is None
