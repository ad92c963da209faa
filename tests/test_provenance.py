"""examples/provenance.py: a benchmark record names its whole command (the launcher's arguments too) relative to the
repository and to $OUT, never by the folders of the machine that ran it, and the commit of the code."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from provenance import REPOSITORY, code_commit, readable_command, relative_command


def test_paths_inside_the_repository_and_the_output_folder_become_relative(tmp_path: Path) -> None:
    repository, out = tmp_path / "x" / "repo", tmp_path / "out"
    argv = [str(repository / "examples" / "bench_e2e.py"), "--config", "flux-dev", "--out", str(out / "e2e-h200"),
            "--calibration", str(repository / "xstage_dit" / "calibrations" / "c.json")]
    assert relative_command(argv, repository, out) == [
        "examples/bench_e2e.py", "--config", "flux-dev", "--out", "e2e-h200",
        "--calibration", "xstage_dit/calibrations/c.json"]


def test_the_output_folder_wins_where_it_lies_inside_the_repository(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    out = repository / "out"
    argv = [str(repository / "examples" / "bench_kernels.py"), "--out", str(out / "kernels-h200")]
    assert relative_command(argv, repository, out) == ["examples/bench_kernels.py", "--out", "kernels-h200"]
    # without $OUT the same path is named from the repository
    assert relative_command(argv, repository, None)[2] == "out/kernels-h200"


def test_relative_and_outside_paths_and_other_arguments_stay_as_given(tmp_path: Path) -> None:
    argv = ["examples/bench_e2e.py", "--steps", "4", "--out", "/elsewhere/e2e", "--height", "-1"]
    assert relative_command(argv, tmp_path / "repo", tmp_path / "out") == argv


def test_the_repository_is_the_checkout_of_the_examples() -> None:
    assert (REPOSITORY / "examples" / "provenance.py").is_file() and (REPOSITORY / "xstage_dit").is_dir()


def test_a_command_reads_as_typed_with_the_launchers_name() -> None:
    assert readable_command(["/usr/bin/python3.11", "/usr/local/bin/torchrun", "--nproc_per_node", "2", "x.py"]) == [
        "torchrun", "--nproc_per_node", "2", "x.py"]
    assert readable_command(["python3", "-m", "torch.distributed.run", "--nnodes", "1", "x.py"]) == [
        "python", "-m", "torch.distributed.run", "--nnodes", "1", "x.py"]
    assert readable_command(["/opt/venv/bin/python", "/opt/venv/bin/accelerate", "launch", "x.py"]) == [
        "accelerate", "launch", "x.py"]
    assert readable_command(["python3", "examples/bench_e2e.py", "--steps", "4"]) == [
        "python", "examples/bench_e2e.py", "--steps", "4"]


def test_a_rank_names_the_whole_torchrun_command(tmp_path: Path) -> None:
    script = tmp_path / "launched.py"
    script.write_text("import provenance\nprint('LAUNCH', provenance.launch_command())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY / "examples"), str(REPOSITORY),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                           "--master_port", "0", str(script), "--steps", "3"],
                          capture_output=True, text=True, env=env, timeout=240, check=True)
    line = next(line for line in done.stdout.splitlines() if line.startswith("LAUNCH"))
    assert line.split(" ", 1)[1] == repr(["python", "-m", "torch.distributed.run", "--nproc_per_node", "1",
                                          "--master_port", "0", str(script), "--steps", "3"])


def test_the_commit_comes_from_the_variable_where_it_is_set_else_from_git(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("XSTAGE_COMMIT", raising=False)
    commit = code_commit()
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", commit), commit
    monkeypatch.setenv("XSTAGE_COMMIT", "0123abcd")
    assert code_commit(tmp_path) == "0123abcd"
    assert code_commit() == "0123abcd"  # a copy whose .git is not the code's
    monkeypatch.delenv("XSTAGE_COMMIT")
    assert code_commit(tmp_path) == "unknown"
