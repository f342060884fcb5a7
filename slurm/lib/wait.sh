# shellcheck shell=bash
# rtd_wait PID: wait for PID and leave its exit status in rc. A signal the caller traps (and
# counts in its variable `signals`) ends `wait` early with a status above 128 while PID runs
# on; then wait again. Sourced by pretrain_job.sh (srun) and rank_env.sh (the rank).
rtd_wait() {
  local before
  while :; do
    before="${signals:-0}"
    set +e
    wait "$1"
    rc=$?
    set -e
    if [ "${signals:-0}" != "$before" ] && [ "$rc" -gt 128 ]; then continue; fi
    return 0
  done
}
