#!/bin/bash
# Paired rounds of offline decode step times per scheme (../kernels/step_time.py --scheme), each a
# fresh process, schemes interleaved within a round; B=1 (32-token prompt) and B=16 (250).
# Usage: ab_rounds.sh [ROUNDS] [SCHEMES...]   (default 3 rounds of bf16 int8 int4 gguf)
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../../.." && pwd); PY=${PY:-$ROOT/.venv/bin/python}
ROUNDS=${1:-3}; shift; SCHEMES=${*:-bf16 int8 int4 gguf}
for r in $(seq "$ROUNDS"); do
  echo "# round $r $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  for s in $SCHEMES; do (cd /tmp && OMP_WAIT_POLICY=PASSIVE $PY "$HERE/../kernels/step_time.py" --scheme "$s" --batch 1 --steps 100 2>&1 | tail -1); done
  for s in $SCHEMES; do (cd /tmp && OMP_WAIT_POLICY=PASSIVE $PY "$HERE/../kernels/step_time.py" --scheme "$s" --batch 16 --prompt 250 --steps 30 2>&1 | tail -1); done
done
echo "# end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
