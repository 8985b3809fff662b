# Node-side library of the Slurm reference controller. The controller sends this file, followed by
# variable assignments and one action call, as the stdin of `bash -s` over SSH on a member allocation.
# Every action is idempotent (check before doing) and prints `KEY=value` lines the controller parses.
#
# Layout on an allocation (one directory per allocation and cluster, so several allocations of one
# machine never share state):  $D = /var/lib/gpuaas-slurm/<allocation key>/<cluster id>
#   etc/slurm.conf etc/slurmdbd.conf   munge/munge.key munge/munge.sock   db/ (MariaDB datadir)
#   state/ (StateSaveLocation)   spool/<node>/   log/   run/*.pid   cluster.json (controller only)
# Every daemon is started with GPUAAS_SLURM_DIR=$D and GPUAAS_SLURM_ROLE=<role> in its environment,
# which is how teardown finds and verifies them (/proc/<pid>/environ), whatever they call themselves.

set -uo pipefail
export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
export LC_ALL=C
ROOT=/var/lib/gpuaas-slurm
# the allocation's id without dashes, last 12 hex digits (its random part): Unix socket paths under
# the spool directory must stay below 108 bytes
ALLOC_KEY="${GPUAAS_ALLOCATION_ID:-host}"; ALLOC_KEY="${ALLOC_KEY//-/}"; ALLOC_KEY="${ALLOC_KEY: -12}"
D="$ROOT/$ALLOC_KEY/$CLUSTER_ID"
export GPUAAS_SLURM_DIR="$D"
export SLURM_CONF="$D/etc/slurm.conf"
MUNGE_SOCK="$D/munge/munge.sock"

die() { echo "ERROR: $*" >&2; echo "ERROR=$*"; exit 3; }

precheck() {
    local missing="" b
    [ "$(id -u)" = 0 ] || die "this host cannot run Slurm: the allocation's sessions run as uid $(id -u), and munged, slurmctld and slurmd need root (run the node agent as root on a host meant for Slurm)"
    for b in munged munge unmunge slurmctld slurmd slurmdbd sacctmgr scontrol sinfo mariadbd mariadb-install-db mariadb python3 flock; do
        command -v "$b" >/dev/null 2>&1 || missing="$missing $b"
    done
    [ -z "$missing" ] || die "this host cannot run Slurm: missing$missing (install the Debian packages slurm-wlm slurmdbd munge mariadb-server)"
    echo "HOSTNAME=$(hostname -s)"
    echo "CPUS=$(nproc)"
    echo "DIR=$D"
}

# free_ports N: N TCP ports that nothing listens on now (bound together, then released).
free_ports() {
    python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("", 0)); socks.append(s)
print("PORTS=" + ",".join(str(s.getsockname()[1]) for s in socks))
PY
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null; }

wait_port() {  # wait_port PORT SECONDS
    local i
    for i in $(seq $(($2 * 5))); do (echo >/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.2; done
    return 1
}

stop_pidfile() {  # stop_pidfile FILE: TERM, wait, KILL
    local pid i
    [ -f "$1" ] || return 0
    pid=$(cat "$1" 2>/dev/null)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null
        for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    fi
    rm -f "$1"
}

layout() {
    mkdir -p "$D"/{etc,munge,log,run,spool,state} 2>/dev/null \
        || die "cannot create the cluster directory $D on this host: $(mkdir -p "$D" 2>&1 | head -n 1)"
    chmod 700 "$D/munge"
}

write_file() {  # write_file PATH MODE BASE64
    local tmp="$1.tmp.$$"
    echo "$3" | base64 -d >"$tmp" && chmod "$2" "$tmp" && mv -f "$tmp" "$1"
}

munge_up() {  # needs MUNGE_KEY_B64
    layout
    local key="$D/munge/munge.key" restart=0
    if [ ! -f "$key" ] || [ "$(base64 -w0 <"$key")" != "$MUNGE_KEY_B64" ]; then
        write_file "$key" 400 "$MUNGE_KEY_B64"
        restart=1
    fi
    if [ "$restart" = 1 ] || ! alive "$D/run/munged.pid"; then
        stop_pidfile "$D/run/munged.pid"
        rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
        GPUAAS_SLURM_ROLE=munged munged --force --key-file="$key" --socket="$MUNGE_SOCK" \
            --pid-file="$D/run/munged.pid" --log-file="$D/log/munged.log" --seed-file="$D/munge/munged.seed" \
            || die "munged did not start: $(tail -n 3 "$D/log/munged.log" 2>/dev/null)"
    fi
    munge -n -S "$MUNGE_SOCK" | unmunge -S "$MUNGE_SOCK" >/dev/null 2>&1 || die "munge round trip failed on $MUNGE_SOCK"
    echo "MUNGE_VERSION=$(munged --version 2>&1 | awk '{print $1}' | sed 's/^munge-//' | head -n 1)"
}

mariadb_up() {  # needs DB_PORT DB_PASS
    if [ ! -d "$D/db/mysql" ]; then
        rm -rf "$D/db"
        mariadb-install-db --no-defaults --datadir="$D/db" --auth-root-authentication-method=normal \
            --skip-test-db --user=root >"$D/log/mariadb-install.log" 2>&1 \
            || die "mariadb-install-db failed: $(tail -n 3 "$D/log/mariadb-install.log")"
    fi
    if ! alive "$D/run/mariadbd.pid"; then
        (GPUAAS_SLURM_ROLE=mariadbd setsid mariadbd --no-defaults --user=root --datadir="$D/db" \
            --socket="$D/run/mysql.sock" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
            --pid-file="$D/run/mariadbd.pid" --log-error="$D/log/mariadbd.log" \
            --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &)
    fi
    local i
    for i in $(seq 150); do mariadb --no-defaults -S "$D/run/mysql.sock" -uroot -e 'select 1' >/dev/null 2>&1 && break; sleep 0.2; done
    mariadb --no-defaults -S "$D/run/mysql.sock" -uroot -e \
        "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS'; ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS'; CREATE DATABASE IF NOT EXISTS slurm_acct_db; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" \
        || die "MariaDB did not come up: $(tail -n 3 "$D/log/mariadbd.log" 2>/dev/null)"
    echo "MARIADB_VERSION=$(mariadb --no-defaults -S "$D/run/mysql.sock" -uroot -N -e 'select version()')"
}

slurmdbd_up() {  # needs SLURMDBD_CONF_B64 DBD_PORT
    write_file "$D/etc/slurmdbd.conf" 600 "$SLURMDBD_CONF_B64"
    if ! alive "$D/run/slurmdbd.pid"; then
        # slurmdbd reads slurmdbd.conf from the directory of $SLURM_CONF
        GPUAAS_SLURM_ROLE=slurmdbd slurmdbd || die "slurmdbd did not start: $(tail -n 3 "$D/log/slurmdbd.log" 2>/dev/null)"
    fi
    wait_port "$DBD_PORT" 30 || die "slurmdbd does not listen on $DBD_PORT: $(tail -n 3 "$D/log/slurmdbd.log" 2>/dev/null)"
}

# accounting: the cluster, the account and the users' associations exist before the first job
# (AccountingStorageEnforce=associations), so sbatch never answers InvalidAccount.
accounting() {  # needs CLUSTER_NAME ACCOUNT SLURM_USERS
    local u
    sacctmgr -i -Q add cluster "$CLUSTER_NAME" >/dev/null 2>&1
    sacctmgr -i -Q add account "$ACCOUNT" Cluster="$CLUSTER_NAME" Description="GPUaaS project" Organization=gpuaas >/dev/null 2>&1
    for u in $SLURM_USERS; do
        sacctmgr -i -Q add user "$u" Account="$ACCOUNT" DefaultAccount="$ACCOUNT" Cluster="$CLUSTER_NAME" >/dev/null 2>&1
        [ -n "$(sacctmgr -n -P show assoc where cluster="$CLUSTER_NAME" account="$ACCOUNT" user="$u" format=user)" ] \
            || die "association $u/$ACCOUNT on $CLUSTER_NAME missing after sacctmgr add"
    done
    echo "ACCOUNTING=ok"
}

slurm_conf() {  # needs SLURM_CONF_B64
    layout
    write_file "$SLURM_CONF" 644 "$SLURM_CONF_B64"
}

ctld_up() {  # needs SLURM_CONF_B64 CTLD_PORT RESTART
    slurm_conf
    if [ "${RESTART:-0}" = 1 ]; then stop_pidfile "$D/run/slurmctld.pid"; fi
    if ! alive "$D/run/slurmctld.pid"; then
        GPUAAS_SLURM_ROLE=slurmctld slurmctld -f "$SLURM_CONF" || die "slurmctld did not start: $(tail -n 5 "$D/log/slurmctld.log")"
    fi
    local i
    for i in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.2; done
    scontrol ping 2>/dev/null | grep -q 'is UP' || die "slurmctld is not UP: $(tail -n 5 "$D/log/slurmctld.log")"
    scontrol reconfigure >/dev/null 2>&1 || true  # slurmds re-register at once after a restart
    echo "SLURM_VERSION=$(scontrol show config | awk -F'= ' '/^SLURM_VERSION/ {print $2}')"
}

reconfigure() { scontrol reconfigure >/dev/null 2>&1 || die "scontrol reconfigure failed"; echo "RECONFIGURED=1"; }

slurmd_up() {  # needs SLURM_CONF_B64 NODE NODE_PORT
    slurm_conf
    mkdir -p "$D/spool/$NODE"
    if ! alive "$D/run/slurmd-$NODE.pid"; then
        GPUAAS_SLURM_ROLE="slurmd:$NODE" slurmd -f "$SLURM_CONF" -N "$NODE" \
            || die "slurmd $NODE did not start: $(tail -n 5 "$D/log/slurmd-$NODE.log" 2>/dev/null)"
    fi
    wait_port "$NODE_PORT" 20 || die "slurmd $NODE does not listen on $NODE_PORT: $(tail -n 5 "$D/log/slurmd-$NODE.log" 2>/dev/null)"
    echo "SLURMD_VERSION=$(slurmd -V | awk '{print $2}')"
}

node_state() {  # needs NODE; run where slurmctld runs
    echo "STATE=$(sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n 1)"
    echo "VERSION=$(scontrol show node "$NODE" 2>/dev/null | grep -o 'Version=[^ ]*' | cut -d= -f2)"
}

drain_node() {  # needs NODE REASON
    scontrol update NodeName="$NODE" State=DRAIN Reason="$REASON" || die "scontrol could not drain $NODE"
    node_state
}

resume_node() {  # needs NODE
    scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
    node_state
}

health() {
    echo "PING=$(scontrol ping 2>&1 | tr '\n' ' ')"
    echo "NODES=$(sinfo -h -N -o '%N:%T' 2>/dev/null | sort -u | tr '\n' ' ')"
    echo "SLURM_VERSION=$(scontrol show config 2>/dev/null | awk -F'= ' '/^SLURM_VERSION/ {print $2}')"
    echo "DBD=$(sacctmgr -n -P show cluster format=cluster 2>/dev/null | tr '\n' ' ')"
}

read_cluster() { [ -f "$D/cluster.json" ] && echo "CLUSTER_JSON=$(base64 -w0 <"$D/cluster.json")"; echo "READ=1"; }

# cas_cluster: replace cluster.json only if it still has the content the controller read (EXPECTED_SHA).
cas_cluster() {  # needs EXPECTED_SHA CLUSTER_JSON_B64
    layout
    exec 9>"$D/cluster.lock"
    flock 9
    local now=""
    [ -f "$D/cluster.json" ] && now=$(sha256sum <"$D/cluster.json" | awk '{print $1}')
    [ "$now" = "$EXPECTED_SHA" ] || { echo "CAS=conflict"; return 0; }
    write_file "$D/cluster.json" 600 "$CLUSTER_JSON_B64"
    echo "CAS=ok"
}

read_munge_key() { [ -f "$D/munge/munge.key" ] && echo "MUNGE_KEY_B64=$(base64 -w0 <"$D/munge/munge.key")"; echo "READ=1"; }

# teardown ROLE [NODE] [PORTS]: stop what this member started, wipe its files, then CHECK.
teardown() {  # needs ROLE (controller|worker) NODE; PORTS (comma list) read from the local config if unset
    if [ -z "${PORTS:-}" ]; then
        if [ "$ROLE" = controller ]; then
            PORTS=$(cat "$SLURM_CONF" "$D/etc/slurmdbd.conf" 2>/dev/null | grep -E '^(SlurmctldPort|DbdPort|StoragePort)=' | cut -d= -f2 | paste -sd, -)
        else
            PORTS=$(grep "^NodeName=$NODE " "$SLURM_CONF" 2>/dev/null | grep -o ' Port=[0-9]*' | cut -d= -f2)
        fi
    fi
    if [ "$ROLE" = controller ]; then
        stop_pidfile "$D/run/slurmctld.pid"
        stop_pidfile "$D/run/slurmdbd.pid"
        stop_pidfile "$D/run/mariadbd.pid"
        rm -rf "$D/db" "$D/state" "$D/etc/slurmdbd.conf" "$D/cluster.json" "$D/cluster.lock" "$D"/log/slurmctld.log "$D"/log/slurmdbd.log "$D"/log/mariadb*.log
        touch "$D/.controller-gone" 2>/dev/null || true
    else
        stop_pidfile "$D/run/slurmd-$NODE.pid"
        rm -rf "$D/spool/$NODE" "$D/log/slurmd-$NODE.log"
    fi
    local others=0 p
    for p in "$D"/run/slurmd-*.pid "$D/run/slurmctld.pid"; do alive "$p" && others=1; done
    if [ "$others" = 0 ] && { [ "$ROLE" = controller ] || [ ! -f "$D/etc/slurmdbd.conf" ]; }; then
        stop_pidfile "$D/run/munged.pid"
        rm -rf "$D"
        rmdir "$ROOT/$ALLOC_KEY" 2>/dev/null || true
    fi
    verify_gone
}

verify_gone() {  # needs ROLE NODE PORTS: prints TEARDOWN_VERIFIED=1|0 and EVIDENCE=...
    python3 - "$D" "$ROLE" "${NODE:-}" "${PORTS:-}" <<'PY'
import os, socket, sys
d, role, node, ports = sys.argv[1], sys.argv[2], sys.argv[3], [int(p) for p in sys.argv[4].split(",") if p]
mine = {"controller": {"slurmctld", "slurmdbd", "mariadbd"}, "worker": {f"slurmd:{node}"}}[role]
left, everything = [], []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0") if "=" in kv)
        if env.get("GPUAAS_SLURM_DIR") != d or "GPUAAS_SLURM_ROLE" not in env:
            continue
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        continue
    if state == "Z":
        continue
    everything.append(f"{env['GPUAAS_SLURM_ROLE']}({pid})")
    if env["GPUAAS_SLURM_ROLE"] in mine:
        left.append(everything[-1])
busy = []
for port in ports:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
    except OSError:
        busy.append(port)
    finally:
        s.close()
dir_gone = not os.path.exists(d)
if dir_gone and everything:
    left += [p for p in everything if p not in left]
ok = not left and not busy
ev = [f"{role} {node}".strip() + ": " + ("no slurm/munge/mariadb process of it left" if not left else "still running: " + " ".join(left)),
      ("ports free: " + ",".join(map(str, ports))) if not busy else "ports still bound: " + ",".join(map(str, busy)),
      (f"{d} removed" if dir_gone else f"{d} kept (other members of this allocation still use munged: {' '.join(everything) or 'none'})")]
print("TEARDOWN_VERIFIED=" + ("1" if ok else "0"))
print("EVIDENCE=" + "; ".join(ev))
PY
}

jobs_done() {  # completed jobs of the last day (the app usage the controller reports, one request per job)
    local since
    since=$(date -d '1 day ago' +%Y-%m-%dT%H:%M:%S)
    echo "JOBS=$(sacct -n -X -P -a -S "$since" -E now -o JobID,State 2>&1 | awk -F'|' '$2 == "COMPLETED" {print $1}' | tr '\n' ' ')"
}
