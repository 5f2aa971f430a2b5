#!/usr/bin/env bash
# The repo's one GPU check: every `gpu`-marked test of the core and of every plugin, then the
# GPU benchmark (`python -m benchmarks.gpu`, when that module exists), then a summary.
#
#   bash scripts/gpu_check.sh
#
# Works offline (the lent GPU machines have no network): it installs this checkout with
# `pip install --no-deps --no-index -e` unless it is already installed from here (it never
# installs into the checkout's own .venv), and installs missing pure-Python dependencies
# from wheels carried in .whl/ (see below).
# Without CUDA every gpu test is skipped and the script says so and exits 0.
# Exit status: 0 all gpu tests passed (or skipped) and the benchmark, if any, succeeded;
# 1 a gpu test or the benchmark failed, or a test module could not be collected for a reason
#   other than a missing optional test dependency (those are listed, with the wheels to carry);
# 2 the environment could not be set up.
#
# Environment: PYTHON (interpreter; default the first of .venv/bin/python, python, python3
# that imports torch),
# GPU_CHECK_BUDGET_S (whole-run budget in seconds, default 285), OUT (if set, the JUnit report
# is written there so it comes back from a lent machine).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-285}
REPORT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$REPORT_DIR"
JUNIT="$REPORT_DIR/gpu-tests.xml"
rm -f "$JUNIT"

PY=${PYTHON:-}
if [ -z "$PY" ]; then  # the first interpreter that has torch
    for candidate in "$ROOT/.venv/bin/python" python python3; do
        if "$candidate" -c "import torch" >/dev/null 2>&1; then PY=$candidate; break; fi
    done
    PY=${PY:-python3}
fi

say() { printf '[gpu_check] %s\n' "$*"; }
pip_install() {  # offline; retried for an "externally managed" system interpreter (PEP 668)
    "$PY" -m pip install --quiet --no-index --no-deps "$@" \
        || PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install --quiet --no-index --no-deps "$@"
}
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# --- 1. dependencies ------------------------------------------------------------------------
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
REQUIRED=$(missing_modules xxhash pluggy)
OPTIONAL=$(missing_modules pytest_timeout hypothesis)
if [ -n "$REQUIRED$OPTIONAL" ] && compgen -G ".whl/*.whl" >/dev/null; then
    say "installing the wheels carried in .whl/ (missing: $REQUIRED $OPTIONAL)"
    pip_install .whl/*.whl || say "WARNING: installing .whl/*.whl failed"
    REQUIRED=$(missing_modules xxhash pluggy)
    OPTIONAL=$(missing_modules pytest_timeout hypothesis)
fi
if [ -n "$REQUIRED" ]; then
    say "ERROR: ckpt-core needs Python packages that are not installed here: $REQUIRED"
    say "This machine has no network. On a machine that has, download their wheels into .whl/"
    say "  pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl xxhash pluggy"
    say "and run this script again with .whl/ next to it (it installs them with --no-index --no-deps)."
    exit 2
fi
if [ -n "$OPTIONAL" ]; then
    say "note: optional test dependencies missing: $OPTIONAL (test modules that import them will"
    say "      fail to collect; carry their wheels in .whl/ to include them)"
fi

# --- 2. this checkout, installed editable --------------------------------------------------
# Prints the paths (. and plugins/*, except _* folders) whose distribution is not installed
# from this checkout.
# -I keeps the working directory (which may hold stale *.egg-info folders) off sys.path.
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
    say "ckpt-core and every plugin are already installed from this checkout"
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

# --- 3. the machine -------------------------------------------------------------------------
MACHINE=$("$PY" - <<'EOF'
import torch
import torch.distributed as dist
cuda = torch.cuda.is_available()
line = f"torch {torch.__version__}, CUDA build {torch.version.cuda}, NCCL in torch: {dist.is_available() and dist.is_nccl_available()}"
if cuda:
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else "?"
    line += f", NCCL {nccl}, {len(names)} GPU(s): {', '.join(names)}"
else:
    line += ", no CUDA device visible"
print(f"{int(cuda)} {line}")
EOF
)
HAS_CUDA=${MACHINE%% *}
say "${MACHINE#* }"

# --- 4. the gpu tests -----------------------------------------------------------------------
PATHS=()
for path in tests plugins; do [ -d "$path" ] && PATHS+=("$path"); done
TIMEOUT_ARGS=()
if [ -z "$(missing_modules pytest_timeout)" ]; then TIMEOUT_ARGS=(--timeout=200); fi
TEST_BUDGET=$(( $(left) - 60 ))  # leave a minute for the benchmark and the summary
[ "$TEST_BUDGET" -gt 210 ] && TEST_BUDGET=210
say "pytest -m gpu ${PATHS[*]} (up to ${TEST_BUDGET}s)"
timeout --kill-after=10 "$TEST_BUDGET" "$PY" -m pytest -m gpu "${PATHS[@]}" -v -rs \
    --continue-on-collection-errors --junitxml="$JUNIT" "${TIMEOUT_ARGS[@]}"
TEST_RC=$?

# --- 5. the gpu benchmark -------------------------------------------------------------------
BENCH="skipped: benchmarks.gpu does not exist"
BENCH_RC=0
if "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('benchmarks.gpu') else 1)" 2>/dev/null; then
    if [ "$HAS_CUDA" != 1 ]; then
        BENCH="skipped: no CUDA device"
    elif [ "$(left)" -lt 20 ]; then
        BENCH="skipped: no time left in the ${BUDGET_S}s budget"
    else
        say "python -m benchmarks.gpu (up to $(( $(left) - 10 ))s)"
        timeout --kill-after=5 $(( $(left) - 10 )) "$PY" -m benchmarks.gpu
        BENCH_RC=$?
        if [ "$BENCH_RC" -eq 0 ]; then BENCH="ran, exit 0"; else BENCH="FAILED (exit $BENCH_RC)"; fi
    fi
fi

# --- 6. summary -----------------------------------------------------------------------------
"$PY" - "$JUNIT" "$TEST_RC" "$HAS_CUDA" "$BENCH" "$BENCH_RC" "$(( $(date +%s) - START ))" "$ROOT" <<'EOF'
import pathlib, re, sys
import xml.etree.ElementTree as ET

junit, test_rc, has_cuda, bench, bench_rc, elapsed, root = sys.argv[1:]
test_rc, bench_rc = int(test_rc), int(bench_rc)
# Modules this checkout provides: one of them missing is a real failure, not an absent extra.
folders = [pathlib.Path(root), pathlib.Path(root, "tests"), *pathlib.Path(root, "plugins").glob("*"),
           *pathlib.Path(root, "plugins").glob("*/tests")]
ours = {p.stem for folder in folders if folder.is_dir() for p in folder.iterdir()}
passed, failed, errors, skipped, uncollected = [], [], [], [], []
if pathlib.Path(junit).is_file():
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = "::".join(filter(None, [case.get("classname"), case.get("name")]))
        error = case.find("error")
        missing = re.search(r"No module named '([^']+)'", error.text or "") if error is not None else None
        if case.find("failure") is not None:
            failed.append(name)
        elif missing and "collection" in (error.get("message") or "") and missing.group(1).split(".")[0] not in ours:
            uncollected.append((name, missing.group(1).split(".")[0]))
        elif error is not None:
            errors.append(name)
        elif case.find("skipped") is not None:
            skipped.append(name)
        else:
            passed.append(name)
print("\n==================== gpu_check summary ====================")
problems = []
if test_rc in (124, 137):
    problems.append("the gpu tests ran past their time budget and were stopped")
elif test_rc not in (0, 1, 5):
    problems.append(f"pytest stopped with exit status {test_rc} (usage or internal error)")
if not pathlib.Path(junit).is_file():
    problems.append("pytest wrote no report")
print(f"gpu tests: {len(passed)} passed, {len(failed)} failed, {len(errors)} errors, {len(skipped)} skipped")
for name in failed:
    print(f"  FAILED {name}")
for name in errors:
    print(f"  ERROR  {name} (collection or fixture error)")
if failed or errors:
    problems.append(f"{len(failed)} failed, {len(errors)} errors")
for name, module in uncollected:
    print(f"  NOT COLLECTED {name}: needs the Python package {module!r}, missing here")
if uncollected:
    wheels = " ".join(sorted({module for _, module in uncollected}))
    print(f"  (their gpu tests, if any, did not run: carry wheels for {wheels} in .whl/)")
if has_cuda != "1":
    print(f"no CUDA device: {len(skipped)} gpu tests skipped")
print(f"benchmark: {bench}")
if bench_rc:
    problems.append("the gpu benchmark failed")
print(f"time: {elapsed}s; report: {junit}")
print("result: " + ("FAIL - " + "; ".join(problems) if problems else "PASS"))
sys.exit(1 if problems else 0)
EOF
