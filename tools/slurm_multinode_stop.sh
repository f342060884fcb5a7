#!/usr/bin/env bash
# Removes the two-node cluster of run RUN_ID that tools/slurm_multinode_start.sh made: cancels
# its jobs, stops slurmd (both nodes), slurmctld and munged by their pid files, ends any process
# still inside the run's namespaces, deletes the namespaces, veths and bridge (waiting until the
# kernel has really removed them: deleting a namespace is asynchronous) and the run's directory.
# Safe to run again, and on a half-made cluster.
#
#   bash tools/slurm_multinode_stop.sh RUN_ID
#
# Environment: RTD_MN_HOME (default /var/tmp/rtd_mn_<RUN_ID>), as for the start script;
# RTD_MN_KEEP_HOME=1 keeps the directory (logs) for a post-mortem.
set -uo pipefail
export PATH="$PATH:/usr/sbin:/sbin"

id="${1:?usage: slurm_multinode_stop.sh RUN_ID}"
[[ "$id" =~ ^[a-z0-9]{1,6}$ ]] || { echo "slurm_multinode_stop: run id '$id': expected 1-6 characters a-z0-9" >&2; exit 1; }
home="${RTD_MN_HOME:-/var/tmp/rtd_mn_$id}"
ctl="rtd${id}c" br="rtd${id}br"
namespaces=("$ctl" "rtd${id}n1" "rtd${id}n2")

# shellcheck source=tools/slurm_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_common.sh"  # alive, stop_pid

if [ -x "$home/bin/in-ns" ] && [ -e "/run/netns/$ctl" ] && alive "$home/run/slurmctld.pid"; then
  export SLURM_CONF="$home/etc/slurm.conf"
  jobs="$("$home/bin/in-ns" "$ctl" timeout 10 squeue -h -o %i 2>/dev/null || true)"
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086
    "$home/bin/in-ns" "$ctl" timeout 10 scancel --quiet $jobs 2>/dev/null || true
    for _ in $(seq 40); do  # let the steps end while slurmd still runs
      [ -z "$("$home/bin/in-ns" "$ctl" timeout 10 squeue -h -o %i 2>/dev/null || true)" ] && break
      sleep 0.5
    done
  fi
fi
for node in "rtd${id}n1" "rtd${id}n2"; do stop_pid "$home/run/slurmd.$node.pid" "slurmd on $node" slurm_multinode_stop; done
stop_pid "$home/run/slurmctld.pid" slurmctld slurm_multinode_stop
stop_pid "$home/run/munged.pid" munged slurm_multinode_stop

# whatever still runs in the run's namespaces (job steps slurmd left behind) was started by it
for ns in "${namespaces[@]}"; do
  [ -e "/run/netns/$ns" ] || continue
  pids="$(ip netns pids "$ns" 2>/dev/null || true)"
  if [ -n "$pids" ]; then
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    echo "slurm_multinode_stop: ended leftover processes in $ns: ${pids//$'\n'/ }"
  fi
  ip netns del "$ns" 2>/dev/null || true
done
ip link del "$br" 2>/dev/null || true

# a namespace's veths go only when the kernel has freed the namespace, and a link deleted by
# hand is freed asynchronously too: wait for them before and after deleting them, and report
# what one reading of the links still holds (a second reading could already be empty)
run_links() { ip -o link show 2>/dev/null | grep -o -e "rtd${id}v[0-9]" -e "$br" | sort -u; }
links_gone() {
  local _
  for _ in $(seq 300); do
    [ -z "$(run_links)" ] && return 0
    sleep 0.1
  done
  return 1
}
if ! links_gone; then
  for v in 0 1 2; do ip link del "rtd${id}v$v" 2>/dev/null || true; done
  ip link del "$br" 2>/dev/null || true
  links_gone || true
fi
left="$(run_links)"
if [ -n "$left" ]; then
  echo "slurm_multinode_stop: error: interfaces of run $id still exist: ${left//$'\n'/ }" >&2
  exit 1
fi
if [ "${RTD_MN_KEEP_HOME:-0}" != 1 ] && [ -d "$home" ]; then rm -rf "$home"; fi
echo "slurm_multinode_stop: run $id removed"
