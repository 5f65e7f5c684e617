#!/usr/bin/env bash
# wait (bounded) until both builds have installed llama-bench
set -u
for i in $(seq 1 ${1:-60}); do
  [ -x /tmp/p-full/bin/llama-server ] && [ -x /tmp/p-full/bin/llama-bench ] && [ -x /tmp/p-up/bin/llama-bench ] && break
  sleep 5
done
for f in /tmp/build-full.log /tmp/build-up.log /tmp/model.log; do echo "== $f"; tail -c 400 "$f"; echo; done
ls -la /tmp/p-full/bin /tmp/p-up/bin 2>&1 | head; ls -la /tmp/gw/models 2>&1
