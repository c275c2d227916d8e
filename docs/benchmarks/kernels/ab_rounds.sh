#!/bin/bash
# Interleaved A/B, three rounds: BASE (default /tmp/pg/base: `git archive 8dcdc2d`, the code before
# the kernels) against NEW (default: this checkout), each a fresh process; OMP_WAIT_POLICY=PASSIVE.
# Run from anywhere; scripts are found beside this file.
HERE=$(cd "$(dirname "$0")" && pwd); BASE=${BASE:-/tmp/pg/base}; NEW=${NEW:-$(cd "$HERE/../../.." && pwd)}; PY=${PY:-$NEW/.venv/bin/python}
for r in 1 2 3; do
  echo "# round $r $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  for v in base new; do
    if [ $v = base ]; then P=$BASE; else P=$NEW; fi
    echo -n "$v b1:  "; (cd /tmp && PYTHONPATH=$P OMP_WAIT_POLICY=PASSIVE $PY $HERE/step_time.py --batch 1 --steps 100 2>&1 | tail -1)
  done
  for v in base new; do
    if [ $v = base ]; then P=$BASE; else P=$NEW; fi
    echo -n "$v b16: "; (cd /tmp && PYTHONPATH=$P OMP_WAIT_POLICY=PASSIVE $PY $HERE/step_time.py --batch 16 --prompt 250 --steps 30 2>&1 | tail -1)
    echo -n "$v b64: "; (cd /tmp && PYTHONPATH=$P OMP_WAIT_POLICY=PASSIVE $PY $HERE/step_time.py --batch 64 --prompt 250 --steps 15 2>&1 | tail -1)
  done
done
echo "# end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
for v in base new; do
  if [ $v = base ]; then P=$BASE; else P=$NEW; fi
  echo "== breakdown $v b64"; (cd /tmp && PYTHONPATH=$P OMP_WAIT_POLICY=PASSIVE $PY $HERE/step_phases.py --batch 64 --prompt 250 --steps 10 2>&1 | grep -v Warn)
  echo "== breakdown $v b1"; (cd /tmp && PYTHONPATH=$P OMP_WAIT_POLICY=PASSIVE $PY $HERE/step_phases.py --batch 1 --steps 100 2>&1 | grep -v Warn)
done
echo "# end2 $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
