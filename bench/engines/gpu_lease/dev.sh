#!/bin/bash
# The device side of the real-engine GPU bench (bench/engines/real_engine.py --gpu) on a lent machine with
# no network and no vLLM: bundle.sh beside this file builds the parts (.dev/p1 .. .dev/pN) and copies this
# script into each; every call of the device tool carries one part.
#   bash .dev/p1/dev.sh setup      (call 1: background extract + model write)
#   bash .dev/pK/dev.sh part K     (calls 2..N: hand part K to the background extract)
#   bash .dev/pN/dev.sh final      (last part's call: wait for the extract and the model; redis, overlay, run 1)
#   bash .dev/pN/dev.sh run2       (a call after it: run 2, a small KV cache)
# Each part carries this script; the last also the overlay (files changed in the helper's worktree) and
# redis.tar.gz. What a call brings is copied to $T at once: nothing relies on .dev/ staying between calls.
# Parts: .dev/pK/cK are consecutive pieces of one site.tar.gz (vllm 0.24.0 and its small deps for
# Python 3.12), NPARTS of them; the background reader streams them into tar as each call lands one.
NPARTS=${NPARTS:-6}  # bundle.sh writes the number it made
T=${DEV_TMP:-/tmp}
R=$(pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
cmd=$1
S=$T/site
W=$T/re
mkdir -p $T/chunks $S $W
say() { echo "[dev $(date +%T)] $*"; }

case "$cmd" in
setup)
  cp .dev/p1/c1 $T/chunks/ && touch $T/ready_1
  # the extract, in a session of its own so that it outlives this call
  setsid -f bash -c "
    for k in \$(seq 1 $NPARTS); do
      while [ ! -e $T/ready_\$k ]; do sleep 0.3; done
      cat $T/chunks/c\$k
    done | tar -xzf - -C $S && touch $T/extract_ok || touch $T/extract_failed" >$T/extract.log 2>&1 </dev/null
  setsid -f bash -c "python3 $R/workers/engines/random_model.py $W/model --layers 16 --hidden 2048 --heads 16 \
    --kv-heads 8 --intermediate 5632 --max-positions 8192 && touch $T/model_ok" >$T/model.log 2>&1 </dev/null
  say "background started"
  ;;
part)
  k=$2
  cp .dev/p$k/c$k $T/chunks/ && touch $T/ready_$k && say "part $k handed over"
  ls -la $T/chunks; ls $T/*_ok $T/*_failed 2>/dev/null; du -sh $S; tail -c 300 $T/model.log
  ;;
final|run2)
  if [ "$cmd" = final ]; then
    # a part the background missed (it died, or a call did not touch ready): extract it all here
    for i in $(seq 1 240); do [ -e $T/extract_ok ] || [ -e $T/extract_failed ] && break; sleep 0.5; done
    if [ ! -e $T/extract_ok ]; then
      say "background extract not done: $(cat $T/extract.log); extracting here"
      rm -rf $S && mkdir -p $S && cat $(for k in $(seq 1 $NPARTS); do echo $T/chunks/c$k; done) | tar -xzf - -C $S || exit 3
    fi
    for i in $(seq 1 240); do [ -e $T/model_ok ] && break; sleep 0.5; done
    [ -e $T/model_ok ] || { say "model not written: $(tail -c 2000 $T/model.log)"; exit 4; }
    say "site and model ready"
    # redis-server from a Debian 12 host, its libraries beside it (.dev/p$NPARTS)
    mkdir -p $T/redis && tar -xzf $HERE/redis.tar.gz -C $T/redis
    $T/redis/redis-server.sh --version || say "REDIS FAILED"
  fi
  # each call lays the tree anew: the overlay and the package links again
  if [ -d $HERE/overlay ]; then cp -r $HERE/overlay/. "$R"/ && say "overlay applied"; fi
  ln -sfn ../workers conductor/workers; ln -sfn ../lua conductor/lua; ln -sfn ../migrations conductor/migrations
  export PYTHONPATH=$S:$R CONDUCTOR_REDIS_SERVER=$T/redis/redis-server.sh PYTHONUNBUFFERED=1
  # nothing can be reached from the device: no hub look-ups, no usage reports
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  # vLLM 0.24's sampler imports the FlashInfer backend on any CUDA GPU unless this is 0, and FlashInfer is
  # not carried (its engine core died at start with "No module named 'flashinfer'")
  export VLLM_USE_FLASHINFER_SAMPLER=0
  if [ "${DRY:-0}" = 1 ]; then
    python3 -c 'import vllm, torch, httpx; print("vllm", vllm.__version__, "torch", torch.__version__, "httpx", httpx.__version__)' 2>&1 | tail -3
    python3 -m bench.engines.real_engine --help | head -3
    python3 -c "from bench.engines.real_engine_files import write; from pathlib import Path; write(Path('$W/t.jsonl'), 'prefix', 32, 'tiny')"
    python3 -m conductor run $W/t.jsonl --engine sim --workers 1 -o $W/t.out.jsonl 2>&1 | tail -2
    exit 0
  fi
  if [ "$cmd" = final ]; then
    # warm-up, untimed, and the smoke test: one runner on 16 lines compiles what Python and Triton compile
    # once per machine (bytecode, kernels), so that the first timed case does not pay for it alone
    t=$(date +%s)
    python3 -c "from bench.engines.real_engine_files import write; from pathlib import Path; write(Path('$W/warm.jsonl'), 'prefix', 16, 'tiny')"
    timeout ${WARM_S:-180} python3 -m vllm.entrypoints.openai.run_batch -i $W/warm.jsonl -o $W/warm.out.jsonl \
      --model $W/model --served-model-name tiny --enforce-eager >$W/warm.log 2>&1
    wrc=$?
    cp $W/warm.log $OUT/warm.log
    say "warm-up exit $wrc after $(( $(date +%s) - t )) s, $(wc -l <$W/warm.out.jsonl 2>/dev/null) lines out"
    if [ $wrc != 0 ]; then grep -v "^INFO" $W/warm.log | tail -60; exit 5; fi
    head -c 400 $W/warm.out.jsonl; echo
  fi
  t0=$(date +%s)
  if [ "$cmd" = final ]; then
    # run 1: vLLM's own memory share (the KV cache holds every prompt)
    # (KV= sizes the cache here too, CASES= adds d: vllm serve and the openai engine)
    timeout ${RUN_S:-400} python3 -m bench.engines.real_engine --gpu --eager --files ${FILES:-prefix} \
      --cases ${CASES:-a,b} --lines ${LINES:-2048} ${KV:+--kv-mb $KV} --model-dir $W/model --work $W/w1 --no-write \
      --json $OUT/run1.json 2>&1 | tee $OUT/run1.log
    rc=${PIPESTATUS[0]}; n=1
  else
    # run 2: a KV cache that cannot hold every system prompt at once, as on the CPU (10,900 tokens)
    timeout ${RUN_S:-400} python3 -m bench.engines.real_engine --gpu --eager --files ${FILES:-prefix} \
      --cases ${CASES:-a,b} --lines ${LINES:-1024} --kv-mb ${KV:-683} --model-dir $W/model --work $W/w2 --no-write \
      --json $OUT/run2.json 2>&1 | tee $OUT/run2.log
    rc=${PIPESTATUS[0]}; n=2
  fi
  say "run $n exit $rc after $(( $(date +%s) - t0 )) s"
  (cd $W/w$n && tar -czf $OUT/logs$n.tgz *.log 2>/dev/null)
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm --format=csv
  ;;
esac
