#!/usr/bin/env bash
# mypy over the library, plugins and benchmarks (pyproject's [tool.mypy] files), then over each
# test folder in its own run: test folders are import roots (pytest puts each on sys.path) and
# several hold a module of the same name (conftest.py), which one mypy run cannot take.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m mypy
MYPYPATH=tests "$PYTHON" -m mypy --exclude '^tests/(automodel|reliability|nemo_rl)/' tests
for folder in tests/automodel tests/reliability tests/nemo_rl \
    plugins/gloo_cpu/tests plugins/nccl/tests plugins/cuda_ipc/tests examples/tcp_transport/tests \
    plugins/_template/tests integrations/vllm/tests; do
    MYPYPATH="$folder:tests" "$PYTHON" -m mypy "$folder"
done
