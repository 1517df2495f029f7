"""FitMonitor: the ranks' chunks become driver log lines; progress drives a tqdm bar."""

import logging
import re
import sys
import time

import pytest

from spark_estimator import Store
from spark_estimator.driver import monitor as monitor_module
from spark_estimator.driver.monitor import FitMonitor, logging_configured
from spark_estimator.worker.observe.run_log import RankLog


@pytest.fixture
def store(tmp_path):
    return Store.create(str(tmp_path / "store"))


def write_rank(store, rank, lines, launch="L", attempt=0, progress=None):
    with RankLog(store, "r", launch, rank, attempt) as log:
        for line in lines:
            print(line)
        if progress:
            log.report(**progress)


def test_lines_of_this_launch_are_logged_per_rank_once_and_kept_for_errors(store, caplog):
    write_rank(store, 0, ["zero a", "zero b"])
    write_rank(store, 1, ["one a"])
    write_rank(store, 1, ["older fit"], launch="K")  # another launch of the same run_id
    caplog.set_level(logging.INFO, logger="spark_estimator.worker")
    with FitMonitor(store, "r", "L", verbose=False) as monitor:
        pass
    monitor.poll()  # read again: nothing new
    lines = [r.getMessage() for r in caplog.records if r.name == "spark_estimator.worker"]
    assert lines == ["[rank 0] zero a", "[rank 0] zero b", "[rank 1] one a"]
    assert monitor.tail(1) == "[rank 1] one a"
    assert monitor.tail() == "[rank 0] zero a\n[rank 0] zero b\n[rank 1] one a"


def test_tail_keeps_the_last_lines(store, monkeypatch):
    monkeypatch.setattr(monitor_module, "TAIL_LINES", 3)
    write_rank(store, 0, [f"line {i}" for i in range(10)])
    with FitMonitor(store, "r", "L", verbose=False) as monitor:
        pass
    assert monitor.tail(0).splitlines() == ["[rank 0] line 7", "[rank 0] line 8", "[rank 0] line 9"]


def test_verbose_draws_a_bar_from_rank_zeros_progress(store, capsys):
    last = {"epoch": 1, "train": {"loss": 2.0}, "validation": {"loss": 1.5}}
    progress = dict(epoch=2, epochs=3, step=5, steps=10, loss=0.25, last=last)
    write_rank(store, 0, [], progress=progress)
    with FitMonitor(store, "r", "L", verbose=True):
        pass
    err = capsys.readouterr().err
    assert "epoch 2/3" in err and "15/30" in err
    assert "loss=0.25" in err and "val_loss=1.5" in err


def test_not_verbose_draws_no_bar(store, capsys):
    write_rank(store, 0, [], progress=dict(epoch=1, epochs=1, step=1, steps=1, loss=1.0, last=None))
    with FitMonitor(store, "r", "L", verbose=False):
        pass
    assert capsys.readouterr().err == ""


def test_logging_counts_as_configured_with_a_real_handler_up_the_chain():
    bare = logging.getLogger("spark_estimator_test_bare")
    bare.propagate = False
    assert not logging_configured(bare)
    bare.addHandler(logging.NullHandler())
    assert not logging_configured(bare)
    child = logging.getLogger("spark_estimator_test_bare.child")
    bare.addHandler(logging.StreamHandler())
    assert logging_configured(child)


@pytest.mark.parametrize(
    "verbose, configured, printed",
    [(True, False, True), (True, True, False), (False, False, False)],
)
def test_lines_are_printed_when_verbose_and_logging_is_not_configured(
    store, capsys, monkeypatch, verbose, configured, printed
):
    monkeypatch.setattr(monitor_module, "logging_configured", lambda log: configured)
    write_rank(store, 0, ["hello"])
    capsys.readouterr()
    with FitMonitor(store, "r", "L", verbose=verbose):
        pass
    assert ("[rank 0] hello" in capsys.readouterr().err) == printed


def test_show_receives_each_line_with_its_stream(store):
    with RankLog(store, "r", "L", 0, 0):
        print("to stdout")
        print("to stderr", file=sys.stderr)
        logging.getLogger("user.code").warning("logged")
    shown = []
    with FitMonitor(store, "r", "L", verbose=False, show=lambda *line: shown.append(line)):
        pass
    assert sorted(shown) == [
        (0, "stderr", "WARNING user.code: logged"),
        (0, "stderr", "to stderr"),
        (0, "stdout", "to stdout"),
    ]


def test_the_bar_starts_at_the_first_step_it_sees_and_rates_only_the_steps_it_saw(store, capsys):
    def report(step):
        progress = dict(epoch=1, epochs=2, step=step, steps=10, loss=1.0, last=None)
        write_rank(store, 0, [], progress=progress)

    report(4)  # steps done before the driver looked: counted, not timed
    with FitMonitor(store, "r", "L", verbose=True) as monitor:
        monitor.poll()
        time.sleep(0.5)
        report(9)
        monitor.poll()
    frames = capsys.readouterr().err.split("\r")
    counts = [int(m) for f in frames for m in re.findall(r"\b(\d+)/20\b", f)]
    assert counts[0] == 4 and counts[-1] == 9, counts  # no jump from 0
    rates = [float(r) for f in frames for r in re.findall(r"([\d.]+)step/s", f)]
    assert rates and max(rates) < 100, rates  # 5 steps in about half a second


def test_in_jupyter_the_saved_text_of_the_bar_is_its_final_state(store, monkeypatch):
    """Jupyter saves a widget's text form as it was displayed: the fit's end updates it,
    so a saved notebook shows the bar at its end, not at the first step seen."""
    pytest.importorskip("ipywidgets")
    from IPython.core.displaypub import CapturingDisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    from tqdm.notebook import tqdm as notebook_tqdm

    shell = InteractiveShell.instance()
    monkeypatch.setattr(shell, "display_pub", CapturingDisplayPublisher())
    monkeypatch.setattr(monitor_module, "tqdm", notebook_tqdm)

    def report(step):
        progress = dict(epoch=2, epochs=2, step=step, steps=6, loss=0.5, last=None)
        write_rank(store, 0, [], progress=progress)

    report(1)  # 7 of 12 steps when the driver first looks
    with FitMonitor(store, "r", "L", verbose=True) as monitor:
        monitor.poll()
        report(6)  # the last step
    shown = [o for o in shell.display_pub.outputs if "text/plain" in o["data"]]
    assert " 58%" in shown[0]["data"]["text/plain"]  # as displayed
    final = shown[-1]
    assert final["update"] and final["transient"] == shown[0]["transient"]  # the same output
    assert "100%" in final["data"]["text/plain"] and "12/12" in final["data"]["text/plain"]
    assert "application/vnd.jupyter.widget-view+json" in final["data"]
