#!/usr/bin/env bash
# ctest torch_backend_test (label torch): the "morph" torch.distributed backend (torch groups
# over morph's communicators) under `morphrun -n 3`: every collective against values computed
# without it, bad input refused with a clear error and the group usable after, and a group of
# an earlier generation refused after a change (backend_worker.py).
#   backend_test.sh <build dir> <morphrun>
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build=$1
morphrun=$2
python="$(MORPH_VENV="${MORPH_VENV:-$build/venv}" bash "$here/../../scripts/python-venv.sh" | tail -n 1)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
export MORPH_TOKEN=torch-backend-test-token
timeout 240 "$morphrun" -n 3 --log-dir "$tmp/logs" -- "$python" "$here/backend_worker.py" \
  --out "$tmp" >"$tmp/run.log" 2>&1 ||
  { tail -40 "$tmp/run.log"; for f in "$tmp"/logs/*; do echo "== $f"; tail -20 "$f"; done
    echo "torch_backend_test: morphrun failed" >&2; exit 1; }
"$python" - "$tmp" <<'PY'
import glob, json, sys
reps = [json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + "/rank-*.json"))]
assert len(reps) == 3, f"{len(reps)} reports"
for r in reps:
    assert r["backend"] == "morph", r
    bad = [c for c, ok in r["checks"] if not ok]
    assert not bad and len(r["checks"]) >= 24, (r["worker"], bad, len(r["checks"]))
    assert "ddp vs replay" in [c for c, _ in r["checks"]], r["worker"]
    e = r["errors"]
    want = {"non_contiguous": "not contiguous", "int16": "not reduced by morph",
            "product": "reduce op PRODUCT", "output_size": "not world size"}
    for k, text in want.items():
        assert e.get(k) and text in e[k], (k, e.get(k))
    if not r["left"]:
        assert r["new_world"] == 2, r
        # torch refuses a destroyed group itself; the backend refuses one reached otherwise
        stale = e.get("earlier_generation") or ""
        assert "earlier generation" in stale or "not initialized" in stale, e
print("torch_backend_test: passed", json.dumps({r["worker"]: len(r["checks"]) for r in reps}))
PY
