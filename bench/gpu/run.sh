#!/usr/bin/env bash
# The GPU check in one call (docs/gpu-check.md). On the lent H200 (carry .whl, made by scripts/gpu-wheels):
#   bash bench/gpu/run.sh --quick         -> first call (~5-6 min): every stage, small shape; report in $OUT
#   bash bench/gpu/run.sh --budget-s N    -> second call: the full run within what is left
# On a rented node with the project's venv: PYTHON=.venv/bin/python bash bench/gpu/run.sh [--quick]
# Arguments go to bench/gpu/check.py (--quick, --cpu-smoke, --shapes, --stages, --steps, --budget-s, --out, --unit).
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
wheels=${GPU_CHECK_WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
  site=${GPU_CHECK_SITE:-$PWD/build/gpu-check-site}  # not /tmp: a transient unit's /tmp is its own
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu-check: $(ls "$wheels"/*.whl | wc -l) carried wheels installed into $site"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$py" bench/gpu/check.py "$@"
