#!/bin/bash
# Run from the project root after `make install` and ../shared/peers/setup.sh (for loadgen).
# one replica vs two behind nginx, same load (c=16, 64 requests, 128 tokens forced)
ROOT=$(pwd)
P=${PAGODA:-$ROOT/.venv/bin/pagoda}
PEERS=${PEERS:-$HOME/.cache/pagoda-peers}
LG="$PEERS/venv-tools/bin/python $ROOT/../shared/peers/loadgen.py"
cd "$(mktemp -d)"
W="--prompt-tokens 100-150 --max-tokens 128 --force-full-length --quiet"
wait_h() { for _ in $(seq 120); do curl -sf $1/health >/dev/null && return 0; sleep 1; done; return 1; }
$P serve smollm2 --port 8701 > r1.log 2>&1 & A=$!
wait_h http://127.0.0.1:8701
$LG --base-url http://127.0.0.1:8701 -n 64 -c 16 $W --label one > one.txt 2>&1
$P serve smollm2 --port 8702 > r2.log 2>&1 & B=$!
wait_h http://127.0.0.1:8702
sed -e 's/127.0.0.1:8001 /127.0.0.1:8701 /' -e 's/127.0.0.1:8002 /127.0.0.1:8702 /' -e 's/listen 127.0.0.1:8000;/listen 127.0.0.1:8700;/' "$ROOT/deploy/nginx/pagoda.conf" > ng.conf
mkdir -p run && nginx -p "$PWD/run" -c "$PWD/ng.conf" -g 'daemon off;' & N=$!
sleep 1
$LG --base-url http://127.0.0.1:8700 -n 64 -c 16 $W --label two > two.txt 2>&1
nginx -p "$PWD/run" -c "$PWD/ng.conf" -s quit; kill $A $B; wait
grep -h '^{"label"' one.txt two.txt | python3 -c "
import json,sys
for l in sys.stdin: d=json.loads(l); print(d['label'], round(d['output_tok_s'],1), round(d['ttft_s']['p50'],3), d['failed'])"
