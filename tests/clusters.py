"""Real Spark standalone clusters for tests whose executors are lost for good.

``local-cluster[...]`` cannot lose an executor for good: its Workers live inside the
driver's JVM and relaunch a lost executor. These helpers start real daemons from the
installed pyspark (``SPARK_HOME`` = the pyspark package) instead:

- ``StandaloneCluster(workers=3)``: a Master and ``workers`` Worker processes on
  127.0.0.1, one core and 1 GiB each (so one one-core executor per Worker);
  ``cores=2`` gives each Worker two, and ``gpus=True`` one fake GPU each: the Worker's
  discovery script (``spark.worker.resource.gpu.discoveryScript``) prints
  ``{"name": "gpu", "addresses": ["<i>"]}``, the Worker's index as its address, so every
  executor that asks ``spark.executor.resource.gpu.amount=1`` holds a GPU address of its
  own (no CUDA behind it: a rank falls back to the CPU with that address recorded);
- ``NetnsCluster(workers=3)``: the same (``cores`` too), but each Worker is a host of its
  own: it runs in a Linux network namespace with its own IP address, joined by a veth pair
  to a bridge in this namespace that carries the driver's and the Master's address. Inside
  a namespace the machine's host name resolves to that host's address
  (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``), as on a
  real multi-host cluster; with ``resolve_own_name=False`` no such file is written, so the
  name resolves as this machine's ``/etc/hosts`` says (often to a loopback address, as on
  hosts whose ``/etc/hosts`` maps their own name to 127.0.x.1). Creating namespaces needs
  root and ``ip``; where that fails the test is skipped, saying why.

Both are context managers: entering starts the daemons and waits until the Master lists
every Worker ALIVE. Every daemon binds ports of its own choosing (port 0) and the Master's
are read from its log, so no port is picked here and bound later by another process, when a
process of someone else's (another xdist worker's cluster, a Spark application's UI that
walks up from 4040) could take it first; ``master_status()`` also checks that the server it
asks names this cluster's Master URL, and ``wait_workers`` retries any other answer until
its timeout (the Master's own UI gives one for a moment at start-up). Leaving stops the
session, kills every process of the cluster (Master, Workers, executors, their Python
workers: each carries the environment variable ``MARKER``, so none escapes by being
re-parented) and removes its folders, namespaces, veths and bridge, also after a failure.
Names and the subnet carry this test process's pid so that parallel pytest workers (xdist)
do not collide; leftovers of a killed test process are removed by the next cluster.

``kill_worker(i)`` / ``stop_worker(i)`` lose Worker ``i`` for good (SIGKILL to the Worker
JVM, its executor JVM and their Python workers; a namespace host loses all of its
processes and its network); ``start_worker()`` adds a Worker (a new host) whose executor
the Master gives the running application; ``alive_workers()`` is the Master's view.

How soon a loss is noticed (measured on a 2-core machine): a killed Worker's connections
close, so the Master drops it and the driver its executor within about 2 s, and a barrier
job running on it fails as fast. A host whose network is cut first
(``stop_worker(i, cut_network=True)``) is noticed by the driver only after
``spark.network.timeout`` (120 s by default; checked every ``spark.network.timeoutInterval``)
and by the Master after ``spark.worker.timeout`` (60 s, a Master setting: ``master_conf``).
A ``spark.worker.timeout`` of 5 s made healthy Workers of a busy machine flap; 15 s did not.

One SparkContext per process: pytest runs every test of a process on one SparkContext,
the one ``tests/conftest.py``'s ``spark_session(master)`` keeps. ``session(**conf)`` asks
it for a session on this cluster (which stops the session of another master, e.g. the
shared ``local[4]``), and leaving the cluster stops it with ``stop_session``; the next test
that uses the ``spark`` or ``cluster_spark`` fixture starts its own again. Mark such tests
``cluster`` so that they run last and the JVM is switched rarely.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pyspark
import pytest

from tests.conftest import spark_session, stop_session
from tests.jvm_archive import java_options

SPARK_HOME = Path(pyspark.__file__).parent
MARKER = "SPARK_ESTIMATOR_TEST_CLUSTER"  # environment variable of every cluster process
START_S = 120.0  # the most a Master, a Worker or the executors may take to come up
# the Masters' and Workers' JVMs as the tests' others (``spark_session`` gives the executors
# the same): short-lived, they spend less CPU starting so
JVM_OPTS = java_options()


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def marked_processes(prefix: str) -> list[int]:
    """Live processes whose ``MARKER`` variable starts with ``prefix``."""
    found, needle = [], f"{MARKER}={prefix}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if any(v.startswith(needle) for v in environ.split(b"\0")):
            if _proc_state(int(entry)) not in ("Z", "X"):
                found.append(int(entry))
    return found


def _kill_until_gone(list_pids, timeout_s: float = 30.0) -> None:
    """SIGKILL the processes ``list_pids()`` names until it names none (a process started
    meanwhile, e.g. an executor relaunched by a dying Worker, is killed in the next round)."""
    deadline = time.monotonic() + timeout_s
    while pids := list_pids():
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} survive SIGKILL")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


class NotThisMaster(RuntimeError):
    """The server at a cluster's Master UI port did not answer with this cluster's
    Master status (an HTML page, another Master's status)."""


class StandaloneCluster:
    """A Spark standalone Master and ``workers`` Workers of ``cores`` cores (and, with
    ``gpus``, one fake GPU each) on this machine."""

    host = "127.0.0.1"  # the driver's and the Master's address

    def __init__(
        self,
        workers: int = 3,
        master_conf: dict[str, str] | None = None,
        cores: int = 1,
        gpus: bool = False,
    ):
        self.workers_at_start = workers
        self.master_conf = master_conf or {}  # e.g. {"spark.worker.timeout": "5"}
        self.cores, self.gpus = cores, gpus
        self.id = f"{os.getpid()}-{time.monotonic_ns()}"
        self._procs: list[subprocess.Popen] = []
        self._workers: list[dict] = []  # per index: marker, pid and, on NetnsCluster, host
        self.startup_s: float | None = None  # seconds until all Workers were ALIVE

    # ----- lifecycle
    def __enter__(self) -> StandaloneCluster:
        began = time.monotonic()
        self.dir = Path(tempfile.mkdtemp(prefix="spark-cluster-"))
        (self.dir / "logs").mkdir()
        try:
            self._setup_network()
            self._start_master()
            for _ in range(self.workers_at_start):
                self._add_worker()
            self.wait_workers(self.workers_at_start)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.startup_s = time.monotonic() - began
        return self

    def __exit__(self, *exc) -> None:
        if hasattr(self, "url"):
            stop_session(self.url)
        _kill_until_gone(lambda: marked_processes(self.id + "/"))
        for proc in self._procs:
            proc.wait()
        self._teardown_network()
        shutil.rmtree(self.dir, ignore_errors=True)

    def processes(self) -> list[int]:
        """The live processes of this cluster (none once it is left)."""
        return marked_processes(self.id + "/")

    # ----- workers
    def start_worker(self) -> int:
        """Add a Worker; return its index once the Master lists it ALIVE."""
        alive = len(self.alive_workers())
        index = self._add_worker()
        self.wait_workers(alive + 1)
        return index

    def kill_worker(self, i: int) -> None:
        """Lose Worker ``i`` for good: SIGKILL its JVM, its executors and their Python
        workers (every process that carries its marker)."""
        marker = self._workers[i]["marker"]
        _kill_until_gone(lambda: marked_processes(marker))

    def master_status(self) -> dict:
        """The Master's JSON status (``/json/`` of its web UI), checked to be this
        cluster's: a server that does not name this cluster's Master URL is an error
        (``NotThisMaster``)."""
        url = f"http://{self.host}:{self.ui_port}/json/"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read()
        try:
            status = json.loads(body)
        except ValueError:
            status = None
        if not isinstance(status, dict) or status.get("url") != self.url:
            title = re.search(rb"<title>\s*(.*?)\s*</title>", body, re.S | re.I)
            raise NotThisMaster(
                f"{url} is not the Master of this cluster ({self.url}); it answers "
                + (f"a page titled {title.group(1).decode(errors='replace')!r}: " if title else "")
                + f"{body[:200]!r}"
            )
        return status

    def alive_workers(self) -> list[dict]:
        """The Master's ALIVE workers (its JSON status: id, host, port, cores, ...)."""
        return [w for w in self.master_status()["workers"] if w["state"] == "ALIVE"]

    def wait_workers(self, n: int, timeout_s: float = START_S) -> float:
        """Wait until the Master lists exactly ``n`` ALIVE workers; return the seconds.

        Until then an answer that is not this cluster's Master's status is retried too:
        for a moment after the Master's log names its UI port (``_start_master``), its
        web UI answers ``/json/`` with its HTML home page, as the ``/`` handler is
        attached before the ``/json`` one. A server that stays someone else's is still
        an error, once ``timeout_s`` is up, with its last answer."""
        began = time.monotonic()
        last = "no answer"
        while time.monotonic() - began < timeout_s:
            try:
                alive = self.alive_workers()
                if len(alive) == n:
                    return time.monotonic() - began
                last = f"the Master lists {alive!r}"
            except OSError as e:  # the Master's web UI is not up yet
                last = repr(e)
            except NotThisMaster as e:  # its UI still attaching its handlers, or not it
                last = str(e)
            time.sleep(0.2)
        raise RuntimeError(
            f"not {n} ALIVE workers after {timeout_s:g} s: {last}; "
            f"logs in {self.dir / 'logs'}:\n{self.log_tails()}"
        )

    def log_tails(self, lines: int = 15) -> str:
        tails = []
        for log in sorted((self.dir / "logs").iterdir()):
            tails.append(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-lines:]))
        return "\n".join(tails)

    # ----- the driver
    def session(self, **conf: str):
        """A SparkSession on this cluster (one-core executors of 512 MiB, one cpu per
        task), returned once every ALIVE worker's executor has registered; ``conf`` adds or
        overrides Spark settings (``**{"spark.network.timeout": "10s"}``; with
        ``spark.executor.cores`` 2 on Workers of 2 cores, one two-core executor each)."""
        settings = {
            "spark.executor.cores": "1",
            "spark.task.cpus": "1",
            "spark.executor.memory": "512m",
            "spark.driver.host": self.host,
            "spark.driver.bindAddress": self.host,
            **conf,
        }
        spark = spark_session(self.url, **settings)
        wanted = len(self.alive_workers())
        deadline = time.monotonic() + START_S
        while (registered := spark.sparkContext._jsc.sc().getExecutorIds().size()) < wanted:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{registered} of {wanted} executors registered within {START_S:g} s; "
                    f"logs in {self.dir}"
                )
            time.sleep(0.2)
        return spark

    # ----- internals (NetnsCluster overrides the network ones)
    def _start_master(self) -> None:
        """Start the Master on ports it picks itself when it binds them (port 0) and read
        them from its log: ports picked here and bound later by the Master's JVM could be
        taken meanwhile by another process (another test's cluster, a Spark application's
        UI that walks up from 4040), and this cluster would then talk to that server. Its
        REST submission server (a fixed port, 6066, that every Master walks up from) is
        off unless ``master_conf`` turns it on: the tests submit through the driver."""
        conf = {"spark.master.rest.enabled": "false", **self.master_conf}
        proc = self._spawn(
            "master",
            "org.apache.spark.deploy.master.Master",
            ["--host", self.host, "--port", "0", "--webui-port", "0"],
            env={
                "SPARK_LOCAL_IP": self.host,
                "SPARK_MASTER_OPTS": " ".join(f"-D{k}={v}" for k, v in conf.items()),
            },
        )
        self.port, self.ui_port = self._await_ports("master", proc, "sparkMaster", "MasterUI")
        self.url = f"spark://{self.host}:{self.port}"

    def _await_ports(self, name: str, proc: subprocess.Popen, *services: str) -> list[int]:
        """The ports process ``name`` bound for its ``services``, as its log says ("Successfully
        started service 'X' on port N."), once it says so for all (within ``START_S``)."""
        log = self.dir / "logs" / f"{name}.log"
        deadline = time.monotonic() + START_S
        while True:
            text = log.read_text()
            found = [
                re.search(rf"Successfully started service '{s}' on port (\d+)\.", text)
                for s in services
            ]
            if all(found):
                return [int(m.group(1)) for m in found]
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name} (exit status {proc.poll()}) did not log the ports of all of "
                    f"{services} within {START_S:g} s; logs in {self.dir / 'logs'}:\n"
                    + self.log_tails()
                )
            time.sleep(0.05)

    def _setup_network(self) -> None:
        pass

    def _teardown_network(self) -> None:
        pass

    def _worker_host(self, index: int) -> tuple[str, list[str]]:
        """(the Worker's address, the command prefix that runs it on its host)."""
        return self.host, []

    def _add_worker(self) -> int:
        index = len(self._workers)
        host, prefix = self._worker_host(index)
        work_dir = self.dir / f"worker-{index}"
        work_dir.mkdir()
        marker = f"{self.id}/worker-{index}/"
        proc = self._spawn(
            f"worker-{index}",
            "org.apache.spark.deploy.worker.Worker",
            ["--host", host, "--cores", str(self.cores), "--memory", "1g"]
            + ["--work-dir", str(work_dir), "--webui-port", "0", self.url],
            env={"SPARK_LOCAL_IP": host, **self._gpu_options(index)},
            prefix=prefix,
            marker=marker,
        )
        self._workers.append({"marker": marker, "pid": proc.pid, "host": host})
        return index

    def _gpu_options(self, index: int) -> dict[str, str]:
        """The Worker's environment for one fake GPU whose address is ``index`` (none
        without ``gpus``): its discovery script, written here, and the settings naming it."""
        if not self.gpus:
            return {}
        script = self.dir / f"gpu-{index}.sh"
        line = json.dumps({"name": "gpu", "addresses": [str(index)]})
        script.write_text(f"#!/bin/sh\necho '{line}'\n")
        script.chmod(0o755)
        options = {
            "spark.worker.resource.gpu.amount": "1",
            "spark.worker.resource.gpu.discoveryScript": str(script),
        }
        return {"SPARK_WORKER_OPTS": " ".join(f"-D{k}={v}" for k, v in options.items())}

    def _spawn(self, name, main_class, args, env, prefix=(), marker=None) -> subprocess.Popen:
        environ = dict(
            os.environ,
            SPARK_HOME=str(SPARK_HOME),
            SPARK_DAEMON_MEMORY="256m",
            SPARK_DAEMON_JAVA_OPTS=JVM_OPTS,
            **env,
        )
        environ[MARKER] = marker or f"{self.id}/{name}/"
        with open(self.dir / "logs" / f"{name}.log", "w") as log:
            proc = subprocess.Popen(
                [*prefix, str(SPARK_HOME / "bin" / "spark-class"), main_class, *args],
                env=environ,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._procs.append(proc)
        return proc


class NetnsCluster(StandaloneCluster):
    """A standalone cluster whose every Worker is a host of its own: a network namespace
    with its own address on a bridge that this namespace (driver, Master) is on too."""

    _LOCK = "/tmp/spark-estimator-netns.lock"

    def __init__(
        self,
        workers: int = 3,
        master_conf: dict[str, str] | None = None,
        resolve_own_name: bool = True,
        cores: int = 1,
    ):
        super().__init__(workers, master_conf, cores)
        self.resolve_own_name = resolve_own_name
        pid = os.getpid()
        self.bridge = f"sebr{pid}"
        self.ns_prefix = f"se{pid}w"

    def namespaces(self) -> list[str]:
        """This cluster's namespaces that exist now."""
        return [n for n in _netns_list() if n.startswith(self.ns_prefix)]

    def links(self) -> list[str]:
        """This cluster's bridge and veths in this namespace that exist now."""
        pid = os.getpid()
        return [n for n in _link_names() if n in (f"sebr{pid}",) or n.startswith(f"sev{pid}w")]

    def etc_folders(self) -> list[Path]:
        """This cluster's ``/etc/netns`` folders (each namespace's ``hosts``)."""
        return list(Path("/etc/netns").glob(f"{self.ns_prefix}*"))

    def stop_worker(self, i: int, cut_network: bool = False) -> None:
        """Lose host ``i`` for good: kill every process in its namespace, then remove the
        namespace (its network goes with it).

        With ``cut_network`` its links go down first, so that no peer hears its
        connections close (a host that loses power or its network): the driver and the
        Master then notice only when its heartbeats stop (``spark.network.timeout``,
        ``spark.worker.timeout``)."""
        ns = self._workers[i]["ns"]
        if cut_network:
            _run("ip", "link", "set", f"sev{os.getpid()}w{i}", "down")
            _run("ip", "-n", ns, "link", "set", "eth0", "down")
        _kill_until_gone(lambda: _netns_pids(ns))
        self._delete_namespace(ns)

    def kill_worker(self, i: int) -> None:
        self.stop_worker(i)

    def _setup_network(self) -> None:
        try:
            _run("ip", "netns", "add", f"{self.ns_prefix}probe")
            _run("ip", "netns", "del", f"{self.ns_prefix}probe")
        except (OSError, RuntimeError) as e:
            pytest.skip(f"network namespaces cannot be created here (needs root and ip): {e}")
        _remove_leftovers()
        with open(self._LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one subnet per process: pick and take it
            used = {int(m) for m in re.findall(r"inet 10\.77\.(\d+)\.", _ip_addresses())}
            start = os.getpid() % 200 + 20
            octet = next(o for o in [*range(start, 250), *range(20, start)] if o not in used)
            self.subnet = f"10.77.{octet}"
            self.host = f"{self.subnet}.1"
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            # a bridge without an address of its own takes its ports' lowest one, so losing
            # a host would change it and leave the other hosts' ARP entries for the driver
            # and the Master stale (their heartbeats then stopped for a minute)
            _run("ip", "link", "set", self.bridge, "address", f"02:77:{octet:02x}:00:00:01")
            _run("ip", "addr", "add", f"{self.host}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")

    def _worker_host(self, index: int) -> tuple[str, list[str]]:
        ns, veth = f"{self.ns_prefix}{index}", f"sev{os.getpid()}w{index}"
        ip = f"{self.subnet}.{10 + index}"
        if self.resolve_own_name:
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{ip} {socket.gethostname()}\n")
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        _run("ip", "link", "set", f"{veth}p", "netns", ns)
        _run("ip", "-n", ns, "link", "set", f"{veth}p", "name", "eth0")
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        return ip, ["ip", "netns", "exec", ns]

    def _add_worker(self) -> int:
        index = super()._add_worker()
        self._workers[index]["ns"] = f"{self.ns_prefix}{index}"
        return index

    def _delete_namespace(self, ns: str) -> None:
        if ns in _netns_list():
            _run("ip", "netns", "del", ns)  # its veth end goes, and so does the peer
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    def _teardown_network(self) -> None:
        for ns in self.namespaces():
            _kill_until_gone(lambda ns=ns: _netns_pids(ns))
            self._delete_namespace(ns)
        for link in self.links():
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for etc in self.etc_folders():
            shutil.rmtree(etc, ignore_errors=True)


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if _proc_state(int(p)) not in ("Z", "X")]


def _link_names() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]


def _ip_addresses() -> str:
    return subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True).stdout


def _remove_leftovers() -> None:
    """Namespaces, links and /etc/netns folders of test processes that are gone (killed
    before they could tear their cluster down)."""

    def dead(pid: str) -> bool:
        return not os.path.exists(f"/proc/{pid}")

    for ns in _netns_list():
        if (m := re.fullmatch(r"se(\d+)w\w+", ns)) and dead(m.group(1)):
            _kill_until_gone(lambda ns=ns: _netns_pids(ns))
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for link in _link_names():
        if (m := re.fullmatch(r"se(?:br|v)(\d+)\w*", link)) and dead(m.group(1)):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
    for etc in Path("/etc/netns").glob("se*w*") if Path("/etc/netns").exists() else []:
        if (m := re.fullmatch(r"se(\d+)w\w+", etc.name)) and dead(m.group(1)):
            shutil.rmtree(etc, ignore_errors=True)
