#!/usr/bin/env bash
# mypy over everything in one run (pyproject's [tool.mypy]): the library, the plugins, the
# benchmarks, the tests package and the transport and integration test folders.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m mypy
