# shellcheck shell=bash
# Shared by the test clusters' scripts (tools/slurm_local_*.sh, tools/slurm_multinode_*.sh).
# Sourced, not run.

# slurm_conf_policy: the slurm.conf lines both test clusters share (process tracking, no
# accounting, backfill over cores, requeue allowed, Slurm's usual timeouts).
slurm_conf_policy() {
  cat <<'CONF'
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=30
InactiveLimit=0
SlurmctldTimeout=60
SlurmdTimeout=120
CONF
}

# alive PIDFILE: the process the file names is running
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# stop_pid PIDFILE NAME WHO: SIGTERM, up to 10 s, then SIGKILL; WHO prefixes the report line
stop_pid() {
  local file="$1" name="$2" who="$3" pid
  alive "$file" || { rm -f "$file"; return 0; }
  pid="$(cat "$file")"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$file"
  echo "$who: stopped $name ($pid)"
}
