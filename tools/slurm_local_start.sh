#!/usr/bin/env bash
# A single-node Slurm on this machine (localhost only), for trying and testing slurm/*.sh.
#
#   bash tools/slurm_local_start.sh      # install (Debian packages) if needed, start, wait until
#                                        # the node takes jobs; prints the SLURM_CONF to export
#   bash tools/slurm_local_stop.sh       # stop what this script started
#
# Idempotent: daemons it started earlier are reused when they still answer and the generated
# configuration has not changed; otherwise they are restarted (and their old jobs forgotten).
# Needs root (or passwordless sudo) and apt-get; works without systemd.
#
# What it does, and why (measured on Debian 12, Slurm 22.05):
# - apt-get install munge slurmctld slurmd slurm-client, with services kept from starting during
#   the install (a policy-rc.d that answers 101 when the machine has none);
# - munged runs as the munge user and needs /run/munge owned by munge; an already running munged
#   that answers is reused (and left running by the stop script);
# - the host name is not a usable node name, so the node is NodeName=localhost NodeAddr=127.0.0.1
#   and slurmd runs with -N localhost; CPUs and topology come from `slurmd -C`, RealMemory is 90%
#   of the measured memory (more than the node has makes it drain);
# - proctrack/linuxproc with task/none: no cgroup set-up needed; no accounting database;
# - everything lives under RTD_SLURM_HOME: slurm.conf, state, spool, logs, pid files.
#   /etc/slurm/slurm.conf is made a link to that slurm.conf only when there is none (or it is
#   already that link), so plain `sbatch` works; otherwise export the SLURM_CONF printed at the end.
#
# Environment: RTD_SLURM_HOME (default /var/tmp/rtd_scale_slurm), RTD_SLURM_TIMEOUT_S (seconds
# to wait for the node to take jobs, default 60).
# Exit status: 0 running; 3 Slurm cannot be installed here (no root/sudo, no apt-get, or the
# install failed: the message says which); 1 anything else.
set -euo pipefail

home="${RTD_SLURM_HOME:-/var/tmp/rtd_scale_slurm}"
timeout_s="${RTD_SLURM_TIMEOUT_S:-60}"
conf="$home/etc/slurm.conf"

cannot_install() { echo "slurm_local_start: cannot install Slurm here: $*" >&2; exit 3; }
die() { echo "slurm_local_start: error: $*" >&2; exit 1; }
log() { echo "slurm_local_start: $*"; }
# shellcheck source=tools/slurm_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_common.sh"  # slurm_conf_policy, alive

if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    exec sudo -n --preserve-env=RTD_SLURM_HOME,RTD_SLURM_TIMEOUT_S bash "${BASH_SOURCE[0]}" "$@"
  fi
  cannot_install "needs root or passwordless sudo (the daemons and /run/munge are system-wide)"
fi

# ---------------------------------------------------------------------------------- install ----
install_packages() {
  command -v apt-get >/dev/null 2>&1 || cannot_install "no apt-get (Debian/Ubuntu packages expected)"
  local policy=/usr/sbin/policy-rc.d added_policy=0
  if [ ! -e "$policy" ]; then  # keep the packages' init scripts from starting daemons unconfigured
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && added_policy=1
  fi
  local pkgs=(munge slurmctld slurmd slurm-client) ok=0
  export DEBIAN_FRONTEND=noninteractive
  log "installing ${pkgs[*]} ..."
  if timeout 300 apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1; then
    ok=1
  elif timeout 300 apt-get update -qq >/dev/null 2>&1 \
      && timeout 300 apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1; then
    ok=1
  fi
  if [ "$added_policy" = 1 ]; then rm -f "$policy"; fi
  [ "$ok" = 1 ] || cannot_install "apt-get install ${pkgs[*]} failed (no package mirror reachable?)"
}

have_binaries() {
  local b
  for b in munged munge unmunge slurmctld slurmd sbatch srun squeue scontrol sinfo; do
    command -v "$b" >/dev/null 2>&1 || return 1
  done
}
export PATH="$PATH:/usr/sbin:/sbin"
have_binaries || install_packages
have_binaries || cannot_install "the packages installed but Slurm's programs are not on PATH"

# ------------------------------------------------------------------------------------ munge ----
munge_ok() { timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; }
if munge_ok; then
  log "munged already running: reused"
else
  [ -s /etc/munge/munge.key ] || { /usr/sbin/mungekey --force >/dev/null 2>&1 || \
    /usr/sbin/create-munge-key -f >/dev/null 2>&1 || die "no /etc/munge/munge.key and none could be made"; }
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  timeout 30 runuser -u munge -- /usr/sbin/munged --force
  for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
  munge_ok || die "munged did not start; see /var/log/munge/munged.log"
  mkdir -p "$home"
  cat /run/munge/munged.pid > "$home/munged.started" 2>/dev/null || pgrep -u munge -x munged > "$home/munged.started"
  log "munged started"
fi

# ------------------------------------------------------------------------------- slurm.conf ----
mkdir -p "$home/etc" "$home/state" "$home/spool" "$home/log" "$home/run"
chmod 0755 "$home" "$home/etc" "$home/spool"
node_line="$(slurmd -C)"
node_line="${node_line%%$'\n'*}"  # NodeName=<host> CPUs=… Boards=… … RealMemory=<MB>
mem_mb="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")"
[ -n "$mem_mb" ] || die "cannot read RealMemory from 'slurmd -C': $node_line"
topology="$(sed -e 's/^NodeName=[^ ]* //' -e 's/ *RealMemory=[0-9]*//' <<<"$node_line")"
new_conf="$(cat <<EOF
# Written by tools/slurm_local_start.sh: a one-node Slurm on localhost. Do not edit; rerun it.
ClusterName=rtdlocal
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$home/state
SlurmdSpoolDir=$home/spool
SlurmctldPidFile=$home/run/slurmctld.pid
SlurmdPidFile=$home/run/slurmd.pid
SlurmctldLogFile=$home/log/slurmctld.log
SlurmdLogFile=$home/log/slurmd.log
$(slurm_conf_policy)
NodeName=localhost NodeAddr=127.0.0.1 $topology RealMemory=$(( mem_mb * 9 / 10 )) State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
)"

# -------------------------------------------------------------------------------- daemons ----
node_state() { timeout 10 sinfo -h -n localhost -o %T 2>/dev/null; }
ctld_pid="$home/run/slurmctld.pid" d_pid="$home/run/slurmd.pid"
export SLURM_CONF="$conf"

reuse=0
if [ -f "$conf" ] && [ "$(cat "$conf")" = "$new_conf" ] && alive "$ctld_pid" && alive "$d_pid" \
    && timeout 10 scontrol ping >/dev/null 2>&1; then
  case "$(node_state)" in idle*|mix*|alloc*|completing*) reuse=1 ;; esac
fi
if [ "$reuse" = 1 ]; then
  log "slurmctld and slurmd already running with this configuration: reused"
else
  RTD_SLURM_HOME="$home" bash "$(dirname "${BASH_SOURCE[0]}")/slurm_local_stop.sh" --keep-munge >/dev/null
  printf '%s\n' "$new_conf" > "$conf"
  # both daemonize; -c: forget the jobs of an earlier run of this local cluster
  timeout 60 slurmctld -c -f "$conf" || die "slurmctld failed to start; see $home/log/slurmctld.log"
  timeout 60 slurmd -f "$conf" -N localhost || die "slurmd failed to start; see $home/log/slurmd.log"
  log "slurmctld and slurmd started (config $conf)"
fi

# plain `sbatch` works when /etc/slurm/slurm.conf is free (or already ours)
etc_conf=/etc/slurm/slurm.conf
if [ ! -e "$etc_conf" ] && [ ! -L "$etc_conf" ]; then
  mkdir -p /etc/slurm && ln -s "$conf" "$etc_conf"
elif [ "$(readlink "$etc_conf" 2>/dev/null || true)" != "$conf" ]; then
  log "note: $etc_conf belongs to another configuration; export SLURM_CONF=$conf"
fi

state=""
for _ in $(seq "$(( timeout_s * 2 ))"); do
  state="$(node_state || true)"
  case "$state" in idle*|mix*|alloc*) break ;; esac
  sleep 0.5
done
case "$state" in
  idle*|mix*|alloc*) ;;
  *) die "node localhost is '${state:-not answering}' after ${timeout_s} s; see $home/log/slurm*.log" ;;
esac
log "node localhost is $state: $(sinfo -h -n localhost -o '%c CPUs, %m MB')"
echo "export SLURM_CONF=$conf"
