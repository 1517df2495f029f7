"""Driver: ``hvd.run``, Horovod's ``horovod.run`` signature over ``spark_estimator.run``.

A Horovod script that launches itself (``horovod.run(main, args=(...), np=4)``) keeps its
call: ``np`` is ``num_proc``, the size it starts with; an elastic run goes on with no fewer
than ``min_np`` ranks and grows to at most ``max_np`` (``min_num_proc``, ``max_num_proc``);
``start_timeout`` and ``verbose`` are run's, and ``output_filename`` writes each rank's
lines to ``<output_filename>/rank.<r>/stdout`` and ``stderr``, as Horovod's does. Where
Horovod's launcher decides what Spark decides here (which hosts and slots, network
interfaces, ssh, the executable), the keyword is accepted and one warning says so; MPI is
refused (Spark starts the processes; they meet through gloo on CPU and NCCL on GPU, which
is ``use_gloo=True``). Returns the ranks' return values ordered by rank, as Horovod's.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

SPARK_DECIDES = {
    "hosts": "Spark's scheduler places the tasks",
    "hostfile": "Spark's scheduler places the tasks",
    "slots": "Spark's scheduler places the tasks",
    "network_interface": "set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME on the executors",
    "network_interfaces": "set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME on the executors",
    "ssh_port": "Spark starts the processes, without ssh",
    "ssh_identity_file": "Spark starts the processes, without ssh",
    "executable": "the tasks' Python is spark.pyspark.python / PYSPARK_PYTHON",
    "disable_cache": "nothing is cached between runs",
    "reset_limit": "an elastic run starts again at most max_restarts times",
    "cooldown_range": "Spark decides when lost executors come back",
}
_RANK_LINE = re.compile(r"\[rank (\d+)\] ?(.*)", re.DOTALL)


def run(
    func: Callable,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    np: int = 1,
    min_np: int | None = None,
    max_np: int | None = None,
    start_timeout: float | None = None,
    output_filename: str | None = None,
    verbose: bool | int | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    **launcher: Any,
) -> list:
    """Horovod's ``horovod.run``: ``func(*args, **kwargs)`` on ``np`` ranks, over ``run``.

    The ranks are Spark barrier tasks of the active session (``spark_estimator.run`` with
    ``num_proc=np``), so a Horovod script that launches itself keeps its call. Where
    Horovod's launcher decides what Spark decides here (hosts and slots, network
    interfaces, ssh, the executable), the keyword is accepted and one warning says so.

    Parameters
    ----------
    func : callable
        The function each rank runs (it calls ``hvd.init()``).
    args : tuple, optional
        Its positional arguments.
    kwargs : dict, optional
        Its keyword arguments.
    np : int, default 1
        The number of ranks the run starts with (``num_proc``).
    min_np, max_np : int, optional
        An elastic run goes on with no fewer than ``min_np`` ranks and grows to at most
        ``max_np`` (``min_num_proc``, ``max_num_proc``).
    start_timeout : float, optional
        Seconds to wait for the cluster's task slots, as ``run``'s.
    output_filename : str, optional
        A folder: each rank's lines are written to ``<output_filename>/rank.<r>/stdout``
        and ``stderr``, as Horovod's does.
    verbose : bool or int, optional
        True or 2 and above: each rank also reports its host, pid, device and task
        attempt (``run``'s ``verbose=2``); otherwise ``verbose=1``.
    use_gloo : bool, optional
        Accepted as True or None: the ranks meet through gloo (CPU) and NCCL (GPU), which
        is Horovod's ``use_gloo=True``.
    use_mpi, mpi_args : optional
        MPI is refused: Spark starts the processes.
    **launcher
        Horovod's ``hosts``, ``hostfile``, ``slots``, ``network_interface(s)``,
        ``ssh_port``, ``ssh_identity_file``, ``executable``, ``disable_cache``,
        ``reset_limit`` and ``cooldown_range``: accepted, and one warning says how Spark
        decides each one given.

    Returns
    -------
    list
        The ranks' return values ordered by rank, as Horovod's.

    Raises
    ------
    TypeError
        A keyword ``horovod.run`` does not have.
    ValueError
        ``use_mpi``, ``mpi_args`` or ``use_gloo=False``; ``max_np`` less than ``np``.
    TrainingError
        A rank's ``func`` raised, as in ``run``; and ``run``'s other errors.

    Examples
    --------
    >>> import spark_estimator.horovod as hvd
    >>> results = hvd.run(main, args=(config,), np=4)                   # doctest: +SKIP
    """
    # the driver's launcher, which imports pyspark and driver/: loaded only when a script
    # calls hvd.run, not by ``import spark_estimator.horovod`` on the ranks
    from ..runner import run as run_on_spark

    unknown = sorted(set(launcher) - set(SPARK_DECIDES))
    if unknown:
        raise TypeError(f"{unknown[0]}: not a keyword of horovod.run")
    if use_mpi or mpi_args is not None or use_gloo is False:
        given = "use_mpi" if use_mpi else "mpi_args" if mpi_args is not None else "use_gloo"
        raise ValueError(
            f"{given}: MPI is not offered: Spark starts the processes and they meet through "
            "gloo (CPU) and NCCL (GPU), Horovod's use_gloo=True; leave MPI out"
        )
    if max_np is not None and isinstance(max_np, int) and isinstance(np, int) and max_np < np:
        raise ValueError(f"max_np: {max_np} is less than np={np}, the size the run starts with")
    given = {k: v for k, v in launcher.items() if v is not None}
    if given:
        notes = "; ".join(f"{k}: {SPARK_DECIDES[k]}" for k in sorted(given))
        warnings.warn(f"hvd.run: Spark decides these, not the call: {notes}", stacklevel=2)
    options: dict[str, Any] = {
        "num_proc": np,
        "min_num_proc": min_np,
        "max_num_proc": max_np,
        "verbose": 2 if verbose is True or (verbose or 0) > 1 else 1,
    }
    if start_timeout is not None:
        options["start_timeout"] = start_timeout
    if output_filename is None:
        return run_on_spark(func, args, kwargs, **options)
    with RankFiles(output_filename, "stdout") as out, RankFiles(output_filename, "stderr") as err:
        return run_on_spark(func, args, kwargs, stdout=out, stderr=err, **options)


class RankFiles:
    """A stream for run's ``[rank r] line`` lines that writes each rank's to
    ``<folder>/rank.<r>/<name>`` (Horovod's ``output_filename`` layout)."""

    def __init__(self, folder: str, name: str):
        self.folder, self.name, self.files = folder, name, {}

    def write(self, text: str) -> int:
        for line in text.splitlines(keepends=True):
            match = _RANK_LINE.fullmatch(line)
            rank, body = (match.group(1), match.group(2)) if match else ("driver", line)
            self._file(rank).write(body)
        return len(text)

    def flush(self) -> None:
        for f in self.files.values():
            f.flush()

    def _file(self, rank: str):
        if rank not in self.files:
            folder = os.path.join(self.folder, f"rank.{rank}")
            os.makedirs(folder, exist_ok=True)
            self.files[rank] = open(os.path.join(folder, self.name), "a")  # noqa: SIM115
        return self.files[rank]

    def __enter__(self) -> RankFiles:
        return self

    def __exit__(self, *exc) -> None:
        for f in self.files.values():
            f.close()
