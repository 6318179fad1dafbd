"""Several nodes on one machine: network, UTS, mount and PID namespaces joined by shaped links.

A :class:`Cluster` of N nodes is what a multi-node job sees -- each node its own host name, its
own ``/etc/hosts``, its own ``/dev/shm``, its own network stack -- built on one Linux machine, so
the test suite and the benchmarks can run real ``torchrun --nnodes N`` jobs::

    from vcga.testing.multinode import Cluster

    with Cluster(nodes=2, rate="1gbit") as cluster:          # needs root
        launch = cluster.torchrun(["train.py"], nproc_per_node=2,
                                  node_env=[{"VCGA_BACKEND": "sim-nccl"}, {"VCGA_BACKEND": "sim-hccl"}])
        results = launch.wait(timeout=120)                    # one NodeResult per node
        assert all(r.returncode == 0 for r in results)

How (docs/multinode.md has the picture and the reasons):

- **A node** is one process, PID 1 of new network, UTS, mount and PID namespaces (``unshare``),
  that sets the host name (``node0``, ``node1``, ...), mounts a private tmpfs on ``/dev/shm`` and
  a private ``/etc/hosts`` naming every node (torchrun's c10d rendezvous resolves host names),
  remounts ``/sys`` for its own interfaces, and then only reaps orphans. Commands enter all four
  namespaces with ``nsenter``. Nothing is named on the host: no ``ip netns add``, no interface in
  the host's network namespace, no file outside a temporary log directory.
- **Links**: network *k* gives every node an interface ``eth<k>`` with address ``198.18.<k>.<i+1>/24``
  (198.18.0.0/15 is reserved for benchmarking, RFC 2544, and used only inside these namespaces).
  Two nodes: one veth pair. More: a Linux bridge in a switch namespace and a veth pair per node.
  ``rate`` shapes every link with ``tc tbf`` at both ends (each end shapes only what it sends),
  with a bucket of ``bucket_s`` at the rate (1 ms unless given).
- **Cleanup** is the kernel's: killing a node's PID 1 ends every process in its PID namespace, the
  network namespace goes with its last process and takes its interfaces (and their veth peers)
  along, the mounts go with the mount namespace. :meth:`Cluster.close` (also on an exception or
  ``KeyboardInterrupt`` through ``with``) does that and waits for it; if the Python process itself
  is killed, each node's holder was started under ``setpriv --pdeathsig KILL`` and ``unshare
  --kill-child``, so the nodes die with it. Because nothing is named on the host, a crashed run
  cannot collide with the next one. :meth:`Cluster.remaining` lists anything of a closed cluster
  that still exists (tests assert it is empty).

Needs root (``CAP_SYS_ADMIN``, ``CAP_NET_ADMIN``) and the ``ip``, ``tc``, ``unshare``, ``nsenter``
and ``setpriv`` tools; where that is missing or the kernel refuses a step, :class:`NodesUnavailable`
says which (tests skip with that reason). The nodes' holders are children of the thread that made
the cluster (``PR_SET_PDEATHSIG`` is per thread): make it in a thread that outlives it.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Cluster", "Node", "Launch", "NodeResult", "NodesUnavailable", "parse_rate", "tbf_burst", "BUCKET_S"]

#: The tools the harness runs (all from iproute2 and util-linux).
TOOLS = ("ip", "tc", "unshare", "nsenter", "setpriv")
#: tbf's queue limit expressed as time: a queue long enough (12.5 MB at 1 Gbit/s) that the shaped
#: link drops no packets under the bridge's streams, so TCP runs at the rate instead of backing off.
TBF_LATENCY = "100ms"
#: The port of the c10d rendezvous on node 0 (every node has its own network stack: always free).
RDZV_PORT = 29400

# PID 1 of a node: reap orphans (a process whose parent died is re-parented to it) forever.
_REAPER = ("import os, time\n"
           "while True:\n"
           "    try:\n"
           "        os.wait()\n"
           "    except ChildProcessError:\n"
           "        time.sleep(0.5)\n")

# Run by a node's PID 1 inside its new namespaces, before it becomes the reaper. Every step that the
# kernel may refuse runs under `set -e`, so the first refusal is what NodesUnavailable reports.
_NODE_SETUP = r"""set -e
if [ -n "$VCGA_NODE_HOSTNAME" ]; then
  hostname "$VCGA_NODE_HOSTNAME"
  mount -t tmpfs -o "size=$VCGA_NODE_SHM,mode=1777" vcga-node-shm /dev/shm
  mount -t sysfs vcga-node-sys /sys
  printf '%s' "$VCGA_NODE_HOSTS" > /dev/shm/.hosts
  mount --bind /dev/shm/.hosts /etc/hosts
  rm /dev/shm/.hosts
fi
ip link set lo up
echo ready
exec "$VCGA_NODE_PYTHON" -c "$VCGA_NODE_REAPER"
"""


class NodesUnavailable(RuntimeError):
    """This machine cannot build nodes here (not root, a tool missing, the kernel refused a step).

    :param reason: what was missing or refused, with the command's own message."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"cannot build namespace nodes on this machine: {reason}")


@dataclass(frozen=True)
class NodeResult:
    """How one node's part of a :meth:`Cluster.torchrun` launch ended."""

    node: int
    #: torchrun's exit status; None when the launch was killed at its timeout.
    returncode: int | None
    #: torchrun's stdout and stderr together (its workers' output included).
    output: str


def parse_rate(rate: str | float) -> float:
    """A link rate in bits per second from a number or tc's notation (``"1gbit"``, ``"100mbit"``)."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        if rate <= 0:
            raise ValueError(f"link rate must be > 0 bits/s, got {rate!r}")
        return float(rate)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)bit\s*", str(rate).lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r}: give bits/s as a number or like '1gbit', '100mbit', '10gbit'")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]


#: tbf's bucket as time at the link's rate, by default (see :func:`tbf_burst`).
BUCKET_S = 0.001


def tbf_burst(rate_bps: float, bucket_s: float = BUCKET_S) -> int:
    """tbf's bucket in bytes: ``bucket_s`` at the rate, at least 64 KiB (one GSO segment).

    A real link never sends faster than its rate; what the bucket holds leaves at the veth's speed.
    The default, 1 ms, keeps that burst small (tbf's watchdog is an hrtimer, so a bucket this small
    still reaches the rate). A larger one stands for switch buffers, cloud rate limits with burst
    allowances and links shared with other jobs: with 8 ms at 1 Gbit/s (tc's ``burst 1mb``) a
    2 MiB transfer looks twice as fast as the link (measured), which is what a measurement of the
    link at such sizes meets there (the bridge's calibration detects it, docs/bridge.md)."""
    if not bucket_s > 0:
        raise ValueError(f"a tbf bucket of {bucket_s!r} s: give a time > 0 (0.001 is 1 ms at the link's rate)")
    return max(64 * 1024, int(rate_bps / 8 * bucket_s))


class _Holder:
    """One process that is PID 1 of new namespaces; its host PID is the handle to enter them."""

    def __init__(self, hostname: str | None, hosts: str, shm_size: str, timeout: float) -> None:
        env = dict(os.environ, VCGA_NODE_HOSTNAME=hostname or "", VCGA_NODE_HOSTS=hosts, VCGA_NODE_SHM=shm_size,
                   VCGA_NODE_PYTHON=sys.executable, VCGA_NODE_REAPER=_REAPER)
        argv = ["setpriv", "--pdeathsig", "KILL",
                "unshare", "--net", "--uts", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
                "--propagation", "private", "sh", "-c", _NODE_SETUP]
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.pid = 0
        line = b""
        out = self.proc.stdout
        assert out is not None  # stdout=PIPE
        ready, _, _ = select.select([out], [], [], timeout)
        if ready:
            line = out.readline()
        if line.strip() != b"ready":
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            msg = err.decode(errors="replace").strip() or ("no answer" if not ready else "exited")
            raise NodesUnavailable(f"making a node's namespaces failed: {msg} "
                                   f"(`unshare --net --uts --mount --pid` and mounts need root, CAP_SYS_ADMIN)")
        self.pid = _only_child(self.proc.pid)
        out.close()
        self.pid_ns = os.stat(f"/proc/{self.pid}/ns/pid").st_ino
        self.net_ns = os.stat(f"/proc/{self.pid}/ns/net").st_ino

    def enter(self, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """``argv`` run inside all the namespaces of this holder."""
        return ["nsenter", "--target", str(self.pid), "--net", "--uts", "--mount", "--pid",
                f"--wd={cwd or os.getcwd()}", "--", *argv]

    def sh(self, argv: Sequence[str], timeout: float = 30.0) -> str:
        """Run a setup command inside; a refusal raises :class:`NodesUnavailable` with its message."""
        cmd = ["nsenter", "--target", str(self.pid), "--net", "--", *argv]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise NodesUnavailable(f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.returncode}")
        return r.stdout

    def wait_up(self, dev: str, timeout: float = 10.0) -> None:
        """Wait until ``dev`` carries traffic: the kernel reports a veth's carrier asynchronously
        (linkwatch, up to a second after ``ip link set up``); a connect before that fails."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.sh(["ip", "-o", "link", "show", "dev", dev])
            if "state UP" in state or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if "state UP" not in state:
            raise NodesUnavailable(f"link {dev} did not come up within {timeout:g} s: {state.strip()}")

    def kill(self) -> None:
        """End every process in the namespaces (killing PID 1 of a PID namespace kills them all)."""
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()


def _only_child(pid: int) -> int:
    """The host PID of the one child of ``pid`` (unshare's forked PID 1)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(int(p.name)) == pid]
    if len(kids) != 1:
        raise NodesUnavailable(f"unshare (pid {pid}) has {len(kids)} children, expected its one PID 1")
    return int(kids[0])


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _processes_in(pid_ns: set[int], net_ns: set[int]) -> list[int]:
    """Host PIDs of every process in one of these PID namespaces or holding one of these network
    namespaces (a process could keep a network namespace, and with it the links, alive)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if os.stat(p / "ns/pid").st_ino in pid_ns or os.stat(p / "ns/net").st_ino in net_ns:
                out.append(int(p.name))
        except OSError:
            continue  # gone meanwhile
    return out


class Node:
    """One node of a :class:`Cluster`: run commands in it, read its interfaces, fail its links."""

    def __init__(self, cluster: Cluster, index: int, holder: _Holder) -> None:
        self.cluster, self.index, self._holder = cluster, index, holder
        self.hostname = cluster.hostname(index)

    @property
    def pid(self) -> int:
        """The host PID of the node's PID 1 (``nsenter --target`` it to enter the node)."""
        return self._holder.pid

    def address(self, network: int = 0) -> str:
        """This node's IPv4 address on ``network``."""
        return self.cluster.address(self.index, network)

    def interface(self, network: int = 0) -> str:
        """The name of this node's interface on ``network`` (``eth<network>``)."""
        self.cluster._check_network(network)
        return f"eth{network}"

    def command(self, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """The host command line that runs ``argv`` inside this node (for ``subprocess`` yourself)."""
        return self._holder.enter(argv, cwd)

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
              **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` inside this node (``env`` replaces the environment when given)."""
        return subprocess.Popen(self.command(argv, cwd), env=None if env is None else dict(env),
                                stdin=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]

    def run(self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this node to its end (output captured as text)."""
        return subprocess.run(self.command(argv, cwd), env=None if env is None else dict(env), timeout=timeout,
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)

    def set_link(self, up: bool, network: int = 0) -> None:
        """``ip link set eth<network> down`` (or up) on this node: the node's link fails as a cable
        pulled at its end would (the peer sees no carrier; packets are dropped, nothing is reset)."""
        self._holder.sh(["ip", "link", "set", self.interface(network), "up" if up else "down"])
        if up:
            self._holder.wait_up(self.interface(network))

    def interface_bytes(self, network: int = 0) -> tuple[int, int]:
        """(received, sent) bytes of this node's interface on ``network`` so far (``/proc/<pid>/net/dev``
        shows the network namespace of that process)."""
        name = self.interface(network)
        for line in Path(f"/proc/{self.pid}/net/dev").read_text().splitlines():
            head, _, rest = line.partition(":")
            if head.strip() == name:
                f = rest.split()
                return int(f[0]), int(f[8])
        raise LookupError(f"node {self.index} has no interface {name}")

    def processes(self) -> list[int]:
        """Host PIDs of every process on this node except its PID 1."""
        return [p for p in _processes_in({self._holder.pid_ns}, set()) if p != self.pid]

    def kill_processes(self) -> None:
        """SIGKILL every process on this node but its PID 1 (the node and its links stay up): a crash
        of everything the job ran there."""
        for p in self.processes():
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def shm_entries(self) -> list[str]:
        """The names in this node's own ``/dev/shm``."""
        return sorted(os.listdir(f"/proc/{self.pid}/root/dev/shm"))


class Launch:
    """A command running on every node (see :meth:`Cluster.torchrun`); :meth:`wait` for the results."""

    def __init__(self, cluster: Cluster, procs: list[subprocess.Popen], logs: list[Path]) -> None:
        self.cluster, self._procs, self._logs = cluster, procs, logs

    def poll(self) -> list[int | None]:
        """Each node's exit status so far (None: still running)."""
        return [p.poll() for p in self._procs]

    def wait(self, timeout: float) -> list[NodeResult]:
        """Wait up to ``timeout`` seconds for every node; a node still running then has every process
        on it killed and returncode None. Never raises for a failed node: check the results."""
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for i, p in enumerate(self._procs):
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.cluster.nodes[i].kill_processes()
                p.wait(timeout=30)
                codes.append(None)
        return [NodeResult(i, c, self._logs[i].read_text(errors="replace")) for i, c in enumerate(codes)]

    def kill(self) -> None:
        """Kill every process on the nodes of this launch and wait for the launch to end."""
        for i, p in enumerate(self._procs):
            if p.poll() is None:
                self.cluster.nodes[i].kill_processes()
        for p in self._procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


class Cluster:
    """N nodes on this machine (module docstring). Use as a context manager, or call :meth:`close`.

    :param nodes: how many nodes (>= 2).
    :param rate: shaping of the links between nodes: one rate for every network, or one per network
        (bits/s, or tc notation like ``"1gbit"``); None leaves a link at the veth's own speed.
    :param networks: how many separate networks join the nodes; network *k* is interface ``eth<k>``
        on every node (two let a test prove which interface carries the traffic).
    :param shm_size: the size of each node's own ``/dev/shm`` (tmpfs notation).
    :param bucket_s: tbf's bucket on every shaped link, as seconds at its rate (:func:`tbf_burst`;
        default 1 ms; 0.008 is tc's ``burst 1mb`` at 1 Gbit/s).
    :param setup_timeout: seconds allowed for each node's namespaces to come up.
    :raises NodesUnavailable: the machine cannot build nodes (what was refused, verbatim).
    """

    def __init__(self, nodes: int = 2, *, rate: str | float | Sequence[str | float | None] | None = None,
                 networks: int = 1, shm_size: str = "1g", bucket_s: float = BUCKET_S,
                 setup_timeout: float = 30.0) -> None:
        if nodes < 2 or nodes > 250:
            raise ValueError(f"a cluster has 2..250 nodes, not {nodes}")
        if networks < 1 or networks > 200:
            raise ValueError(f"a cluster has 1..200 networks, not {networks}")
        rates = [rate] * networks if rate is None or isinstance(rate, (str, int, float)) else list(rate)
        if len(rates) != networks:
            raise ValueError(f"{len(rates)} rates for {networks} networks")
        self.size, self.networks = nodes, networks
        #: Link rate of each network in bits/s (None: unshaped).
        self.rates: list[float | None] = [None if r is None else parse_rate(r) for r in rates]
        #: tbf's bucket on every shaped link, in seconds at its rate (bytes: :func:`tbf_burst`).
        self.bucket_s = bucket_s
        for r in self.rates:
            if r is not None:
                tbf_burst(r, bucket_s)  # a bad bucket fails here, before anything is built
        self.run_id = f"vcga-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.nodes: list[Node] = []
        self._holders: list[_Holder] = []
        self._launches: list[Launch] = []
        self._pid_ns: set[int] = set()
        self._net_ns: set[int] = set()
        self._closed = False
        _sweep_stale_logs()
        self._logdir = Path(tempfile.mkdtemp(prefix=f"vcga-multinode-{os.getpid()}-"))
        try:
            _require_tools()
            hosts = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n" + "".join(
                f"{self.address(i)}\t{self.hostname(i)}\n" for i in range(nodes))
            for i in range(nodes):
                self._hold(_Holder(self.hostname(i), hosts, shm_size, setup_timeout))
                self.nodes.append(Node(self, i, self._holders[-1]))
            switch = self._hold(_Holder(None, "", "0", setup_timeout)) if nodes > 2 else None
            for k in range(networks):
                self._wire(k, switch)
        except BaseException:
            self.close()
            raise

    # --- naming ------------------------------------------------------------------------------------

    def hostname(self, index: int) -> str:
        """Node ``index``'s host name: ``node<i>``, zero-padded so that names sort as indices do
        (torchrun's c10d rendezvous numbers nodes in the order of their names)."""
        return f"node{index:0{len(str(self.size - 1))}d}"

    def address(self, index: int, network: int = 0) -> str:
        """Node ``index``'s address on ``network``: ``198.18.<network>.<index+1>``."""
        self._check_network(network)
        if not 0 <= index < self.size:
            raise IndexError(f"no node {index} in a cluster of {self.size}")
        return f"198.18.{network}.{index + 1}"

    def _check_network(self, network: int) -> None:
        if not 0 <= network < self.networks:
            raise IndexError(f"no network {network} in a cluster with {self.networks}")

    # --- building ------------------------------------------------------------------------------------

    def _hold(self, h: _Holder) -> _Holder:
        self._holders.append(h)
        self._pid_ns.add(h.pid_ns)
        self._net_ns.add(h.net_ns)
        return h

    def _wire(self, k: int, switch: _Holder | None) -> None:
        """Network ``k``: a veth pair between two nodes, or one per node to a bridge in ``switch``."""
        ends: list[tuple[_Holder, str]] = []  # (holder, interface) of every link end, to shape
        if switch is None:
            a, b = self._holders[0], self._holders[1]
            a.sh(["ip", "link", "add", f"eth{k}", "type", "veth", "peer", "name", f"eth{k}", "netns", str(b.pid)])
            ends += [(a, f"eth{k}"), (b, f"eth{k}")]
        else:
            switch.sh(["ip", "link", "add", f"br{k}", "type", "bridge"])
            switch.sh(["ip", "link", "set", f"br{k}", "up"])
            for i, node in enumerate(self.nodes):
                port = f"p{k}n{i}"
                switch.sh(["ip", "link", "add", port, "type", "veth", "peer", "name", f"eth{k}",
                           "netns", str(node.pid)])
                switch.sh(["ip", "link", "set", port, "master", f"br{k}"])
                switch.sh(["ip", "link", "set", port, "up"])
                ends += [(switch, port), (self._holders[i], f"eth{k}")]
        for i in range(self.size):
            h = self._holders[i]
            h.sh(["ip", "addr", "add", f"{self.address(i, k)}/24", "dev", f"eth{k}"])
            h.sh(["ip", "link", "set", f"eth{k}", "up"])
        rate = self.rates[k]
        if rate is not None:
            for h, dev in ends:
                h.sh(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate)}bit",
                      "burst", str(tbf_burst(rate, self.bucket_s)), "latency", TBF_LATENCY])
        for h, dev in ends:
            h.wait_up(dev)

    # --- running --------------------------------------------------------------------------------------

    def torchrun(self, argv: Sequence[str], nproc_per_node: int, *, env: Mapping[str, str] | None = None,
                 node_env: Sequence[Mapping[str, str]] | None = None, cwd: str | None = None,
                 torchrun_args: Sequence[str] = (),
                 launcher: Sequence[str] = ("-m", "torch.distributed.run")) -> Launch:
        """Start ``torchrun --nnodes N --nproc-per-node k --rdzv-backend c10d`` with its rendezvous on
        node 0's address on every node. Node *i*'s workers are global ranks
        ``i*k .. i*k + k-1`` (the rendezvous orders nodes by host name, :meth:`hostname`).

        :param argv: the script and its arguments (or ``["-m", "module", ...]``), as after ``torchrun``.
        :param env: the environment of every node (default: this process's); ``node_env[i]`` adds to
            it on node *i* (e.g. ``VCGA_BACKEND`` per node, as each node of a mixed cluster has its
            own vendor).
        :param torchrun_args: more torchrun options (e.g. ``["--rdzv-conf", "join_timeout=60"]``).
        :param launcher: what the node's Python runs with torchrun's options: torchrun itself, or a
            script that takes the same command line (a test's agent that forks its workers, say).
        :returns: a :class:`Launch`; :meth:`Launch.wait` gives each node's result.
        """
        if node_env is not None and len(node_env) != self.size:
            raise ValueError(f"node_env has {len(node_env)} entries for {self.size} nodes")
        n = len(self._launches)
        procs, logs = [], []
        try:
            # torchrun's own log folder in the cluster's (removed with it), not a torchelastic_* folder
            # in the temporary directory that torchrun makes for every launch and never removes
            own_logs = any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in torchrun_args)
            for node in self.nodes:
                e = dict(os.environ if env is None else env)
                e.update(node_env[node.index] if node_env else {})
                log_dir = [] if own_logs else ["--log-dir", str(self._logdir / f"launch{n}-node{node.index}-torchrun")]
                cmd = [sys.executable, *launcher, "--nnodes", str(self.size),
                       "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"{self.address(0)}:{RDZV_PORT}", "--rdzv-id", f"{self.run_id}-{n}",
                       "--max-restarts", "0", *log_dir, *torchrun_args, *argv]
                log = self._logdir / f"launch{n}-node{node.index}.log"
                with open(log, "wb") as out:
                    procs.append(node.popen(cmd, env=e, cwd=cwd, stdout=out, stderr=subprocess.STDOUT))
                logs.append(log)
        except BaseException:
            for node in self.nodes:
                node.kill_processes()
            raise
        launch = Launch(self, procs, logs)
        self._launches.append(launch)
        return launch

    # --- ending --------------------------------------------------------------------------------------

    def close(self) -> None:
        """End every process on every node, remove every namespace, link and mount this cluster made,
        and its log directory. Idempotent; safe on a half-built cluster."""
        if self._closed:
            return
        self._closed = True
        for h in reversed(self._holders):
            h.kill()
        for launch in self._launches:
            for p in launch._procs:  # nsenter ends as soon as its child (in a killed node) is gone
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
        # A killed PID 1 takes its namespace's processes with it; wait until the kernel has.
        deadline = time.monotonic() + 30
        while _processes_in(self._pid_ns, self._net_ns) and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(self._logdir, ignore_errors=True)

    def remaining(self) -> list[str]:
        """What of this cluster still exists: processes in its namespaces, its log directory.
        Empty after :meth:`close` (what the cleanup tests assert)."""
        left = [f"process {p} ({_cmdline(p)})" for p in _processes_in(self._pid_ns, self._net_ns)]
        if self._logdir.exists():
            left.append(f"log directory {self._logdir}")
        return left

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "gone"


def _require_tools() -> None:
    if os.geteuid() != 0:
        raise NodesUnavailable("needs root (network, mount and PID namespaces; tc)")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise NodesUnavailable(f"missing tools: {', '.join(missing)} (iproute2 and util-linux)")


def _sweep_stale_logs() -> None:
    """Remove log directories of earlier runs whose process no longer exists (a run killed before
    its :meth:`Cluster.close`); everything else such a run made died with it."""
    for d in Path(tempfile.gettempdir()).glob("vcga-multinode-*-*"):
        m = re.fullmatch(r"vcga-multinode-(\d+)-.*", d.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            shutil.rmtree(d, ignore_errors=True)
