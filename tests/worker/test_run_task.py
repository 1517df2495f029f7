"""run_script: a script as ``__main__`` on a task, as ``python train.py`` (and torchrun) run
it: its ``sys.argv[0]`` and ``__file__``, and the modules beside it importable."""

import os
import sys
import traceback

import pytest

from spark_estimator.worker.run_task import Script, run_script

SCRIPT = """
import sys
import datautils
print("argv", sys.argv)
print("file", __file__)
print("main", sys.modules["__main__"].__dict__ is globals())
print("datautils", datautils.NAME, datautils.__file__.endswith("datautils.py"))
"""


def script_at(folder, source: str = SCRIPT, args=("--epochs", "2"), modules=None) -> Script:
    """The script ``folder/train.py`` as the driver reads it: given as a path relative to
    this process's working directory, with ``modules`` shipped beside it (their bytes by
    file name)."""
    file = os.path.join(str(folder), "train.py")
    return Script(os.path.relpath(file), file, source, tuple(args), dict(modules or {}))


def written(folder, source: str = SCRIPT, **beside: str) -> Script:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text(source)
    for name, text in beside.items():
        (folder / name).write_text(text)
    return script_at(folder, source)


def test_the_script_runs_where_it_lies_with_its_folder_on_sys_path(tmp_path, capsys):
    script = written(tmp_path / "project", **{"datautils.py": "NAME = 'on disk'\n"})
    path_before, main_before = list(sys.path), sys.modules["__main__"]
    run_script(script)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"argv {[script.path, '--epochs', '2']}",  # as given, as `python train.py` has it
        f"file {tmp_path / 'project' / 'train.py'}",  # absolute, as Python 3.9+ sets it
        "main True",
        "datautils on disk True",
    ]
    # a reused Python worker keeps neither the folder on sys.path nor the modules from it
    assert sys.path == path_before and sys.modules["__main__"] is main_before
    assert "datautils" not in sys.modules


def test_where_the_folder_is_not_here_the_shipped_modules_are_imported(tmp_path, capsys):
    absent = tmp_path / "on-the-driver-only"  # a cluster's executor does not see it
    modules = {"datautils.py": b"NAME = 'shipped'\n"}
    run_script(script_at(absent, modules=modules))
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"file {absent / 'train.py'}"  # the driver's path, still
    assert out[3] == "datautils shipped True"
    assert "datautils" not in sys.modules


def test_a_script_that_differs_from_the_file_at_its_path_runs_with_the_shipped_modules(
    tmp_path, capsys
):
    """An executor whose file at the script's path is another version (an older image):
    the driver's script and the modules shipped with it, not that folder's."""
    stale = written(
        tmp_path / "app", "print('the old one')\n", **{"datautils.py": "NAME = 'old'\n"}
    )
    script = script_at(tmp_path / "app", modules={"datautils.py": b"NAME = 'new'\n"})
    assert stale.source != script.source
    run_script(script)
    assert capsys.readouterr().out.splitlines()[3] == "datautils new True"


def test_a_failing_scripts_traceback_names_its_path_and_shows_its_lines(tmp_path):
    source = "x = 1\nraise ValueError('boom in the script')\n"
    script = script_at(tmp_path / "elsewhere", source)  # no file here: lines from the source
    with pytest.raises(ValueError, match="boom in the script") as failure:
        run_script(script)
    text = "".join(traceback.format_exception(failure.value))
    assert f'File "{script.file}", line 2, in <module>' in text
    assert "raise ValueError('boom in the script')" in text


def test_sys_exit_0_is_success_and_another_code_raises(tmp_path):
    run_script(script_at(tmp_path, "import sys\nsys.exit(0)\n"))
    run_script(script_at(tmp_path, "import sys\nsys.exit()\n"))
    with pytest.raises(SystemExit) as failure:
        run_script(script_at(tmp_path, "import sys\nsys.exit(3)\n"))
    assert failure.value.code == 3
