#!/usr/bin/env bash
tree=$1; shift; reps=$1; shift; systems=$1; shift; extra=$1; shift
cd $tree; export PYTHONPATH=$PWD
for wl in "$@"; do
  n=""; [ $wl = prefix ] && n="--num-requests 400"
  timeout 400 python /tmp/bench_new.py --workload $wl $n --systems $systems --repeats $reps $extra 2>&1 | grep -E "^\| hf|^hf_paged.*failed" | sed "s/^/[$wl $extra] /"
done
