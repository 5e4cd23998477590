#!/usr/bin/env bash
# nnsight 0.8.1's own test suite, offline, against torchlens_shims.nnsight (NOT part of CI: ~5 min
# on a fresh machine plus a one-time ~4 min model-cache build, and it needs ../shared/nnsight-upstream).
#   bash scripts/nnsight_upstream.sh          # the target list on the shim -> per-module table
#   bash scripts/nnsight_upstream.sh real     # re-run the baseline on the real nnsight 0.8.1
# Results: ${NNS_RESULTS:-${TMPDIR:-/tmp}/nns-upstream/results} (shim-results.tsv, shim-failures.md).
# The out-of-scope list (NDIF/remote, vLLM, tensor-parallel, serialization, internals) is
# shims/torchlens_shims/nnsight/upstream_scope.tsv; docs/coming-from-nnsight.md shows it.
set -euo pipefail
cd "$(dirname "$0")/.."
HARNESS=../shared/nnsight-upstream
if [ ! -f "$HARNESS/run.sh" ]; then
  echo "nnsight_upstream: $HARNESS/run.sh not found (the harness lives beside the repository)" >&2
  exit 2
fi
mode="${1:-shim}"
bash "$HARNESS/run.sh" "$mode"
if [ "$mode" = shim ]; then
  # Per-module table: passed / targets, overall and for the targets in scope.
  .venv/bin/python - "${NNS_RESULTS:-${TMPDIR:-/tmp}/nns-upstream/results}/shim-results.tsv" \
    "$HARNESS/targets.txt" shims/torchlens_shims/nnsight/upstream_scope.tsv <<'PY'
import collections, fnmatch, sys
results = dict(line.rstrip("\n").split("\t")[:2] for line in open(sys.argv[1]) if "\t" in line)
targets = [line.strip() for line in open(sys.argv[2]) if line.strip()]
patterns = [line.split("\t")[0] for line in open(sys.argv[3]) if line.strip() and not line.startswith("#")]
def out(test):
    return any(fnmatch.fnmatchcase(test, p) for p in patterns)
rows = collections.defaultdict(lambda: [0, 0, 0, 0])  # passed, targets, in-scope passed, in-scope targets
for test in targets:
    row = rows[test.split("::")[0]]
    ok = results.get(test) == "passed"
    row[0] += ok; row[1] += 1
    if not out(test):
        row[2] += ok; row[3] += 1
print(f"{'module':40} {'passed/targets':>15} {'in scope':>12}")
for module, (p, t, ip, it) in sorted(rows.items()):
    print(f"{module:40} {f'{p}/{t}':>15} {f'{ip}/{it}':>12}")
P, T, IP, IT = (sum(r[i] for r in rows.values()) for i in range(4))
print(f"{'total':40} {f'{P}/{T}':>15} {f'{IP}/{IT}':>12}  ({100 * IP / max(IT, 1):.1f}% of in-scope)")
PY
fi
