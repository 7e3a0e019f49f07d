#!/usr/bin/env bash
# Gateway line coverage, subprocess servers included: the tests that exercise the gateway
# (tests/gateway, tests/e2e, the pool's gateway test) under coverage, with every Python
# process they start measured too (COVERAGE_PROCESS_START and a .pth that calls
# coverage.process_startup). Prints coverage's report of lockgate.gateway; the last line is
# the total. A measurement, not a test: coverage is installed here, not by the test extra.
# Usage: bash scripts/gateway-coverage.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$PWD/.venv/bin/python}
"$PY" -m pip -q --disable-pip-version-check install "coverage>=7.6,<8"
OUT=$(mktemp -d /tmp/lockgate-coverage-XXXX)
cat > "$OUT/coveragerc" <<RC
[run]
source_pkgs = lockgate.gateway
parallel = true
sigterm = true
data_file = $OUT/.coverage
RC
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import coverage; coverage.process_startup()" > "$SITE/zz-lockgate-coverage.pth"
trap 'rm -f "$SITE/zz-lockgate-coverage.pth"' EXIT
COVERAGE_PROCESS_START="$OUT/coveragerc" "$PY" -m coverage run --rcfile="$OUT/coveragerc" -m pytest -q \
  -p no:cacheprovider tests/gateway tests/e2e tests/pool/test_pool_gateway.py "$@" || echo "coverage: pytest failed ($?)"
"$PY" -m coverage combine -q --rcfile="$OUT/coveragerc"
"$PY" -m coverage report --rcfile="$OUT/coveragerc" > "$OUT/report.txt"
tail -1 "$OUT/report.txt"
echo "coverage: report in $OUT/report.txt"
