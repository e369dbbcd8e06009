#!/usr/bin/env bash
# Wheels for packages the H200 image lacks (Python 3.12, x86_64): the server's stack, xgrammar
# and jsonschema (the structured-outputs GPU test validates with it).
# Run here, in the repo root; then pass `carry: [".whl", ".carry"]` to the device run
# (tools/h200_session.sh installs .whl/*.whl into /tmp/site). .whl/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4 \
  annotated-types typing-inspection typing-extensions==4.16.0 opentelemetry-api \
  xgrammar==0.2.9 apache-tvm-ffi \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0 attrs==26.1.0
mkdir -p .carry && cp ../shared/bench/hf_peer.py .carry/ 2>/dev/null || true
ls .whl
