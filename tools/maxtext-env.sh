#!/usr/bin/env bash
# MaxText's tests (tests/maxtext/): builds once, then reuses, a Python 3.12 venv with
# maxtext[tpu]==0.2.5 (jax 0.12, ~3 GB; libtpu is inert on a CPU) and this package installed
# editable into it without its pins (MaxText's own versions stay), then runs those tests in it.
#   tools/maxtext-env.sh                 # build if needed, run tests/maxtext; a JSON line of results last
#   tools/maxtext-env.sh -k bisect       # extra pytest arguments
#   tools/maxtext-env.sh --suite         # also the rest of the suite that needs no torch, fast tests only
#                                        # (traces, replay, examples: replay on the newest jax MaxText runs)
# MAXTEXT_VENV picks the venv's folder (default ~/.cache/replay/maxtext-venv-0.2.5); PYTHON312 the
# interpreter it is made from. The default suite skips these tests in one line naming this script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${MAXTEXT_VENV:-$HOME/.cache/replay/maxtext-venv-0.2.5}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import maxtext" 2>/dev/null; then
  # the first candidate that runs: a pyenv shim named python3.12 may be on PATH and still refuse to run
  PY="${PYTHON312:-}"
  if [ -z "$PY" ]; then
    for c in "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
      if [ -n "$c" ] && "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then PY="$c"; break; fi
    done
  fi
  [ -n "$PY" ] && [ -x "$PY" ] || { echo "error: no Python 3.12 found; set PYTHON312=/path/to/python3.12" >&2; exit 2; }
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q "maxtext[tpu]==0.2.5"
fi
"$VENV/bin/pip" install -q --no-deps -e .
# the GCS emulator: tests/maxtext's gs:// test records MaxText's checkpoints into a local bucket
"$VENV/bin/pip" install -q "pytest>=8" "pytest-xdist>=3.8" "hypothesis>=6.100" "gcp-storage-emulator>=2024.8"
if [ "${1:-}" = "--suite" ]; then
  shift
  JAX_PLATFORMS=cpu "$VENV/bin/python" -m pytest -n 0 -q -p no:cacheprovider -m "not slow" tests/traces tests/replay tests/examples "$@"
fi
# The results as one JSON line last (what the issue's notes quote): each test's outcome, the versions.
REPORT="$(mktemp -d)/maxtext-junit.xml"
# tests/maxtext/test_maxtext_seed.py writes the seed table's MaxText row there (the 1 -> 2 process resume)
export REPLAY_MAXTEXT_SEED="$(dirname "$REPORT")/seed.json"
set +e
"$VENV/bin/python" -m pytest -n 0 -q -p no:cacheprovider --junitxml="$REPORT" tests/maxtext "$@"
rc=$?
set -e
"$VENV/bin/python" - "$REPORT" "$REPLAY_MAXTEXT_SEED" <<'PY' || true
import json, os, sys, xml.etree.ElementTree as ET
from importlib.metadata import version
suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
tests = {}
for case in suite.iter("testcase"):
    kinds = {child.tag for child in case}
    tests[case.get("name")] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
counts = {k: sum(v == k for v in tests.values()) for k in ("passed", "failure", "error", "skipped")}
seed = json.loads(open(sys.argv[2]).read()) if os.path.exists(sys.argv[2]) else None
print(json.dumps({"maxtext": version("maxtext"), "jax": version("jax"), **counts,
                  "seconds": round(float(suite.get("time", 0)), 1), "tests": tests, "seed": seed}))
PY
exit $rc
