"""examples/provenance.py: a benchmark record names its command relative to the repository and to $OUT, never by
the folders of the machine that ran it."""
from __future__ import annotations

from pathlib import Path

from provenance import REPOSITORY, relative_command


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
