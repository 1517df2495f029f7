"""RankLog: a rank's prints, stderr and logging records reach chunk files in the store,
stdout apart from stderr and logging."""

import logging
import sys
import time

from spark_estimator import Store
from spark_estimator.worker.observe.run_log import OutputCapture, RankLog


def chunks(store: Store, run_id: str, rank: int) -> list[str]:
    return sorted(p for p in store.fs.find(store.run(run_id).rank_logs(rank)))


def test_prints_stderr_and_logging_are_captured_in_order_and_still_written_through(
    tmp_path, capsys
):
    store = Store.create(str(tmp_path / "store"))
    with RankLog(store, "r", "launch", rank=1, attempt=0):
        print("first line")
        sys.stderr.write("a warning\nwithout end")
        logging.getLogger("user.code").info("logged %d", 3)
        logging.getLogger("user.code").debug("below INFO: not captured")
    paths = chunks(store, "r", 1)
    assert paths and all(p.split("/")[-1].startswith("launch-000000000000-") for p in paths)
    out = "".join(store.read_bytes(p).decode() for p in paths if not p.endswith(".err.log"))
    err = "".join(store.read_bytes(p).decode() for p in paths if p.endswith(".err.log"))
    assert out == "first line\n"  # each stream in its own chunks, in order
    assert err == "a warning\nINFO user.code: logged 3\nwithout end\n"
    out, err = capsys.readouterr()  # the executor's own log still gets everything
    assert out == "first line\n" and err == "a warning\nwithout end"
    assert logging.getLogger().level == logging.WARNING  # restored
    assert not store.exists(store.run("r").progress)  # rank 1 reports no progress


def test_lines_are_flushed_while_the_task_runs(tmp_path, monkeypatch):
    monkeypatch.setattr("spark_estimator.worker.observe.run_log.FLUSH_S", 0.05)
    monkeypatch.setattr("spark_estimator.worker.observe.run_log.CHUNK_S", 0.05)
    store = Store.create(str(tmp_path / "store"))
    with RankLog(store, "r", "launch", rank=0, attempt=2) as log:
        print("early")
        log.report(epoch=1, epochs=2, step=3, steps=4, loss=0.5, last=None)
        for _ in range(100):
            if chunks(store, "r", 0) and store.exists(store.run("r").progress):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("nothing flushed while the task ran")
        assert store.read_json(store.run("r").progress) == {
            "launch_id": "launch",
            "epoch": 1,
            "epochs": 2,
            "step": 3,
            "steps": 4,
            "loss": 0.5,
            "last": None,
        }
    assert chunks(store, "r", 0)[0].split("/")[-1] == "launch-000000000002-000001.log"
    assert store.exists(store.run("r").logs)


class FailsFirstLogWrite(Store):
    """A store whose first write of a log chunk fails, as a store that failed for a moment."""

    failed = False

    def write_bytes(self, path, data):
        if path.endswith(".log") and not self.failed:
            self.failed = True
            raise OSError("injected: the store failed for a moment")
        super().write_bytes(path, data)


def test_lines_are_kept_until_written_when_the_store_fails_for_a_moment(tmp_path, monkeypatch):
    monkeypatch.setattr("spark_estimator.worker.observe.run_log.FLUSH_S", 0.05)
    monkeypatch.setattr("spark_estimator.worker.observe.run_log.CHUNK_S", 0.05)
    store = FailsFirstLogWrite.create(str(tmp_path / "store"))
    with RankLog(store, "r", "launch", rank=0, attempt=0):
        print("line 1")
        for _ in range(100):  # the background flush meets the failure
            if store.failed:
                break
            time.sleep(0.05)
        print("line 2")
    assert store.failed
    text = "".join(store.read_bytes(p).decode() for p in chunks(store, "r", 0))
    assert text == "line 1\nline 2\n"


def test_the_last_lines_survive_a_failed_final_write(tmp_path):
    store = FailsFirstLogWrite.create(str(tmp_path / "store"))
    with RankLog(store, "r", "launch", rank=1, attempt=0):
        print("the failing rank's last words")  # written only at the end, which fails once
    assert store.failed
    text = "".join(store.read_bytes(p).decode() for p in chunks(store, "r", 1))
    assert text == "the failing rank's last words\n"


def test_a_record_that_a_handler_writes_to_the_captured_stderr_is_captured_once():
    """As the ``lightning`` package does on import: a StreamHandler of its own on
    ``sys.stderr`` (the rank's captured stream), whose records also reach the root."""
    first: list[tuple[str, str]] = []
    later: list[tuple[str, str]] = []
    logger = logging.getLogger("lib.with.handler")
    try:
        with OutputCapture(lambda stream, line: first.append((stream, line)), echo=False):
            handler = logging.StreamHandler()  # on sys.stderr as it is now: the capture's
            handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.info("once")
            logging.getLogger("lib.with.handler.child").warning("once too")
            logging.getLogger("other").info("from the root only")
        # the next task of a reused Python worker: the module stays imported, its handler
        # on the first task's stream; this task's capture gets the handler's lines, once
        with OutputCapture(lambda stream, line: later.append((stream, line)), echo=False):
            logger.info("next task")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert first == [
        ("stderr", "INFO: once"),
        ("stderr", "WARNING: once too"),
        ("stderr", "INFO other: from the root only"),
    ]
    assert later == [("stderr", "INFO: next task")]
