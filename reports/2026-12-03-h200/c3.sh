#!/bin/bash
# call C: repeats for a pass rate: every variant that passed once runs twice more, the control twice more
set -u
T0=$(date +%s)
W=/tmp/w; mkdir -p $OUT
[ -x $W/bld/bin/test-backend-ops ] || { echo "fresh machine: no build"; exit 3; }
names=(control.2 control.3)
for v in keep serial devonly eager; do
  [ "$(cat $W/r/$v.rc 2>/dev/null)" = 0 ] && names+=($v.2 $v.3)
done
echo "repeats: ${names[*]}"
bash .carry/exp.sh $((T0+430)) "${names[@]}"
cd $W && tar czf $OUT/c3.tgz r 2>/dev/null; cat $W/r/summary.txt
