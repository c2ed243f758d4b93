"""vit_keras.tools.runs.run_folder: the folder's lock, what a finished run is, clearing and the
temporary files of interrupted writes."""

import json
import os
import signal
import subprocess
import sys

import pytest

from vit_keras.tools.runs.run_folder import RunFolder, RunFolderBusyError, RunFolderError

from conftest import REPO_ROOT

pytestmark = [pytest.mark.backend_independent,
              pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")]


def test_a_held_folder_refuses_a_second_holder_naming_the_first(tmp_path):
    folder = RunFolder(tmp_path / "run")
    with folder.locked():
        holder = json.loads(open(folder.lock).read())
        assert holder["pid"] == os.getpid()
        # flock is per open file: a second open, even in this process, is another holder.
        with pytest.raises(RunFolderBusyError, match=f"in use by process {os.getpid()} on "):
            with RunFolder(tmp_path / "run").locked():
                pass
    assert not os.path.exists(folder.lock)  # removed when the run ends
    with folder.locked():  # and free again
        pass


def test_the_lock_of_a_killed_process_does_not_hold_the_folder(tmp_path):
    code = ("import os, signal, sys\n"
            "from vit_keras.tools.runs.run_folder import RunFolder\n"
            "with RunFolder(sys.argv[1]).locked():\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    folder = RunFolder(tmp_path / "run")
    assert json.loads(open(folder.lock).read())["pid"] != os.getpid()  # the dead process's file
    with folder.locked():
        assert json.loads(open(folder.lock).read())["pid"] == os.getpid()


def test_a_folder_that_cannot_be_written_is_a_run_folder_error(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(RunFolderError, match="Cannot write the run folder .*file/run") as error:
        with RunFolder(tmp_path / "file" / "run").locked():
            pass
    assert "\n" not in str(error.value)


def test_a_folder_with_metrics_holds_a_finished_run(tmp_path):
    folder = RunFolder(tmp_path / "run").create()
    assert not folder.is_complete()
    open(folder.model, "wb").close()  # a model alone is not a finished run: it is every epoch's
    assert not folder.is_complete()
    folder.write_metrics({"test_accuracy": 0.5})
    assert folder.is_complete()


def test_clear_removes_everything_but_the_lock(tmp_path):
    folder = RunFolder(tmp_path / "run")
    with folder.locked():
        folder.write_metrics({})
        os.makedirs(os.path.join(folder.backup, "nested"))
        open(folder.model, "wb").close()
        folder.clear()
        assert os.listdir(folder.path) == ["lock"]


def test_temporary_files_of_interrupted_writes_are_found_and_removed(tmp_path):
    folder = RunFolder(tmp_path / "run").create()
    os.makedirs(folder.backup)
    kept = ["model.keras", "metrics.json", os.path.join("backup", "epoch-3.weights.h5"),
            os.path.join("backup", "training_metadata.json")]
    stale = ["model.tmp-123.keras", "metrics.json.tmp-123", "flags.txt.tmp-9",
             os.path.join("backup", "saving-123.weights.h5"),
             os.path.join("backup", "training_metadata.json.tmp-123")]
    for name in kept + stale:
        open(os.path.join(folder.path, name), "wb").close()
    # An fsdp backup: a committed Orbax checkpoint, and one a killed run had not committed.
    for name in ("epoch-2.orbax", "epoch-3.orbax.orbax-checkpoint-tmp-1795789267"):
        os.makedirs(os.path.join(folder.backup, name, "d"))
        open(os.path.join(folder.backup, name, "d", "shard"), "wb").close()
    kept.append(os.path.join("backup", "epoch-2.orbax", "d", "shard"))
    stale.append(os.path.join("backup", "epoch-3.orbax.orbax-checkpoint-tmp-1795789267"))
    assert sorted(folder.remove_temporary_files()) == sorted(stale)
    assert folder.temporary_files() == []
    for name in kept:
        assert os.path.exists(os.path.join(folder.path, name)), name
    assert sorted(os.listdir(folder.backup)) == ["epoch-2.orbax", "epoch-3.weights.h5",
                                                 "training_metadata.json"]


def test_history_rows_leave_out_the_values_csvlogger_could_not_fill(tmp_path):
    """A fit without validation data (pre-training) gets a `val_loss` column of NA; an epoch run
    again after a resume keeps its last row."""
    folder = RunFolder(tmp_path / "run").create()
    assert folder.read_history() == []
    with open(folder.history, "w") as f:
        f.write("epoch,loss,val_loss\n0,6.5,NA\n1,5.0,NA\n1,4.5,NA\n")
    assert folder.read_history() == [{"epoch": 0, "loss": 6.5}, {"epoch": 1, "loss": 4.5}]


def test_a_history_row_a_full_disk_cut_short_is_cut_when_the_run_resumes(tmp_path):
    """CSVLogger appends the resumed run's rows: without the cut, the first one would continue
    the unfinished line (`1,0.61,0.65,0.9`), and reading the history would raise."""
    from vit_keras.tools.runs import training

    folder = RunFolder(tmp_path / "run").create()
    with open(folder.history, "w") as f:
        f.write("epoch,accuracy,loss\n0,0.5,1.2\n1,0.6")  # the disk filled within epoch 1's row
    lines = []
    assert training.finished_run(folder, log=lines.append) is None  # the run resumes
    assert [line for line in lines if "Cut the unfinished last row" in line], lines
    with open(folder.history, "a") as f:  # what CSVLogger(append=True) then writes
        f.write("1,0.65,0.9\n2,0.7,0.8\n")
    assert [row["accuracy"] for row in folder.read_history()] == [0.5, 0.65, 0.7]
    assert not folder.cut_unfinished_history_row()  # a whole file is left as it is


def test_history_rows_that_are_no_rows_are_left_out(tmp_path):
    folder = RunFolder(tmp_path / "run").create()
    with open(folder.history, "w") as f:
        f.write("epoch,accuracy,loss\n0,0.5,1.2\n1,0.61,0.65,0.9\n2,0.7,0.\x00\n3,0.8,0.7\n")
    assert [row["epoch"] for row in folder.read_history()] == [0, 3]


def test_overwrite_says_it_deletes_only_once_the_folder_passed_as_a_run_folder(tmp_path):
    from vit_keras.tools.runs import training

    folder = RunFolder(tmp_path / "Documents").create()
    (tmp_path / "Documents" / "thesis.tex").write_text("years of work")
    lines = []
    with pytest.raises(RunFolderError, match="which no run writes"):
        training.finished_run(folder, overwrite=True, log=lines.append)
    assert not [line for line in lines if "delet" in line], lines
    os.remove(tmp_path / "Documents" / "thesis.tex")
    folder.write_metrics({"test_accuracy": 0.5})
    training.finished_run(folder, overwrite=True, log=lines.append)
    assert any("deleted" in line for line in lines), lines


def test_a_file_that_fills_the_disk_while_written_is_one_error_and_the_old_one_stays(tmp_path):
    """A run folder's flags, metrics, class names and training curves are written by
    `atomic_write_bytes` (its model by `atomic_save_model`)."""
    import resource  # POSIX only

    from vit_keras.tools.runs import run_folder

    path = str(tmp_path / "training_curves.png")
    run_folder.atomic_write_bytes(b"the last epoch's curves", path)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    # Writes past 16 KiB fail with EFBIG, as on a full disk with ENOSPC (Python ignores SIGXFSZ).
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, limits[1]))
    try:
        with pytest.raises(run_folder.RunFolderWriteError) as raised:
            run_folder.atomic_write_bytes(bytes(64 * 1024), path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(raised.value).startswith(f"Cannot write {path}: File too large. Free space")
    with open(path, "rb") as f:
        assert f.read() == b"the last epoch's curves"
    assert os.listdir(tmp_path) == ["training_curves.png"]
