#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for tests: munge + slurmctld + slurmd, one partition "tripod".
#
#   bash scripts/slurm_local.sh start    install (if missing, as root), configure, start; waits until the node is idle
#   bash scripts/slurm_local.sh stop     stop the daemons this script started
#
# Installs Debian's slurm-wlm (and munge) with apt-get only when sbatch/slurmctld are missing and the user is root;
# otherwise it says what to run. The config (/etc/slurm/slurm.conf) is written only when absent or when it is
# the one this script wrote before (marker line), so a real cluster's config is never touched.
set -euo pipefail
ACTION=${1:-start}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# written by tripod scripts/slurm_local.sh"
STATE=/var/lib/tripod-slurm
as_root() {
  if [[ $(id -u) != 0 ]]; then
    echo "slurm_local.sh: $1 needs root; run: sudo bash scripts/slurm_local.sh $ACTION" >&2
    exit 1
  fi
}

stop() {
  for name in slurmd slurmctld; do
    if [[ -f $STATE/$name.pid ]]; then kill "$(cat "$STATE/$name.pid")" 2>/dev/null || true; rm -f "$STATE/$name.pid"; fi
  done
}

if [[ $ACTION == stop ]]; then stop; exit 0; fi
[[ $ACTION == start ]] || { echo "usage: slurm_local.sh start|stop" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null; then
  as_root "installing slurm-wlm (apt-get install slurm-wlm)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null 2>&1 || {
    apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null; }
fi

# already up (ours or a real one)? nothing to do
if scontrol ping 2>/dev/null | grep -q "is UP" && sinfo -h -o %T 2>/dev/null | grep -qE "idle|mixed|alloc"; then
  echo "slurm_local.sh: slurmctld is up"; exit 0
fi
as_root "starting slurmctld/slurmd"
# The daemons outlive this script: they must not inherit its open files (under `flock LOCK make test-launch`
# munged kept the lock for its whole life).
for fd in /proc/$$/fd/*; do fd=${fd##*/}; if (( fd > 2 )); then eval "exec $fd>&-" 2>/dev/null || true; fi; done
mkdir -p "$STATE" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge "$CONF_DIR"

# munge: a key and a running munged
if ! pgrep -x munged >/dev/null; then
  [[ -s /etc/munge/munge.key ]] || { mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; }
  if id munge >/dev/null 2>&1; then
    chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged
  else
    chmod 0400 /etc/munge/munge.key
    /usr/sbin/munged --force
  fi
fi

HOST=$(hostname -s)
CPUS=$(nproc)
MEM=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
if [[ ! -f $CONF ]] || head -n1 "$CONF" | grep -qF "$MARK"; then
  cat > "$CONF" <<CONF
$MARK
ClusterName=tripodlocal
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
KillWait=5
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=tripod Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
fi
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 60); do
  if sinfo -h -o %T 2>/dev/null | grep -qE "^(idle|mixed|allocated)"; then
    echo "slurm_local.sh: single-node SLURM up on $HOST ($CPUS CPUs)"; exit 0
  fi
  scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
  sleep 1
done
echo "slurm_local.sh: the node did not become idle; see /var/log/slurm/slurmctld.log and slurmd.log" >&2
sinfo >&2 || true
exit 1
