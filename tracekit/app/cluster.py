"""`tracekit cluster`: a communication-bound cluster of N nodes emulated on one machine.

Each node is a network namespace with one veth link to a Linux bridge in the root namespace; a
token bucket (`tc ... tbf`) on both ends of that link makes the node's NIC RATE each way, while
ranks of one node talk over the namespace's own loopback, unshaped. One torchrun per node runs the
user's command (rendezvous on node 0's address), so a plain `python train.py` becomes N×R gloo
ranks whose inter-node traffic crosses a slow network, as on a real cluster.

Everything a run creates (namespaces, veths, bridge, addresses, processes) is named after a
per-run id and removed when it ends, however it ends. Needs root, iproute2 and the tbf qdisc;
netem (for `--latency`) is probed for and refused where missing rather than faked.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

from tracekit.errors import TracekitError
from tracekit.topology import Topology, tbf_params
from tracekit.units import parse_rate

RDZV_PORT = 29400  # each namespace has its own ports, so clusters never collide on it
MAX_NODES = 155  # addresses .100 to .254 of a /24, see plan_network
TEARDOWN_GRACE_S = 10.0
"""How long torchruns get to end their workers (after Ctrl-C, SIGTERM or a failed node) before all is killed."""


class ClusterError(TracekitError):
    """Raised when the cluster cannot be built: a missing prerequisite, an impossible option."""


@dataclass(frozen=True)
class Cluster(Topology):
    """An emulated cluster: its topology, and each node's link rate (and latency)."""

    link: str  # as given, e.g. "200mbit"
    latency_ms: float | None = None

    @property
    def link_bytes_per_s(self) -> float:
        return parse_rate(self.link)

    def manifest(self) -> dict:
        """The manifest's `topology` (torchrun makes global rank = node_rank * R + local_rank)."""
        return {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "link": self.link,
                "link_bytes_per_s": self.link_bytes_per_s, "latency_ms": self.latency_ms,
                "burst_bytes": tbf_params(self.link_bytes_per_s)["burst"],
                "rank_nodes": [r // self.ranks_per_node for r in range(self.world)]}


# --- prerequisites ---------------------------------------------------------------------------

def check_prerequisites(cluster: Cluster, *, is_root: Callable[[], bool] = lambda: os.geteuid() == 0) -> None:
    """One ClusterError naming what is missing: root, `ip`/`tc`, the tbf qdisc, netem for --latency."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"tracekit cluster needs iproute2: {' and '.join(missing)} not found on PATH")
    if not is_root():
        raise ClusterError("tracekit cluster needs root (it creates network namespaces, veths and a bridge); "
                           "run it as root")
    probe = f"tkprobe-{secrets.token_hex(4)}"
    _ip("netns", "add", probe)
    try:
        if not _qdisc_works(probe, "tbf", "rate", "1mbit", "burst", "64kb", "latency", "50ms"):
            raise ClusterError("tracekit cluster needs the tbf qdisc (sch_tbf) to shape links; `tc qdisc add ... tbf` "
                               "fails here")
        if cluster.latency_ms is not None and not _qdisc_works(probe, "netem", "delay", "1ms"):
            raise ClusterError(f"--latency {cluster.latency_ms:g}: needs the netem qdisc (sch_netem), which this "
                               "kernel does not have; run without --latency (links are then shaped by rate only)")
    finally:
        _ip("netns", "del", probe, check=False)


def _qdisc_works(netns: str, *qdisc: str) -> bool:
    cmd = ["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", "lo", "root", *qdisc]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def _tc(*args: str) -> None:
    proc = subprocess.run(["tc", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"`tc {' '.join(args)}` failed: {proc.stderr.strip()}")


# --- the network -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Node:
    index: int
    netns: str
    veth: str  # the end inside the namespace (GLOO_SOCKET_IFNAME)
    peer: str  # the end on the bridge
    addr: str


@dataclass(frozen=True)
class Network:
    run_id: str
    bridge: str
    subnet: ipaddress.IPv4Network
    nodes: list[Node]


def plan_network(n_nodes: int, run_id: str, used: list[ipaddress.IPv4Network]) -> Network:
    """Names and addresses for `run_id` (6 hex digits; link names stay within Linux's 15 characters),
    in the first 10.A.B.0/24 from the id on that no address or route of the host overlaps."""
    if n_nodes > MAX_NODES:
        raise ClusterError(f"--nodes {n_nodes}: at most {MAX_NODES} nodes (one /24)")
    seed = int(run_id, 16)
    for step in range(1 << 16):
        candidate = (seed + step * 40503) % (1 << 16)  # an odd stride visits every A.B
        subnet = ipaddress.IPv4Network(f"10.{candidate >> 8}.{candidate & 255}.0/24")
        if not any(subnet.overlaps(u) for u in used):
            break
    else:
        raise ClusterError("no free 10.A.B.0/24 subnet on this host")
    # torchrun's c10d rendezvous numbers nodes in the string order of their addresses: .100 to .254
    # (three digits each) keep node i = node rank i
    nodes = [Node(i, f"tkc-{run_id}-n{i}", f"tk{run_id}n{i}", f"tk{run_id}b{i}", str(subnet[100 + i]))
             for i in range(n_nodes)]
    return Network(run_id, f"tk{run_id}br", subnet, nodes)


def used_subnets() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the host's root namespace has an address in or a route to."""
    nets = []
    for line in _ip("-o", "-4", "addr", "show").stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            nets.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    for line in _ip("-4", "route", "show").stdout.splitlines():
        dest = line.split()[0]
        if dest != "default":
            nets.append(ipaddress.IPv4Network(dest, strict=False))
    return nets


def new_run_id() -> str:
    """6 hex digits no namespace or link of this host uses yet."""
    taken = _ip("netns", "list").stdout + _ip("-o", "link").stdout
    while True:
        run_id = secrets.token_hex(3)
        if run_id not in taken:
            return run_id


def build(network: Network, rate_bytes_per_s: float, say: Callable[[str], None]) -> None:
    """Create the bridge and, per node, a namespace linked to it, each link shaped both ways."""
    tbf = tbf_params(rate_bytes_per_s)
    shape = ["tbf", "rate", f"{tbf['rate']}bps", "burst", str(tbf["burst"]), "limit", str(tbf["limit"])]
    say(f"bridge {network.bridge} for {network.subnet}; each link a tbf both ways: {tbf['rate'] * 8 / 1e6:g} Mbit/s, "
        f"burst {tbf['burst'] / 1e3:g} kB, queue {tbf['limit'] / 1e3:g} kB")
    _ip("link", "add", network.bridge, "type", "bridge")
    _ip("link", "set", network.bridge, "up")
    for node in network.nodes:
        say(f"node {node.index}: namespace {node.netns}, {node.veth} {node.addr}")
        _ip("netns", "add", node.netns)
        _ip("link", "add", node.veth, "type", "veth", "peer", "name", node.peer)
        _ip("link", "set", node.veth, "netns", node.netns)
        _ip("link", "set", node.peer, "master", network.bridge, "up")
        _ip("-n", node.netns, "addr", "add", f"{node.addr}/{network.subnet.prefixlen}", "dev", node.veth)
        _ip("-n", node.netns, "link", "set", node.veth, "up")
        _ip("-n", node.netns, "link", "set", "lo", "up")
        _tc("-n", node.netns, "qdisc", "add", "dev", node.veth, "root", *shape)  # node egress
        _tc("qdisc", "add", "dev", node.peer, "root", *shape)  # node ingress
        _write_hosts(network, node)


NETNS_ETC = Path("/etc/netns")
"""`ip netns exec NS` mounts NETNS_ETC/NS/hosts over /etc/hosts: there the nodes' addresses get names,
so c10d's reverse lookups of its peers succeed instead of warning on every connection."""


def _write_hosts(network: Network, node: Node) -> None:
    try:
        host = Path("/etc/hosts").read_text()
    except OSError:
        host = "127.0.0.1 localhost\n"
    # c10d's store listens on IPv6, so it sees its peers at IPv4-mapped addresses as well
    names = "".join(f"{n.addr} {n.netns}\n::ffff:{n.addr} {n.netns}\n" for n in network.nodes)
    for _ in range(3):  # another run's teardown may remove NETNS_ETC between mkdir and write
        try:
            (NETNS_ETC / node.netns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / node.netns / "hosts").write_text(host.rstrip("\n") + "\n" + names)
            return
        except FileNotFoundError:
            continue


def teardown(network: Network) -> list[str]:
    """Kill whatever still runs in the namespaces, remove them (their veth ends go with them) and
    the bridge; what could not be removed, if anything."""
    left = []
    for node in network.nodes:
        for pid in _netns_pids(node.netns):
            _kill(pid, signal.SIGKILL)
    for node in network.nodes:
        _wait_netns_empty(node.netns)
        if _ip("netns", "del", node.netns, check=False).returncode != 0 and _netns_exists(node.netns):
            left.append(f"namespace {node.netns}")
        _ip("link", "del", node.peer, check=False)  # gone with the namespace unless it never moved there
        shutil.rmtree(NETNS_ETC / node.netns, ignore_errors=True)
    try:
        NETNS_ETC.rmdir()  # only where empty: other runs' and the host's files stay
    except OSError:
        pass
    if _ip("link", "del", network.bridge, check=False).returncode != 0 and _link_exists(network.bridge):
        left.append(f"bridge {network.bridge}")
    return left


def _netns_pids(netns: str) -> list[int]:
    proc = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _wait_netns_empty(netns: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _netns_pids(netns) and time.monotonic() < deadline:
        time.sleep(0.05)


def _netns_exists(netns: str) -> bool:
    return netns in _ip("netns", "list").stdout.split()


def _link_exists(name: str) -> bool:
    return _ip("link", "show", name, check=False).returncode == 0


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# --- the command -----------------------------------------------------------------------------

def torchrun_argv(command: list[str], cluster: Cluster, network: Network, node: Node) -> list[str]:
    """torchrun of `command` on `node`: `python X.py ...` and `python -m mod ...` in torchrun's own
    forms, anything else with --no-python. torchrun runs in the command's Python where the command
    names one by its path (another virtualenv's: a TorchRec job's), else in this one."""
    python = command[0] if _is_python(command[0]) and os.sep in command[0] else sys.executable
    argv = [python, "-m", "torch.distributed.run", "--nnodes", str(cluster.nodes), "--node-rank", str(node.index),
            "--nproc-per-node", str(cluster.ranks_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{network.nodes[0].addr}:{RDZV_PORT}", "--rdzv-id", network.run_id,
            "--local-addr", node.addr]
    if node.index == 0:
        argv += ["--rdzv-conf", "is_host=1"]  # else node 0 does not host the store (env.md §6)
    if _is_python(command[0]) and len(command) > 1 and not command[1].startswith("-"):
        return [*argv, *command[1:]]
    if _is_python(command[0]) and len(command) > 2 and command[1] == "-m":
        return [*argv, "-m", *command[2:]]
    return [*argv, "--no-python", *command]


def _is_python(program: str) -> bool:
    name = Path(program).name
    return program == sys.executable or name == "python" or name.startswith("python3")


def launch(command: list[str], cluster: Cluster, network: Network, env: dict[str, str],
           output: IO | None = None) -> list[subprocess.Popen]:
    """One torchrun per node, each in its namespace and in a process group of its own."""
    procs = []
    threads = rank_threads(cluster, env)
    for node in network.nodes:
        argv = ["ip", "netns", "exec", node.netns, *torchrun_argv(command, cluster, network, node)]
        procs.append(subprocess.Popen(argv, env={**env, "GLOO_SOCKET_IFNAME": node.veth, "OMP_NUM_THREADS": threads},
                                      start_new_session=True, stdout=output,
                                      stderr=None if output is None else subprocess.STDOUT))
    return procs


def rank_threads(cluster: Cluster, env: dict[str, str]) -> str:
    """OMP_NUM_THREADS of every rank: the user's, else this machine's cores shared out over all the
    cluster's ranks (the nodes share one machine; torchrun would give a lone rank every core)."""
    return env.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // cluster.world))


def wait(procs: list[subprocess.Popen]) -> tuple[int, bool]:
    """(exit code, interrupted): the first non-zero exit code over the nodes in the order they ended,
    0 if none; 130 after Ctrl-C or SIGTERM. Once a node fails, the others get TEARDOWN_GRACE_S to end."""
    interrupted = False
    first_failure = None
    failed_at = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            for code in codes:
                if code not in (None, 0) and first_failure is None:
                    first_failure, failed_at = code, time.monotonic()
            if all(code is not None for code in codes):
                break
            if failed_at is not None and time.monotonic() - failed_at > TEARDOWN_GRACE_S:
                _signal_all(procs, signal.SIGKILL)
            time.sleep(0.05)
    except KeyboardInterrupt:
        interrupted = True
        _stop(procs)
    if interrupted:
        return 130, True
    code = first_failure or 0
    return (128 - code if code < 0 else code), False


def _stop(procs: list[subprocess.Popen]) -> None:
    """Ctrl-C to every torchrun, which passes it on to its workers: they end as a terminal's Ctrl-C
    would end them, with their exit handlers (a recorded rank's report) run; then SIGKILL."""
    _signal_all(procs, signal.SIGINT)
    _wait_all(procs, TEARDOWN_GRACE_S)


def _signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_all(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def run(command: list[str], cluster: Cluster, *, env: dict[str, str] | None = None,
        say: Callable[[str], None] = lambda line: None, output: IO | None = None) -> tuple[int, bool]:
    """Build the cluster, run `command` on it, tear it all down; (exit code, interrupted).
    SIGTERM is handled as Ctrl-C is: the nodes are stopped and everything removed. `output`: a file
    the nodes' stdout and stderr go to (default: this process's)."""
    check_prerequisites(cluster)
    network = plan_network(cluster.nodes, new_run_id(), used_subnets())
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, _raise_interrupt)
    procs: list[subprocess.Popen] = []
    try:
        build(network, cluster.link_bytes_per_s, say)
        say(f"running {cluster.nodes} node(s) x {cluster.ranks_per_node} rank(s), links {cluster.link} each way")
        procs = launch(command, cluster, network, dict(os.environ if env is None else env), output)
        return wait(procs)
    except KeyboardInterrupt:  # during the build, or between launch and wait
        _stop(procs)
        return 130, True
    finally:
        for sig in previous:  # the teardown must not be cut short
            signal.signal(sig, signal.SIG_IGN)
        _signal_all(procs, signal.SIGKILL)
        left = teardown(network)
        say("removed the cluster" + (f", except {', '.join(left)}" if left else ""))
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_or_report(command: list[str], cluster: Cluster, *, say: Callable[[str], None],
                  env: dict[str, str] | None = None, output: IO | None = None) -> tuple[int, bool]:
    """`run`, a cluster that cannot be built said (`say`) and exiting with 2."""
    try:
        return run(command, cluster, env=env, say=say, output=output)
    except ClusterError as err:
        say(f"failed: {err}")
        return 2, False


def record(command: list[str], cluster: Cluster, run_dir: Path, *, say: Callable[[str], None],
           output: IO | None = None, **settings: Any) -> int:
    """`command` run on the cluster and recorded into `run_dir` (`tracekit cluster --record`); what
    `tracekit record` would exit with. `settings`: recording.record's (lookup_every, ...)."""
    from tracekit.app import recording

    return recording.record(command, run_dir, manifest_extra={"topology": cluster.manifest()}, output=output,
                            run=lambda env: run_or_report(command, cluster, say=say, env=env, output=output),
                            **settings)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
