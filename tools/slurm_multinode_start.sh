#!/usr/bin/env bash
# A two-node Slurm cluster on this one machine, in Linux network namespaces, for testing the
# multi-node paths of slurm/*.sh (MASTER_ADDR, rank discovery, where TP and DP groups fall).
#
#   bash tools/slurm_multinode_start.sh [RUN_ID]   # prints the cluster's variables on success
#   bash tools/slurm_multinode_stop.sh  RUN_ID     # removes everything this run made
#
# The cluster of run RUN_ID (1-6 characters a-z0-9; default: a random one):
#   namespaces  rtd<ID>c (controller), rtd<ID>n1 and rtd<ID>n2 (the nodes; each 2 CPUs)
#   bridge      rtd<ID>br, host side 10.<A>.<B>.1/24; the controller is .2, the nodes .11, .12
#               (A, B from a hash of the id; a subnet any route of this machine covers is skipped)
#   hostnames   rtd<ID>c, rtd<ID>n1, rtd<ID>n2: each namespace has its own (UTS namespace) and a
#               hosts file naming the three, bind-mounted over /etc/hosts in its own mount
#               namespace, so torch.distributed finds MASTER_ADDR by name
#   files       RTD_MN_HOME (default /var/tmp/rtd_mn_<ID>): slurm.conf, hosts, munge key and
#               socket, state, spool, logs, pid files, and bin/in-ns, the way in:
#                 <home>/bin/in-ns rtd<ID>c sbatch ...   # every Slurm client command goes here
#
# Network safety: the bridge gets its address before any daemon starts; each namespace has a
# loopback and one veth on the bridge, and its only route is the /24 it is on (no default route,
# no forwarding or NAT is configured), so no packet can leave the interfaces made here. Slurm's
# clients run in the controller's namespace, never in this machine's own.
#
# Measured on Debian 12 (Slurm 22.05, munge 0.5.15), and why things are done as they are:
# - `ip netns exec` remounts /sys, and slurmd dies without the cgroup mount it then loses: we
#   enter with `nsenter --net=/run/netns/NS` and `unshare --uts --mount` instead;
# - one munged (run inside the controller's namespace) serves all three: a Unix socket in a 0755
#   directory (munged refuses a 0700 one), its key in a separate 0700 directory;
#   AuthInfo=socket=… points Slurm at it, so a munged of the machine's own is not touched;
# - SlurmdParameters=config_overrides: each node claims CPUs=2 whatever the machine has;
#   proctrack/linuxproc with task/none, no cgroup set-up; no accounting database.
#
# Environment: RTD_MN_HOME, RTD_MN_TIMEOUT_S (seconds to wait for both nodes, default 60).
# Output on success (stdout, one per line): RTD_MN_ID=, RTD_MN_HOME=, SLURM_CONF=, RTD_MN_SUBNET=,
# RTD_MN_CTL=, RTD_MN_NODES= (space-separated), RTD_MN_ADDRS= (the nodes' addresses).
# Exit status: 0 running; 3 the cluster cannot be made here (not root, no namespaces or bridges,
# Slurm or munge not installable): one line on stderr says why, and nothing is left behind;
# 1 anything else (the stop script is run before exiting).
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"

id="${1:-$(head -c 64 /dev/urandom | tr -dc 'a-z0-9' | head -c 6)}"
[[ "$id" =~ ^[a-z0-9]{1,6}$ ]] || { echo "slurm_multinode_start: run id '$id': expected 1-6 characters a-z0-9" >&2; exit 1; }
home="${RTD_MN_HOME:-/var/tmp/rtd_mn_$id}"
timeout_s="${RTD_MN_TIMEOUT_S:-60}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ctl="rtd${id}c" n1="rtd${id}n1" n2="rtd${id}n2" br="rtd${id}br"
nodes=("$n1" "$n2")

cannot() { echo "slurm_multinode_start: cannot make a two-node cluster here: $*" >&2; exit 3; }
log() { echo "slurm_multinode_start: $*" >&2; }
failed() {
  local rc=$?
  if [ "$rc" != 0 ] && [ "$rc" != 3 ]; then
    log "error (status $rc); logs in $home/log; removing the cluster"
    RTD_MN_HOME="$home" bash "$here/slurm_multinode_stop.sh" "$id" >&2 || true
  fi
}
die() { echo "slurm_multinode_start: error: $*" >&2; exit 1; }
# shellcheck source=tools/slurm_common.sh
source "$here/slurm_common.sh"  # slurm_conf_policy

[ "$(id -u)" -eq 0 ] || cannot "needs root (network namespaces, a bridge, daemons)"
for cmd in ip nsenter unshare mount hostname; do
  command -v "$cmd" >/dev/null 2>&1 || cannot "no '$cmd' (iproute2 / util-linux)"
done

# ------------------------------------------------------------------- Slurm and munge ----
have_binaries() {
  local b
  for b in munged munge unmunge slurmctld slurmd sbatch srun squeue scontrol sinfo scancel; do
    command -v "$b" >/dev/null 2>&1 || return 1
  done
}
install_packages() {  # the same packages as tools/slurm_local_start.sh, daemons kept stopped
  command -v apt-get >/dev/null 2>&1 || cannot "Slurm is not installed and there is no apt-get"
  local policy=/usr/sbin/policy-rc.d added=0 ok=0 pkgs=(munge slurmctld slurmd slurm-client)
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && added=1; fi
  export DEBIAN_FRONTEND=noninteractive
  log "installing ${pkgs[*]} ..."
  if timeout 300 apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1; then ok=1
  elif timeout 300 apt-get update -qq >/dev/null 2>&1 \
      && timeout 300 apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1; then ok=1
  fi
  if [ "$added" = 1 ]; then rm -f "$policy"; fi
  [ "$ok" = 1 ] || cannot "apt-get install ${pkgs[*]} failed (no package mirror reachable?)"
}
have_binaries || install_packages
have_binaries || cannot "Slurm's or munge's programs are not on PATH after the install"

# ----------------------------------------------------------------- namespaces, bridge ----
ip netns list >/dev/null 2>&1 || cannot "'ip netns' does not work"
if ip link show "$br" >/dev/null 2>&1 || [ -e "/run/netns/$ctl" ]; then
  die "a cluster with run id '$id' exists already; stop it first: bash $here/slurm_multinode_stop.sh $id"
fi
# the subnet: 10.A.B.0/24 from the id's hash, the first that no route here covers or splits
hash="$(printf '%s' "$id" | cksum | cut -d' ' -f1)"
subnet=""
for try in $(seq 0 40); do
  a=$(( 200 + (hash / 256 + try * 7) % 50 )) b=$(( (hash + try * 13) % 256 ))
  cand="10.$a.$b"
  if [ -z "$(ip -4 route show match "$cand.0/24" | grep -v '^default' || true)" ] \
      && [ -z "$(ip -4 route show root "$cand.0/24" || true)" ] \
      && [ -z "$(ip -4 addr show to "$cand.0/24" || true)" ]; then
    subnet="$cand"; break
  fi
done
[ -n "$subnet" ] || die "no free 10.x.y.0/24 subnet found for the bridge"

trap failed EXIT
mkdir -p "$home"/{etc,state,spool,log,run,bin,munge/key,munge/sock}
chmod 0755 "$home" "$home/etc" "$home/spool" "$home/munge" "$home/munge/sock"
chmod 0700 "$home/munge/key"
echo "$subnet" > "$home/subnet"

# bridge first, with its address, before any namespace or daemon exists
ip link add "$br" type bridge 2>/dev/null || { rm -rf "$home"; trap - EXIT; cannot "cannot create a bridge (no CAP_NET_ADMIN, or no bridge support)"; }
ip addr add "$subnet.1/24" dev "$br"
ip link set "$br" up

declare -A addr=(["$ctl"]="$subnet.2" ["$n1"]="$subnet.11" ["$n2"]="$subnet.12")
i=0
for ns in "$ctl" "${nodes[@]}"; do
  ip netns add "$ns"
  ip link add "rtd${id}v$i" type veth peer name eth0 netns "$ns"
  ip link set "rtd${id}v$i" master "$br" up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "${addr[$ns]}/24" dev eth0
  ip -n "$ns" link set eth0 up
  [ -z "$(ip -n "$ns" route show default)" ] || die "namespace $ns has a default route"
  i=$(( i + 1 ))
done

{
  echo "127.0.0.1 localhost"
  for ns in "$ctl" "${nodes[@]}"; do echo "${addr[$ns]} $ns"; done
} > "$home/etc/hosts"
chmod 0644 "$home/etc/hosts"

# <home>/bin/in-ns NS CMD...: run CMD in namespace NS, with its hostname and hosts file
cat > "$home/bin/in-ns" <<EOF
#!/usr/bin/env bash
# Written by tools/slurm_multinode_start.sh: run a command inside one of run $id's namespaces
# (network, and a private UTS and mount namespace with that node's hostname and hosts file).
set -euo pipefail
ns="\${1:?usage: in-ns NAMESPACE COMMAND...}"; shift
[ -e "/run/netns/\$ns" ] || { echo "in-ns: no namespace \$ns" >&2; exit 1; }
exec nsenter --net="/run/netns/\$ns" -- unshare --uts --mount --propagation private -- \\
  bash -c 'mount --bind "\$1" /etc/hosts && hostname "\$2" && shift 2 && exec "\$@"' in-ns \\
  "$home/etc/hosts" "\$ns" "\$@"
EOF
chmod 0755 "$home/bin/in-ns"
in_ns() { "$home/bin/in-ns" "$@"; }

# --------------------------------------------------------------------------------- munge ----
sock="$home/munge/sock/munge.socket"
dd if=/dev/urandom of="$home/munge/key/munge.key" bs=1024 count=1 status=none
chmod 0400 "$home/munge/key/munge.key"
in_ns "$ctl" munged --force --socket="$sock" --key-file="$home/munge/key/munge.key" \
  --pid-file="$home/run/munged.pid" --log-file="$home/log/munged.log" \
  --seed-file="$home/munge/key/munged.seed" \
  || die "munged did not start; see $home/log/munged.log"
munge_ok() { timeout 5 munge -S "$sock" -n 2>/dev/null | timeout 5 unmunge -S "$sock" >/dev/null 2>&1; }
for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
munge_ok || die "munged does not answer on $sock; see $home/log/munged.log"

# ---------------------------------------------------------------------------- slurm.conf ----
conf="$home/etc/slurm.conf"
cat > "$conf" <<EOF
# Written by tools/slurm_multinode_start.sh (run $id): two nodes in network namespaces.
ClusterName=rtd$id
SlurmctldHost=$ctl(${addr[$ctl]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
StateSaveLocation=$home/state
SlurmdSpoolDir=$home/spool/%n
SlurmctldPidFile=$home/run/slurmctld.pid
SlurmdPidFile=$home/run/slurmd.%n.pid
SlurmctldLogFile=$home/log/slurmctld.log
SlurmdLogFile=$home/log/slurmd.%n.log
SlurmdParameters=config_overrides
$(slurm_conf_policy)
NodeName=$n1 NodeAddr=${addr[$n1]} NodeHostname=$n1 CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=2000 State=UNKNOWN
NodeName=$n2 NodeAddr=${addr[$n2]} NodeHostname=$n2 CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=2000 State=UNKNOWN
PartitionName=nodes Nodes=$n1,$n2 Default=YES MaxTime=INFINITE State=UP
EOF
chmod 0644 "$conf"
export SLURM_CONF="$conf"

in_ns "$ctl" timeout 60 slurmctld -c -f "$conf" || die "slurmctld failed to start; see $home/log/slurmctld.log"
for node in "${nodes[@]}"; do
  mkdir -p "$home/spool/$node"
  in_ns "$node" timeout 60 slurmd -f "$conf" -N "$node" || die "slurmd on $node failed to start; see $home/log/slurmd.$node.log"
done

states=""
for _ in $(seq "$(( timeout_s * 2 ))"); do
  states="$(in_ns "$ctl" timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null | sort | tr '\n' ' ' || true)"
  [[ "$states" =~ ^$n1\ (idle|mixed|allocated)[^\ ]*\ $n2\ (idle|mixed|allocated)[^\ ]*\ $ ]] && break
  sleep 0.5
done
[[ "$states" =~ ^$n1\ (idle|mixed|allocated)[^\ ]*\ $n2\ (idle|mixed|allocated)[^\ ]*\ $ ]] \
  || die "the nodes are '${states:-not answering}' after ${timeout_s} s; see $home/log/slurm*.log"
trap - EXIT
log "run $id: controller $ctl (${addr[$ctl]}), nodes $n1 (${addr[$n1]}) and $n2 (${addr[$n2]}): $states"
echo "RTD_MN_ID=$id"
echo "RTD_MN_HOME=$home"
echo "SLURM_CONF=$conf"
echo "RTD_MN_SUBNET=$subnet.0/24"
echo "RTD_MN_CTL=$ctl"
echo "RTD_MN_NODES=$n1 $n2"
echo "RTD_MN_ADDRS=${addr[$n1]} ${addr[$n2]}"
