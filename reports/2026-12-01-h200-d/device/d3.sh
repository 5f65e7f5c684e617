#!/usr/bin/env bash
# call 3 (issue 17, item 4): a draft model (-md) beside an auto/window main context with little free memory, with 0019;
# the same server without 0019 (libllama-common rebuilt with 0019 reversed) as "before"
source .carry/env.sh
exec > >(tee $OUT/d3.log) 2>&1
stamp start
S=$P/bin/llama-server
BAL() { python3 -m rollkv_dist.ballast --leave-free $1 > $W/ballast.log 2>&1 & BP=$!; for i in $(seq 60); do grep -q ready $W/ballast.log && break; sleep 1; done; cat $W/ballast.log; }
BAL 20000
python3 .carry/server_checks.py $S $REP/draft-auto-after.json draft-md-auto-1M-20GB-free-0019 150 -m $M -md $M -c 1048576
grep -E "rolling KV|draft|window =|failed|error" $REP/draft-auto-after.log 2>/dev/null | cut -c1-300 | head -20
kill $BP; wait $BP 2>/dev/null
stamp before-0019
B19=$W/before19; rm -rf $B19; cp -a $P $B19
( cd $W/src && patch -R -p1 < $OLDPWD/patches/0019-*.patch > /dev/null ) && cmake --build $BD --target llama-server -j 16 2>&1 | tail -1 && \
  cp -P $BD/bin/libllama-common.so* $BD/bin/libllama-server-impl.so $B19/lib/ 2>/dev/null; ls -la $B19/lib | grep -E "common|server" | head
( cd $W/src && patch -p1 < $OLDPWD/patches/0019-*.patch > /dev/null )
BAL 20000
python3 .carry/server_checks.py $B19/bin/llama-server $REP/draft-auto-before.json draft-md-auto-1M-20GB-free-before 150 -m $M -md $M -c 1048576
kill $BP; wait $BP 2>/dev/null
stamp end
tar czf $OUT/d3.tar.gz -C $W rep --exclude='*.f32'
