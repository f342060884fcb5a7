#!/usr/bin/env bash
# Stops the single-node Slurm that tools/slurm_local_start.sh started: cancels its jobs (so no
# job step outlives the daemons), stops slurmd and slurmctld by their pid files, and stops munged
# only if the start script started it. Safe to run when nothing is running.
#
#   bash tools/slurm_local_stop.sh [--keep-munge]
#
# Environment: RTD_SLURM_HOME (default /var/tmp/rtd_scale_slurm), as for the start script.
set -euo pipefail

home="${RTD_SLURM_HOME:-/var/tmp/rtd_scale_slurm}"
conf="$home/etc/slurm.conf"
keep_munge=0
[ "${1:-}" = "--keep-munge" ] && keep_munge=1
export PATH="$PATH:/usr/sbin:/sbin"

if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  exec sudo -n --preserve-env=RTD_SLURM_HOME bash "${BASH_SOURCE[0]}" "$@"
fi

# shellcheck source=tools/slurm_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_common.sh"  # alive, stop_pid

if [ -f "$conf" ] && alive "$home/run/slurmctld.pid" && command -v scancel >/dev/null 2>&1; then
  export SLURM_CONF="$conf"
  if [ -n "$(timeout 10 squeue -h -o %i 2>/dev/null || true)" ]; then
    timeout 10 squeue -h -o %i | xargs -r timeout 10 scancel --quiet 2>/dev/null || true
    for _ in $(seq 60); do  # let the steps end while slurmd still runs
      [ -z "$(timeout 10 squeue -h -o %i 2>/dev/null || true)" ] && break
      sleep 0.5
    done
  fi
fi
stop_pid "$home/run/slurmd.pid" slurmd slurm_local_stop
stop_pid "$home/run/slurmctld.pid" slurmctld slurm_local_stop

if [ "$(readlink /etc/slurm/slurm.conf 2>/dev/null || true)" = "$conf" ] && [ "$keep_munge" = 0 ]; then
  rm -f /etc/slurm/slurm.conf
fi
if [ "$keep_munge" = 0 ] && [ -s "$home/munged.started" ]; then
  cp "$home/munged.started" "$home/munged.pid.tmp"
  stop_pid "$home/munged.pid.tmp" munged slurm_local_stop
  rm -f "$home/munged.started"
fi
