#!/usr/bin/env bash
# One-shot GPU figures on a single H200 (16 cores, 128 GB RAM; the network only for package installs).
# Finishes within 8 minutes (BUDGET_S, default 470 s) and writes JSON to $OUT (default ./gpu-out):
#
#     bash benchmarks/gpu.sh                  # from the repository root
#     OUT=/tmp/out BUDGET_S=400 bash benchmarks/gpu.sh
#
# 1. a fresh venv ($VENV, default /tmp/clover-gpu-venv) with jax[cuda12] matching pyproject's pin
#    (jax>=0.10.2,<0.11) and this project; if that install fails, the python3 already there is used
#    and the JSON says so (its jax may be outside the pin);
# 2. `pip install tokamax` (a Pallas grouped-matmul library), jax held at the installed version; a
#    failure is recorded ($OUT/tokamax_install.log) and the rest goes on;
# 3. benchmarks/gpu_bench.py: the real Clover config with random bf16 weights, cached block passes at
#    batch 1 / 8 / 64 with their HBM roofline, ragged_dot vs tokamax, full generate tokens/s, then the
#    block passes again with weight-only int8 and fp8 weights (--quantize)
#    ($OUT/gpu_bench.json, rewritten after every step, so a timeout still leaves the finished steps).
# Every stage is logged to $OUT/gpu.log; nothing here stops the script but the time budget.
set -u
START=$(date +%s)
BUDGET_S=${BUDGET_S:-470}
OUT=${OUT:-./gpu-out}
VENV=${VENV:-/tmp/clover-gpu-venv}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu.log"
STATUS="$OUT/install.json"
elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "[gpu.sh $(elapsed)s] $*" | tee -a "$LOG"; }

say "repo $ROOT, out $OUT, budget ${BUDGET_S}s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1 || say "nvidia-smi failed"

# ---- 1. jax[cuda12] in a fresh venv --------------------------------------------------------------------
PY=python3
JAX_INSTALL="not tried"
if python3 -m venv "$VENV" >>"$LOG" 2>&1; then
  if timeout "${JAX_INSTALL_S:-200}" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
      "jax[cuda12]>=0.10.2,<0.11" -e "$ROOT" >>"$LOG" 2>&1; then
    PY="$VENV/bin/python"
    JAX_INSTALL="ok"
  else
    JAX_INSTALL="failed (rc $?): see gpu.log; using the system python3"
  fi
else
  JAX_INSTALL="python3 -m venv failed: using the system python3"
fi
say "jax install: $JAX_INSTALL (python $PY)"
JAX_VER=$("$PY" -c 'import jax; print(jax.__version__)' 2>>"$LOG" || echo none)
say "jax $JAX_VER"

# ---- 2. tokamax, jax held where it is -------------------------------------------------------------------
TOKAMAX_INSTALL="skipped (no jax)"
if [ "$JAX_VER" != none ]; then
  JAXLIB_VER=$("$PY" -c 'import jaxlib; print(jaxlib.__version__)' 2>/dev/null || echo "$JAX_VER")
  printf 'jax==%s\njaxlib==%s\n' "$JAX_VER" "$JAXLIB_VER" >"$OUT/constraints.txt"
  if timeout "${TOKAMAX_INSTALL_S:-60}" "$PY" -m pip install -q --disable-pip-version-check tokamax -c "$OUT/constraints.txt" \
      >"$OUT/tokamax_install.log" 2>&1; then
    TOKAMAX_INSTALL="ok"
  else
    TOKAMAX_INSTALL="failed (rc $?): see tokamax_install.log"
  fi
fi
say "tokamax install: $TOKAMAX_INSTALL"
printf '{"jax_install": "%s", "python": "%s", "jax": "%s", "tokamax_install": "%s", "elapsed_s": %s}\n' \
  "$JAX_INSTALL" "$PY" "$JAX_VER" "$TOKAMAX_INSTALL" "$(elapsed)" >"$STATUS"

# ---- 3. the benchmark, within what is left ---------------------------------------------------------------
LEFT=$(( BUDGET_S - $(elapsed) ))
if [ "$LEFT" -lt 30 ]; then
  say "only ${LEFT}s left: benchmark not run"
  exit 0
fi
say "gpu_bench.py with ${LEFT}s left"
cd "$ROOT" || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Steps that would start in the last 60 s are skipped; the whole run is stopped at the budget.
timeout --signal=TERM --kill-after=10 "$LEFT" "$PY" benchmarks/gpu_bench.py --out "$OUT/gpu_bench.json" \
  --deadline-s $(( LEFT > 120 ? LEFT - 60 : LEFT / 2 )) --tokamax-log "$OUT/tokamax_install.log" "$@" 2>&1 \
  | tee -a "$LOG"
RC=${PIPESTATUS[0]}
say "gpu_bench.py exit status $RC (124: stopped at the time budget); JSON: $OUT/gpu_bench.json"
exit 0
