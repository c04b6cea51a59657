"""`tracekit cluster` on real network namespaces with real gloo ranks: the links are shaped and the
loopback is not, every rank lands on its node, a recorded run has every rank and the topology, and
nothing of a run is left behind however it ends. Skipped (with the reason) without root, iproute2
or the tbf qdisc."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.prerequisites import needs
from tests.recorded import REPO
from tracekit.app import cli as cli_module
from tracekit.app import cluster

TINY_TRAINER = ["--tables", "4", "--rows", "1000", "--dim", "8", "--bottom-mlp", "16,8", "--top-mlp", "16,1",
                "--batch-size", "64", "--samples", "8192"]


def _missing() -> str | None:
    try:
        cluster.check_prerequisites(cluster.Cluster(1, 1, "1gbit"))
    except cluster.ClusterError as err:
        return str(err)
    return None


needs_cluster = needs(None if _missing() is None else f"no emulated cluster here: {_missing()}")


def tracekit_cluster(*args: str, timeout: int = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracekit", "cluster", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def run_id_of(stderr: str) -> str:
    match = re.search(r"bridge tk([0-9a-f]{6})br for (\S+)", stderr)
    assert match, stderr
    return match.group(1)


def assert_gone(stderr: str, marker: str) -> None:
    """No namespace, link, address or process of the run named in `stderr` remains (processes:
    any whose command line holds `marker`)."""
    run_id = run_id_of(stderr)
    subnet = re.search(r"bridge tk[0-9a-f]{6}br for (\d+\.\d+\.\d+)\.", stderr).group(1)
    assert run_id not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"tk{run_id}" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"{subnet}." not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if marker in line], ps
    assert not list(cluster.NETNS_ETC.glob(f"tkc-{run_id}-*"))  # the namespaces' /etc/hosts
    assert "tracekit cluster: removed the cluster\n" in stderr, stderr


# --- what each test runs on every rank ---------------------------------------------------------

EXCHANGE = """
import json, os, subprocess, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
x, y = torch.ones(int(sys.argv[1]) // 4), torch.empty(int(sys.argv[1]) // 4)
for _ in range(EXCHANGES):
    dist.all_to_all_single(y, x)
dist.barrier()
iface = os.environ["GLOO_SOCKET_IFNAME"]
qdisc = json.loads(subprocess.run(["tc", "-s", "-j", "qdisc", "show", "dev", iface], check=True,
                                  capture_output=True, text=True).stdout)
with open(os.path.join(sys.argv[2], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"iface": iface, "qdisc": qdisc}, f)
dist.destroy_process_group()  # else gloo's threads may abort the exit (std::terminate)
""".replace("EXCHANGES", "3")

FAIL = """
import os, signal, sys, time, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
dist.barrier()
dist.destroy_process_group()
"""

WAIT = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
emb = torch.nn.EmbeddingBag(10, 4)
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
for _ in range(2):
    emb(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w").close()
time.sleep(600)
"""


def script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- tests -----------------------------------------------------------------------------------

def exchange_on(tmp_path: Path, nodes: int, per_node: int, size: int) -> tuple[list[dict], str]:
    """Each rank's interface and its 3 all-to-alls' times (`size` bytes each) on NODESxPER_NODE at 100mbit, and
    tracekit cluster's stderr."""
    exchange = script(tmp_path, "exchange.py", EXCHANGE)
    out = tmp_path / f"{nodes}x{per_node}"
    out.mkdir()
    r = tracekit_cluster("--nodes", str(nodes), "--ranks-per-node", str(per_node), "--link", "100mbit", "--",
                         "python", str(exchange), str(size), str(out))
    assert r.returncode == 0, r.stderr
    assert "hostname of the client socket cannot be retrieved" not in r.stderr, r.stderr  # nodes have names
    assert_gone(r.stderr, str(exchange))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nodes * per_node)], r.stderr


@needs_cluster
def test_links_between_nodes_are_shaped_and_the_loopback_is_not(tmp_path: Path) -> None:
    """Counted by the shaper itself, not timed: every byte a node sends to the other node leaves
    through its NIC's token bucket at the link's rate, which held packets back (overlimits), and a
    node's ranks exchange on its loopback, past the bucket."""
    size = 8_000_000  # bytes per rank, a quarter to each rank: a node sends 2 ranks x 2 quarters = `size` across
    across, stderr = exchange_on(tmp_path, 2, 2, size)
    run_id = run_id_of(stderr)
    assert [x["iface"] for x in across] == [f"tk{run_id}n{node}" for node in (0, 0, 1, 1)]  # rank = node * R + local
    for rank in across:
        (tbf,) = [q for q in rank["qdisc"] if q["root"]]
        assert tbf["kind"] == "tbf" and tbf["options"]["rate"] == cluster.parse_rate("100mbit"), tbf
        # 3 exchanges of `size` bytes across, plus headers, ACKs of what the other node sent, rendezvous
        assert 3 * size <= tbf["bytes"] <= 1.1 * 3 * size, tbf
        assert tbf["overlimits"] > 0, tbf  # the bucket ran dry: the link's rate, not the CPU's, set the pace
    within, _ = exchange_on(tmp_path, 1, 2, size)  # the same exchange of 2 ranks' (size / 2 across), on a loopback
    for rank in within:
        (tbf,) = [q for q in rank["qdisc"] if q["root"]]
        assert tbf["kind"] == "tbf" and tbf["bytes"] < 0.01 * size, tbf  # rendezvous and barriers only


@needs_cluster
def test_a_recorded_cluster_run_has_every_rank_and_the_topology(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = tracekit_cluster("--nodes", "2", "--ranks-per-node", "2", "--link", "200mbit", "--record", str(run_dir),
                         "--flush-interval", "0.2", "--", "python", "train.py", *TINY_TRAINER, "--steps", "3")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["topology"] == {"nodes": 2, "ranks_per_node": 2, "link": "200mbit", "link_bytes_per_s": 25e6,
                                    "latency_ms": None, "burst_bytes": 100_000, "rank_nodes": [0, 0, 1, 1]}
    assert (manifest["status"], manifest["exit_code"], manifest["ranks"]) == ("completed", 0, [0, 1, 2, 3])
    assert manifest["steps"] == {str(rank): 3 for rank in range(4)} and manifest["finalise_errors"] == []
    for table in ("steps", "comms"):
        assert sorted(p.name for p in (run_dir / table).iterdir()) == [f"rank={rank}" for rank in range(4)]
    assert_gone(r.stderr, str(run_dir))


@needs_cluster
def test_a_failing_rank_fails_the_run_and_two_clusters_at_once_do_not_collide(tmp_path: Path) -> None:
    fail = script(tmp_path, "fail.py", FAIL)
    args = ["--nodes", "2", "--link", "1gbit", "--", "python", str(fail)]
    runs = [subprocess.Popen([sys.executable, "-m", "tracekit", "cluster", *args, mode], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for mode in ("exit", "kill")]
    outputs = [p.communicate(timeout=120) for p in runs]
    for p, (_, stderr) in zip(runs, outputs):
        assert p.returncode == 1, stderr  # torchrun's exit code for a failed worker, whatever the worker's was
        assert "tracekit cluster: running 2 node(s)" in stderr, stderr
    assert run_id_of(outputs[0][1]) != run_id_of(outputs[1][1])
    for _, stderr in outputs:
        assert_gone(stderr, str(fail))


@needs_cluster
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])  # SIGINT: a terminal's Ctrl-C (ranks have their own sessions)
def test_a_signal_to_cluster_keeps_the_record_removes_everything_and_the_next_cluster_works(tmp_path: Path, sig: int) -> None:
    wait = script(tmp_path, "wait.py", WAIT)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "tracekit", "cluster", "--nodes", "2", "--ranks-per-node", "1",
                             "--link", "1gbit", "--record", str(run_dir), "--", sys.executable, str(wait), str(tmp_path)],
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"rank{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    manifest = json.loads((run_dir / "manifest.json").read_text())
    # the ranks ended as after a Ctrl-C, so their reports were written
    assert (manifest["status"], manifest["steps"], manifest["finalise_errors"]) == ("interrupted", {"0": 2, "1": 2}, [])
    assert_gone(stderr, str(wait))
    again = tracekit_cluster("--nodes", "2", "--link", "1gbit", "--", "true")
    assert again.returncode == 0, again.stderr
    assert_gone(again.stderr, str(wait))


@needs_cluster
def test_latency_runs_with_netem_and_is_refused_in_one_line_without() -> None:
    def namespaces() -> set[str]:  # of tracekit clusters; another may be running beside this test
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        return {name for name in listed if name.startswith(("tkc-", "tkprobe-"))}

    before = namespaces()
    r = tracekit_cluster("--nodes", "2", "--link", "1gbit", "--latency", "5", "--", "true")
    if r.returncode == 0:  # this kernel has netem: the command ran on links with latency, and the cluster is gone
        assert not namespaces() - before
        return
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["Error: --latency 5: needs the netem qdisc (sch_netem), which this "
                                             "kernel does not have; run without --latency (links are then shaped by "
                                             "rate only)"]
    assert not namespaces() - before  # the probe's namespace is gone too


def test_missing_iproute2_or_root_is_one_line_naming_it(tmp_path: Path) -> None:
    r = tracekit_cluster("--nodes", "2", "--link", "1gbit", "--", "true",
                         env={**os.environ, "PATH": str(tmp_path)})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["Error: tracekit cluster needs iproute2: ip and tc not found on PATH"]
    if _missing() is None or "root" in _missing():
        with pytest.raises(cluster.ClusterError, match=r"^tracekit cluster needs root \(it creates network namespaces"):
            cluster.check_prerequisites(cluster.Cluster(1, 1, "1gbit"), is_root=lambda: False)


def test_commands_become_torchrun_forms() -> None:
    topology = cluster.Cluster(2, 3, "1gbit")
    network = cluster.plan_network(2, "abc123", [])
    node0, node1 = network.nodes
    head = cluster.torchrun_argv(["python", "x.py"], topology, network, node0)
    assert head[head.index("--rdzv-endpoint") + 1] == f"{node0.addr}:{cluster.RDZV_PORT}"
    assert head[-3:] == ["--rdzv-conf", "is_host=1", "x.py"]
    assert cluster.torchrun_argv([sys.executable, "-m", "m", "-a"], topology, network, node1)[-4:] == [
        node1.addr, "-m", "m", "-a"]
    assert cluster.torchrun_argv(["sh", "-c", "true"], topology, network, node1)[-4:] == [
        "--no-python", "sh", "-c", "true"]
    assert head[:3] == [sys.executable, "-m", "torch.distributed.run"]  # "python": this one's
    other = cluster.torchrun_argv(["/venvs/torchrec/bin/python", "x.py"], topology, network, node1)
    assert other[:3] == ["/venvs/torchrec/bin/python", "-m", "torch.distributed.run"] and other[-1] == "x.py"
    assert max(len(name) for n in network.nodes for name in (n.veth, n.peer, network.bridge)) <= 15
    widest = cluster.plan_network(cluster.MAX_NODES, "abc123", [])
    assert max(len(n.veth) for n in widest.nodes) <= 15 and widest.nodes[-1].addr.endswith(".254")
    assert cli_module.CLUSTER_MAX_NODES == cluster.MAX_NODES


def test_the_subnet_avoids_the_hosts_networks() -> None:
    import ipaddress

    first = cluster.plan_network(2, "ab0a0b", [])
    assert str(first.subnet) == "10.10.11.0/24" and first.nodes[1].addr == "10.10.11.101"
    second = cluster.plan_network(2, "ab0a0b", [ipaddress.IPv4Network("10.10.0.0/16")])
    assert not second.subnet.overlaps(ipaddress.IPv4Network("10.10.0.0/16"))


def test_optimize_cluster_needs_link_and_a_shape() -> None:
    from click.testing import CliRunner

    from tracekit.app.cli import cli

    r = CliRunner().invoke(cli, ["optimize", "--cluster", "2x2", "--", "python", "train.py"])
    assert r.exit_code == 2 and "--cluster NODESxRANKS and --link RATE go together" in r.output, r.output
    r = CliRunner().invoke(cli, ["optimize", "--cluster", "2by2", "--link", "1gbit", "--", "python", "train.py"])
    assert r.exit_code == 2 and "expected NODESxRANKS such as 2x4, got '2by2'" in r.output, r.output


def test_optimize_records_each_run_through_cluster(tmp_path: Path, monkeypatch) -> None:
    from tracekit.app import optimize

    seen = []

    def run(command, topology, *, env, say, output):  # the cluster itself needs root: its launch is what is checked
        seen.append((command, topology, env["TRACEKIT_LOOKUP_EVERY"], output.name))
        return 0, False

    monkeypatch.setattr(cluster, "run", run)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "stale").write_text("")  # replaced, as --force did
    code = optimize.record(tmp_path / "base", [sys.executable, "train.py"], tmp_path / "base.log", lookup_every=1,
                           cluster=cluster.Cluster(2, 2, "200mbit"))
    assert code == 0 and not (tmp_path / "base" / "stale").exists()
    assert seen == [([sys.executable, "train.py"], cluster.Cluster(2, 2, "200mbit"), "1", str(tmp_path / "base.log"))]
    manifest = json.loads((tmp_path / "base" / "manifest.json").read_text())
    assert manifest["topology"] == cluster.Cluster(2, 2, "200mbit").manifest()
    assert "tracekit: " in (tmp_path / "base.log").read_text()  # the recording's closing lines, in the log
