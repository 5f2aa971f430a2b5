#!/usr/bin/env bash
# The repo's one GPU check: every gpu-marked test, then the GPU benchmarks, then a verdict that
# cannot pass vacuously.
#
#   bash scripts/gpu_check.sh            # on a CUDA machine (about 5 minutes at most)
#   bash scripts/gpu_check.sh --dry-run  # anywhere: the steps, their budgets, the gpu tests it would run
#
# Steps, each with a time budget, printed as it starts:
#   1. environment: an interpreter with torch and pytest, ckpt-core's dependencies, this
#      checkout installed (editable, offline; wheels carried in .whl/ are installed if needed)
#   2. the gpu tests: `pytest -m gpu` over the test files that mark something gpu
#      (scripts/gpu_check_report.py files), with a JUnit report
#   3. the GPU benchmarks: python -m benchmarks.gpu
#   4. the verdict, from the JUnit report (scripts/gpu_check_report.py verdict)
# A step past its budget is interrupted (SIGINT, so pytest still writes what finished) and fails
# the check.
#
# Exit status (the verdict's rules are in scripts/gpu_check_report.py):
#   0 PASS: CUDA is present, every gpu test ran and passed, except tests whose skip reason says
#     they need more GPUs than this machine has ("needs 2 GPUs: ..."): those are printed as NOT
#     VERIFIED, never as passed; and the benchmarks ran and succeeded;
#   1 FAIL: a gpu test failed, errored, could not be collected, or was skipped for any other
#     reason; no gpu test ran; a step ran past its budget; the benchmarks failed;
#     with --dry-run: the gpu tests could not be collected;
#   2 the environment could not be set up;
#   3 NOT RUN: no CUDA device is visible, so nothing was verified.
#
# Environment: PYTHON (interpreter; default the first of .venv/bin/python, python, python3 that
# imports torch); OUT (if set, the JUnit report and the benchmarks' JSON are written there, so
# they come back from a lent machine); GPU_CHECK_TESTS_S, GPU_CHECK_BENCH_S (step budgets).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
DRY_RUN=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done

SETUP_S=20
TESTS_S=${GPU_CHECK_TESTS_S:-180}
BENCH_S=${GPU_CHECK_BENCH_S:-80}
VERDICT_S=10
TOTAL_S=$((SETUP_S + TESTS_S + BENCH_S + VERDICT_S))
START=$(date +%s)
REPORT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$REPORT_DIR"
JUNIT="$REPORT_DIR/gpu-tests.xml"
BENCH_JSON="$REPORT_DIR/gpu-benchmarks.json"
REPORT=(scripts/gpu_check_report.py)
BENCH_CMD=(-m benchmarks.gpu --size 1GiB --buckets 64MiB,256MiB --reps 3 --timeout 60 --json "$BENCH_JSON")

say() { printf '[gpu_check] %s\n' "$*"; }
elapsed() { echo $(($(date +%s) - START)); }
step() { say "step $1 (budget ${2}s, ${3}s elapsed): $4"; }
pip_install() {  # offline; retried for an "externally managed" system interpreter (PEP 668)
    timeout "$SETUP_S" "$PY" -m pip install --quiet --no-index --no-deps "$@" \
        || PIP_BREAK_SYSTEM_PACKAGES=1 timeout "$SETUP_S" "$PY" -m pip install --quiet --no-index --no-deps "$@"
}

PY=${PYTHON:-}
if [ -z "$PY" ]; then  # the first interpreter that has torch
    for candidate in "$ROOT/.venv/bin/python" python python3; do
        if "$candidate" -c "import torch" >/dev/null 2>&1; then PY=$candidate; break; fi
    done
    PY=${PY:-python3}
fi

say "plan: 1 environment ${SETUP_S}s, 2 gpu tests ${TESTS_S}s, 3 GPU benchmarks ${BENCH_S}s, 4 verdict ${VERDICT_S}s: ${TOTAL_S}s at most"

# --- 1. environment ---------------------------------------------------------------------------
step 1 "$SETUP_S" "$(elapsed)" "interpreter $PY, dependencies, this checkout installed"
missing_modules() {  # prints the import names (of those given) that do not import
    "$PY" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(name for name in sys.argv[1:] if importlib.util.find_spec(name) is None))
EOF
}

if ! "$PY" -c "import torch, pytest" >/dev/null 2>&1; then
    say "ERROR: $PY cannot import torch and pytest; set PYTHON to an interpreter that has them."
    exit 2
fi
mapfile -t FILES < <("$PY" "${REPORT[@]}" files "$ROOT")
if [ "${#FILES[@]}" -eq 0 ]; then
    say "ERROR: no test file marks anything gpu (scripts/gpu_check_report.py files found none)"
    exit 1
fi
TIMEOUT_ARGS=()
if [ -z "$(missing_modules pytest_timeout)" ]; then TIMEOUT_ARGS=(--timeout=120); fi
# Without pytest-timeout a stuck test still shows where it is stuck: faulthandler dumps every
# thread's stack after 90 s; the step's budget ends the run.
PYTEST_CMD=(-m pytest -m gpu "${FILES[@]}" -v -rs -o faulthandler_timeout=90 --junitxml="$JUNIT" "${TIMEOUT_ARGS[@]}")

if [ "$DRY_RUN" = 1 ]; then
    say "dry run: nothing is installed, tested or measured"
    say "step 2 would run (up to ${TESTS_S}s): $PY ${PYTEST_CMD[*]}"
    say "step 3 would run (up to ${BENCH_S}s, CUDA only): $PY ${BENCH_CMD[*]}"
    say "step 4 would judge $JUNIT with $PY ${REPORT[*]} verdict"
    say "gpu tests in ${#FILES[@]} files (collected now, with -m gpu):"
    COLLECTED=$("$PY" -m pytest -m gpu "${FILES[@]}" --collect-only -q 2>&1)
    COLLECT_RC=$?
    # One line per test; a class's tests as one line with their count.
    printf '%s\n' "$COLLECTED" | awk -F'::' '
        NF == 3 { if ($1 "::" $2 != group) { flush(); group = $1 "::" $2 }; count++; next }
        { flush(); if ($0 != "") print "    " $0 }
        function flush() { if (count) print "    " group ": " count " tests"; count = 0; group = "" }
        END { flush() }'
    if [ "$COLLECT_RC" -ne 0 ]; then
        say "result: FAIL - the gpu tests could not be collected (pytest exit status $COLLECT_RC): fix that before a GPU run"
        exit 1
    fi
    say "result: DRY RUN - tests that skip on a CUDA machine fail the check unless their reason starts 'needs N GPUs' with N above its GPU count"
    exit 0
fi

REQUIRED=$(missing_modules xxhash pluggy)
if [ -n "$REQUIRED" ] && compgen -G ".whl/*.whl" >/dev/null; then
    say "installing the wheels carried in .whl/ (missing: $REQUIRED)"
    pip_install .whl/*.whl || say "WARNING: installing .whl/*.whl failed"
    REQUIRED=$(missing_modules xxhash pluggy)
fi
if [ -n "$REQUIRED" ]; then
    say "ERROR: ckpt-core needs Python packages that are not installed here: $REQUIRED"
    say "This machine has no network. On a machine that has, download their wheels into .whl/"
    say "  pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl $REQUIRED"
    say "and run this script again with .whl/ next to it (it installs them with --no-index --no-deps)."
    exit 2
fi

# Prints the paths (. and plugins/*, except _* folders) whose distribution is not installed
# from this checkout. -I keeps the working directory (which may hold stale *.egg-info
# folders) off sys.path.
NEEDS_INSTALL=$("$PY" -I - "$ROOT" <<'EOF'
import importlib.metadata as md, json, pathlib, sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None
root = pathlib.Path(sys.argv[1])
plugins = (p for p in (root / "plugins").iterdir() if not p.name.startswith(("_", ".")))  # _template is no plugin
projects = [root] + sorted(p for p in plugins if (p / "pyproject.toml").is_file())
def installed_here(project):
    if tomllib is None:
        return False
    name = tomllib.loads((project / "pyproject.toml").read_text())["project"]["name"]
    for dist in md.distributions(name=name):
        url = dist.read_text("direct_url.json")  # PEP 610: where an install came from
        if url and json.loads(url).get("url", "").removeprefix("file://").rstrip("/") == str(project):
            return True
    return False
print(" ".join(str(p.relative_to(root)) for p in projects if not installed_here(p)))
EOF
)
if [ -z "$NEEDS_INSTALL" ]; then
    say "ckpt-core and every plugin are installed from this checkout"
elif [ "$PY" = "$ROOT/.venv/bin/python" ]; then
    # The checkout's own development venv is managed by hand; never change it from here.
    say "ERROR: not installed from this checkout in $PY: $NEEDS_INSTALL"
    say "run: $PY -m pip install --no-deps -e <path> for each, then run this script again"
    exit 2
else
    for project in $NEEDS_INSTALL; do
        say "pip install --no-deps --no-index --no-build-isolation -e $project"
        if ! pip_install --no-build-isolation -e "$project"; then
            say "ERROR: installing $project failed (an editable install needs setuptools>=64 in this interpreter)"
            exit 2
        fi
    done
fi

MACHINE=$("$PY" - <<'EOF'
import torch
import torch.distributed as dist
cuda = torch.cuda.is_available()
count = torch.cuda.device_count() if cuda else 0
line = f"torch {torch.__version__}, CUDA build {torch.version.cuda}, NCCL in torch: {dist.is_available() and dist.is_nccl_available()}"
if cuda:
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else "?"
    line += f", NCCL {nccl}, {count} GPU(s): {', '.join(names)}"
else:
    line += ", no CUDA device visible"
print(f"{int(cuda)} {count} {line}")
EOF
)
read -r HAS_CUDA GPUS MACHINE_LINE <<<"$MACHINE"
say "${MACHINE_LINE:-could not describe the machine}"
HAS_CUDA=${HAS_CUDA:-0}
GPUS=${GPUS:-0}

# --- 2. the gpu tests -------------------------------------------------------------------------
step 2 "$TESTS_S" "$(elapsed)" "$PY ${PYTEST_CMD[*]}"
rm -f "$JUNIT"
timeout -s INT -k 15 "$TESTS_S" "$PY" "${PYTEST_CMD[@]}"
TEST_RC=$?

# --- 3. the GPU benchmarks --------------------------------------------------------------------
BENCH="did not run: no CUDA device"
BENCH_RC=""
if [ "$HAS_CUDA" = 1 ]; then
    step 3 "$BENCH_S" "$(elapsed)" "$PY ${BENCH_CMD[*]}"
    timeout -s INT -k 10 "$BENCH_S" "$PY" "${BENCH_CMD[@]}"
    BENCH_RC=$?
    case "$BENCH_RC" in
        0) BENCH="ran, exit 0 (figures above; JSON: $BENCH_JSON)" ;;
        124|137) BENCH="STOPPED past its ${BENCH_S}s budget" ;;
        *) BENCH="FAILED (exit $BENCH_RC)" ;;
    esac
fi

# --- 4. the verdict ---------------------------------------------------------------------------
step 4 "$VERDICT_S" "$(elapsed)" "$PY ${REPORT[*]} verdict"
timeout -k 5 "$VERDICT_S" "$PY" "${REPORT[@]}" verdict --junit "$JUNIT" --cuda "$HAS_CUDA" --gpus "$GPUS" \
    --pytest-status "$TEST_RC" --tests-budget "$TESTS_S" --bench "$BENCH" --bench-status "$BENCH_RC" \
    --elapsed "$(elapsed)"
