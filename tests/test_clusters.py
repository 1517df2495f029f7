"""The test clusters of tests/clusters.py: Workers lost for good, hosts of their own."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from spark_estimator.driver.launch import available_slots, run_barrier_job, scheduler_slots
from tests.clusters import NetnsCluster, StandaloneCluster

pytestmark = pytest.mark.cluster


def where_am_i() -> dict:
    """A barrier task's rank, process and address (as the barrier context lists it)."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    rank = ctx.partitionId()
    address = ctx.getTaskInfos()[rank].address.rsplit(":", 1)[0]
    return {"rank": rank, "pid": os.getpid(), "address": address}


def all_reduce_ranks(folder: str) -> dict:
    """Join the job's gloo group as a training task does (meeting in a store at ``folder``,
    which every host of these clusters shares) and sum rank + 1 over it."""
    import torch
    import torch.distributed as dist
    from pyspark import BarrierTaskContext

    from spark_estimator.store import Store
    from spark_estimator.worker.comm.meeting import Meeting
    from spark_estimator.worker.comm.rendezvous import process_group

    ctx = BarrierTaskContext.get()
    store = Store(folder)
    meeting = Meeting(store, store.run("clusters"), "launch", "c1" * 16)
    with process_group(ctx, meeting, use_gpu=False, timeout_s=60) as info:
        total = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(total)
        return {
            **where_am_i(),
            "sum": total.item(),
            "local_size": info.local_size,
            "resolves_to": resolve_own_name(),
        }


def resolve_own_name() -> str | None:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def wait_slots(spark, n: int, timeout_s: float = 120.0) -> float:
    """Seconds until the driver's scheduler counts ``n`` task slots."""
    began = time.monotonic()
    while (slots := scheduler_slots(spark)) != n:
        assert time.monotonic() - began < timeout_s, f"{slots} slots, not {n}, after {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - began


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm"))


def leaked_shm(before: set[str]) -> set[str]:
    """Files new in /dev/shm since ``before``, less those of processes that still run
    (another test's, whose names carry its pid)."""

    def owner_alive(name: str) -> bool:
        m = re.match(r"spark-estimator-(\d+)-", name)
        return bool(m) and os.path.exists(f"/proc/{m.group(1)}")

    return {f for f in shm_files() - before if not owner_alive(f)}


class HtmlPage(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"<html><body>not a Spark Master</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class PortThief:
    """Someone else's server that takes the ports a cluster's Master is told to bind
    (``--port``, ``--webui-port`` on its command line) before the Master's JVM binds them,
    as another test's cluster or a Spark application's UI could: it answers every request
    with an HTML page."""

    def __init__(self, cluster: StandaloneCluster):
        self.cluster = cluster
        self.servers: list[ThreadingHTTPServer] = []
        self.master_args: list[str] | None = None  # the Master's command line, once seen
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.stop.is_set():
            if self.cluster._procs:  # the Master is the first process a cluster starts
                with open(f"/proc/{self.cluster._procs[0].pid}/cmdline", "rb") as f:
                    args = f.read().decode().split("\0")
                if "--webui-port" in args:  # not this process's, forked and not yet exec'd
                    self.master_args = args
                    break
            time.sleep(0.001)
        if self.master_args is None:
            return
        for flag in ("--port", "--webui-port"):
            port = int(self.master_args[self.master_args.index(flag) + 1])
            if port:
                server = ThreadingHTTPServer((self.cluster.host, port), HtmlPage)
                threading.Thread(target=server.serve_forever, daemon=True).start()
                self.servers.append(server)

    @property
    def ports(self) -> list[int]:
        return [s.server_address[1] for s in self.servers]

    def __enter__(self) -> PortThief:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        for server in self.servers:
            server.shutdown()
            server.server_close()


def test_a_cluster_talks_to_its_own_master_when_another_server_takes_ports_first():
    cluster = StandaloneCluster(workers=1)
    with PortThief(cluster) as thief, cluster:
        assert thief.master_args is not None  # it saw the Master start
        assert cluster.port not in thief.ports and cluster.ui_port not in thief.ports
        assert cluster.master_status()["url"] == cluster.url
        assert [w["state"] for w in cluster.alive_workers()] == ["ALIVE"]
        # a server that is not this cluster's Master is a clear error, not its answer
        decoy = ThreadingHTTPServer((cluster.host, 0), HtmlPage)
        threading.Thread(target=decoy.serve_forever, daemon=True).start()
        try:
            cluster.ui_port = decoy.server_address[1]
            with pytest.raises(RuntimeError, match="not the Master of this cluster"):
                cluster.master_status()
        finally:
            decoy.shutdown()
            decoy.server_close()
    assert cluster.processes() == []


class MasterUiStartingUp(BaseHTTPRequestHandler):
    """A Master's web UI at start-up: its HTML home page for ``/json/`` to the first
    ``html_answers`` requests (its ``/`` handler is attached before ``/json``), then its
    JSON status naming ``master_url`` with one ALIVE Worker."""

    master_url = ""
    html_answers = 3
    requests = 0

    def do_GET(self):
        type(self).requests += 1
        if type(self).requests <= self.html_answers:
            body = f"<html><head><title>Spark Master at {self.master_url}</title></head></html>"
            kind = "text/html"
        else:
            workers = [{"id": "worker-1", "state": "ALIVE"}]
            body = json.dumps({"url": self.master_url, "workers": workers})
            kind = "text/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


THIS_MASTER, OTHER_MASTER = "spark://127.0.0.1:7077", "spark://127.0.0.1:7078"


@contextlib.contextmanager
def cluster_at(handler: type[BaseHTTPRequestHandler], tmp_path):
    """A ``StandaloneCluster`` of Master ``THIS_MASTER`` whose UI port is a server of
    ``handler`` (no JVM)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cluster = StandaloneCluster(workers=1)
    cluster.url, cluster.ui_port = THIS_MASTER, server.server_address[1]
    cluster.dir = tmp_path
    (tmp_path / "logs").mkdir()
    try:
        yield cluster
    finally:
        server.shutdown()
        server.server_close()


def test_wait_workers_retries_the_masters_html_page_at_start_up(tmp_path):
    handler = type("Ui", (MasterUiStartingUp,), {"master_url": THIS_MASTER})
    with cluster_at(handler, tmp_path) as cluster:
        assert cluster.wait_workers(1, timeout_s=30) < 30
        assert handler.requests == 4  # three HTML answers retried, then the status


@pytest.mark.parametrize(
    "handler, said",
    [
        (HtmlPage, "not a Spark Master"),
        (
            type("Ui", (MasterUiStartingUp,), {"master_url": OTHER_MASTER, "html_answers": 10**6}),
            f"a page titled 'Spark Master at {OTHER_MASTER}'",
        ),
        (
            type("Ui", (MasterUiStartingUp,), {"master_url": OTHER_MASTER, "html_answers": 0}),
            f'"url": "{OTHER_MASTER}"',
        ),
    ],
    ids=["html page", "another master's page", "another master's status"],
)
def test_wait_workers_refuses_a_server_that_stays_someone_elses(tmp_path, handler, said):
    with cluster_at(handler, tmp_path) as cluster:
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="not the Master of this cluster") as error:
            cluster.wait_workers(1, timeout_s=1)
        assert time.monotonic() - began >= 1  # retried until the timeout, then refused
        assert said in str(error.value)  # with the server's last answer


def test_standalone_cluster_loses_a_worker_for_good_and_gains_a_new_one():
    shm_before = shm_files()
    with StandaloneCluster(workers=3) as cluster:
        print(f"\nstandalone: 3 workers ALIVE {cluster.startup_s:.1f} s after start")
        began = time.monotonic()
        spark = cluster.session()
        print(f"standalone: session with 3 executors in {time.monotonic() - began:.1f} s")
        assert spark.sparkContext.master == cluster.url
        assert available_slots(spark) == 3

        ranks = run_barrier_job(spark, 3, where_am_i, "where am I")
        pids = {r["pid"] for r in ranks}
        assert len(pids) == 3 and os.getpid() not in pids
        assert all(pid in cluster.processes() for pid in pids)

        killed = time.monotonic()
        cluster.kill_worker(0)
        master_s = cluster.wait_workers(2, timeout_s=60)
        wait_slots(spark, 2)
        print(
            f"standalone: after kill_worker the Master lists 2 ALIVE in {master_s:.1f} s, "
            f"the driver counts 2 slots in {time.monotonic() - killed:.1f} s"
        )
        assert available_slots(spark, wanted=3, wait_s=0) == 2
        # for good: no executor comes back on the two Workers left
        watch_until = time.monotonic() + 10
        while time.monotonic() < watch_until:
            assert scheduler_slots(spark) == 2
            assert len(cluster.alive_workers()) == 2
            time.sleep(0.5)
        assert len(run_barrier_job(spark, 2, where_am_i, "two left")) == 2

        began = time.monotonic()
        cluster.start_worker()
        wait_slots(spark, 3)
        print(f"standalone: start_worker -> 3 slots in {time.monotonic() - began:.1f} s")
        ranks = run_barrier_job(spark, 3, where_am_i, "three again")
        assert len({r["pid"] for r in ranks}) == 3
    assert cluster.processes() == []
    assert not cluster.dir.exists()
    assert leaked_shm(shm_before) == set()


def test_netns_cluster_runs_gloo_across_hosts_and_loses_and_gains_a_host(tmp_path):
    all_reduce = functools.partial(all_reduce_ranks, str(tmp_path))
    shm_before = shm_files()
    with NetnsCluster(workers=3) as cluster:
        print(f"\nnetns: 3 worker hosts ALIVE {cluster.startup_s:.1f} s after start")
        hosts = [f"{cluster.subnet}.{10 + i}" for i in range(3)]
        assert sorted(w["host"] for w in cluster.alive_workers()) == hosts
        spark = cluster.session()

        ranks = run_barrier_job(spark, 3, all_reduce, "gloo across hosts")
        assert sorted(r["address"] for r in ranks) == hosts
        assert [r["sum"] for r in ranks] == [6.0, 6.0, 6.0]
        assert [r["local_size"] for r in ranks] == [1, 1, 1]  # one rank per host
        assert all(r["resolves_to"] == r["address"] for r in ranks)

        stopped = time.monotonic()
        cluster.stop_worker(1)
        cluster.wait_workers(2, timeout_s=60)
        wait_slots(spark, 2)
        print(f"netns: stop_worker -> 2 slots in {time.monotonic() - stopped:.1f} s")
        assert hosts[1] not in [w["host"] for w in cluster.alive_workers()]
        assert len(cluster.namespaces()) == 2

        began = time.monotonic()
        new = cluster.start_worker()
        wait_slots(spark, 3)
        print(f"netns: start_worker -> 3 slots in {time.monotonic() - began:.1f} s")
        ranks = run_barrier_job(spark, 3, all_reduce, "gloo on the new host")
        assert sorted(r["address"] for r in ranks) == sorted(
            [hosts[0], hosts[2], f"{cluster.subnet}.{10 + new}"]
        )
        assert [r["sum"] for r in ranks] == [6.0, 6.0, 6.0]
    assert cluster.processes() == []
    assert cluster.namespaces() == [] and cluster.links() == []
    assert not list(cluster.etc_folders())
    assert leaked_shm(shm_before) == set()


def test_gloo_crosses_hosts_whose_own_name_resolves_elsewhere(tmp_path):
    """Hosts whose name does not resolve to their own address (here /etc/hosts maps it to
    127.0.0.1): gloo must still use the interface that carries the task's address."""
    with NetnsCluster(workers=2, resolve_own_name=False) as cluster:
        assert not list(cluster.etc_folders())
        spark = cluster.session()
        ranks = run_barrier_job(
            spark, 2, functools.partial(all_reduce_ranks, str(tmp_path)), "gloo, name not resolving"
        )
        hosts = [f"{cluster.subnet}.{10 + i}" for i in range(2)]
        assert sorted(r["address"] for r in ranks) == hosts
        assert all(r["resolves_to"] != r["address"] for r in ranks)
        assert [r["sum"] for r in ranks] == [3.0, 3.0]


def test_a_lightning_script_on_two_hosts_gets_torchruns_ranks_host_by_host(tmp_path):
    """Two hosts of two ranks each, ``Trainer(strategy="ddp", devices=2, num_nodes=2)``:
    Spark hands the tasks out round-robin over the executors, the ranks of a host are
    numbered in a row (as torchrun's), and Lightning takes each rank's RANK and the host's
    GROUP_RANK (not a second rank 0 from node rank 0)."""
    pytest.importorskip("lightning")
    from spark_estimator import run
    from tests.test_runner import LIGHTNING_SCRIPT, Recorder, lightning_ranks

    script = tmp_path / "train_lightning.py"
    script.write_text(
        LIGHTNING_SCRIPT
        + "import socket\nprint('on', socket.gethostbyname(socket.gethostname()))\n"
    )
    with NetnsCluster(workers=2, cores=2) as cluster:
        spark = cluster.session(**{"spark.executor.cores": "2"})
        out = Recorder()
        run(
            str(script), args=["2", "2"], num_proc=4, use_gpu=False, spark=spark,
            store=str(tmp_path / "store"), stdout=out,
        )  # fmt: skip
    said = [line.split() for line in out.lines]  # "[rank <r>] on <address>"
    hosts = {int(w[1].rstrip("]")): w[3] for w in said if w[2] == "on"}
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts  # a host's ranks in a row
    assert sorted(set(hosts.values())) == [f"{cluster.subnet}.{10 + i}" for i in range(2)]
    assert lightning_ranks(out.lines) == {
        r: [str(r), str(r // 2), str(r % 2), "4"] * 2 + ["TorchElasticEnvironment"]
        for r in range(4)
    }
