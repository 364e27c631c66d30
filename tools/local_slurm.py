"""A real SLURM on this one machine: one controller and two compute nodes (n1, n2), each a
`slurmd` on its own port, all on 127.0.0.1. What the tests submit the project's sbatch
scripts to, and what a user can try them on before a cluster.

    python tools/local_slurm.py up STATE_DIR      # install (root, Debian) if absent; start; print SLURM_CONF
    python tools/local_slurm.py down STATE_DIR    # cancel every job, stop the daemons by their PIDs
    python tools/local_slurm.py status STATE_DIR

Then `SLURM_CONF=STATE_DIR/slurm.conf sbatch ...`. The cluster has two partitions: `low`
(the default; preemptible with a GraceTime, PreemptMode=REQUEUE) and `high` (a job there
preempts a `low` one). No cgroups (proctrack/linuxproc), no accounting database: each
job's end state and exit code go to STATE_DIR/jobcomp.txt (jobcomp/filetxt). Ports are
free ones chosen at `up`, so two clusters (two checkouts' test runs) can share a machine.
Measured facts about this setup: ../shared/NOTES.md ("A real SLURM on one machine").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ["slurm-wlm", "munge", "slurm-client"]  # Debian's (bookworm: SLURM 22.05)
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch")
NODES = ("n1", "n2")
#: Seconds a preempted job may run on after SIGTERM before SLURM requeues it by force.
GRACE_TIME_S = 60
#: Seconds between a job's SIGTERM and its SIGKILL (scancel, scontrol requeue).
KILL_WAIT_S = 30
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
UP_TIMEOUT_S = 60


class Unavailable(RuntimeError):
    """SLURM cannot be had on this machine (the one line says why)."""


def missing() -> list[str]:
    return [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]


def install() -> None:
    """Debian's packages, when root and absent (~10 s with a reachable mirror)."""
    if not missing():
        return
    if os.geteuid() != 0:
        raise Unavailable(f"SLURM is not installed ({', '.join(missing())} missing) and installing needs root")
    if shutil.which("apt-get") is None:
        raise Unavailable(f"SLURM is not installed ({', '.join(missing())} missing) and there is no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                                                *PACKAGES]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise Unavailable(f"{' '.join(argv[:2])} failed (exit {done.returncode}): {tail[0]}")
    if missing():
        raise Unavailable(f"installed {' '.join(PACKAGES)} but {', '.join(missing())} still missing")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(state: Path, ports: dict[str, int]) -> str:
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
    nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[n]} CPUs={cpus} "
                      f"RealMemory={memory} State=UNKNOWN" for n in NODES)
    return f"""# Written by tools/local_slurm.py: two nodes of one machine.
ClusterName=gammatitan
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports['ctld']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool/%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={state}/jobcomp.txt
MailProg=/bin/true
ReturnToService=2
KillWait={KILL_WAIT_S}
MinJobAge=600
SchedulerType=sched/backfill
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}
PartitionName=low Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 OverSubscribe=NO GraceTime={GRACE_TIME_S} PreemptMode=REQUEUE
PartitionName=high Nodes={','.join(NODES)} MaxTime=INFINITE State=UP PriorityTier=10 OverSubscribe=NO PreemptMode=OFF
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def pids(state: Path) -> dict[str, int]:
    path = state / "pids.json"
    return json.loads(path.read_text()) if path.exists() else {}


def environment(state: Path) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}


def nodes_idle(state: Path) -> bool:
    done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=environment(state), capture_output=True,
                          text=True)
    states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
    return done.returncode == 0 and all(states.get(n, "").startswith(("idle", "mix", "alloc")) for n in NODES)


def start_munge() -> int | None:
    """munged, unless one answers already (it serves every cluster on the machine)."""
    if MUNGE_SOCKET.exists() and subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
        return None
    MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_SOCKET.parent, "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force"], check=True, capture_output=True)
    pid_file = Path("/run/munge/munged.pid")
    for _ in range(50):
        if pid_file.exists() and subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return int(pid_file.read_text().strip())
        time.sleep(0.1)
    raise Unavailable("munged did not start (see /var/log/munge/munged.log)")


def up(state: Path) -> Path:
    """Start the cluster in `state` (or find it running); its slurm.conf."""
    state = state.resolve()
    running = pids(state)
    if running and all(alive(p) for name, p in running.items() if name != "munged") and nodes_idle(state):
        return state / "slurm.conf"
    if running:
        down(state)
    install()
    if os.geteuid() != 0:
        raise Unavailable("the local SLURM runs its daemons as root; this user is not root")
    for sub in ("ctld", "spool"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    ports = {"ctld": free_port(), **{n: free_port() for n in NODES}}
    (state / "slurm.conf").write_text(config(state, ports))
    (state / "jobcomp.txt").touch()
    started = {"munged": start_munge()}
    env = environment(state)
    logs = {name: open(state / f"{name}.stderr", "ab") for name in ("slurmctld", *NODES)}
    # -D: stay in the foreground (our child, stopped by its PID); -c: no state from an earlier cluster
    started["slurmctld"] = subprocess.Popen(["slurmctld", "-D", "-c"], env=env, stdout=logs["slurmctld"],
                                            stderr=subprocess.STDOUT, start_new_session=True).pid
    for node in NODES:
        started[node] = subprocess.Popen(["slurmd", "-D", "-N", node], env=env, stdout=logs[node],
                                         stderr=subprocess.STDOUT, start_new_session=True).pid
    (state / "pids.json").write_text(json.dumps({k: v for k, v in started.items() if v is not None}))
    deadline = time.monotonic() + UP_TIMEOUT_S
    while not nodes_idle(state):
        dead = [name for name, pid in started.items() if pid is not None and not alive(pid)]
        if dead or time.monotonic() > deadline:
            why = f"{', '.join(dead)} exited" if dead else f"nodes not idle after {UP_TIMEOUT_S} s"
            down(state)
            raise Unavailable(f"the local SLURM did not come up: {why} (logs in {state})")
        time.sleep(0.3)
    return state / "slurm.conf"


def down(state: Path) -> None:
    """Cancel every job (their processes outlive slurmd), then stop the daemons by PID."""
    state = state.resolve()
    running = pids(state)
    env = environment(state)
    if running.get("slurmctld") and alive(running["slurmctld"]):
        subprocess.run(["scancel", "--full", "--signal=KILL", "--state=RUNNING", "--user", str(os.getuid())], env=env,
                       capture_output=True)
        subprocess.run(["scancel", "--user", str(os.getuid())], env=env, capture_output=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            left = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout
            if not left.strip():
                break
            time.sleep(0.5)
    for name, pid in running.items():
        if name != "munged" and alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for name, pid in running.items():
        while name != "munged" and alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if name != "munged" and alive(pid):
            os.kill(pid, signal.SIGKILL)
    (state / "pids.json").unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("state", type=Path, help="the cluster's folder (config, logs, PIDs, jobcomp.txt)")
    ns = parser.parse_args(argv)
    try:
        if ns.action == "up":
            print(f"export SLURM_CONF={up(ns.state)}")
        elif ns.action == "down":
            down(ns.state)
        else:
            running = pids(ns.state.resolve())
            print(", ".join(f"{n} {p} {'alive' if alive(p) else 'dead'}" for n, p in running.items()) or "not running")
    except Unavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
