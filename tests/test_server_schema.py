"""schemathesis against the app's own OpenAPI schema (in-process ASGI): no 5xx, and every
response conforms to the schema (status code, content type, body, headers).

Only conformance checks run: schemathesis' `positive_data_acceptance` would flag requests that are
schema-valid but semantically invalid (prompt + max_tokens over max_model_len, out-of-vocabulary
ids), which are correctly answered 400; ranges are SamplingParams' to check, not the schema's.
The app (and its engine) is built by a module fixture when the test runs, not at collection."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server_util import make_app

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, response_headers_conformance]


@pytest.fixture(scope="module")
def api_schema() -> Iterator[Any]:
    app = make_app({"max_model_len": 32, "max_num_seqs": 128})
    # The grammar worker boots now (as `photon serve` does), not inside the first request's
    # read timeout.
    app.state.engine.frontend.structured.start(wait_s=120)
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", app)
    finally:
        app.state.engine.shutdown()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_api_conforms(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=CHECKS)
