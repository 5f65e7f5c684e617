#!/bin/bash
# call B: the rest of issue 30's runs, then issue 26's 0102 before/after
set -u
T0=$(date +%s)
W=/tmp/w; mkdir -p $OUT
[ -x $W/bld/bin/test-backend-ops ] || { echo "fresh machine: no build"; exit 3; }
bash .carry/exp.sh $((T0+300)) control serial devonly eager
bash .carry/i26.sh
cd $W && tar czf $OUT/c2.tgz r i26/*.log i26/summary.txt i26/*.txt 2>/dev/null; cat $W/r/summary.txt
