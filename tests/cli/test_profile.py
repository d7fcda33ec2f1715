"""The profile/validate subcommands: registered, and bad input is one line with exit status 2."""
from __future__ import annotations

from tasks.cli.main import main


def test_validate_refuses_a_profile_of_another_workload(tmp_path, capsys, shipped_profile_path):
    status = main(["validate", "--quick", "--profile", str(shipped_profile_path),
                   "--artifacts-dir", str(tmp_path / "a"), "--profiles-dir", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and "profiles 'resnet110-cifar100'" in err and "transformer-lm" in err


def test_too_few_iterations_and_unknown_workload_are_one_line(tmp_path, capsys):
    common = ["--artifacts-dir", str(tmp_path / "a"), "--profiles-dir", str(tmp_path / "p")]
    assert main(["profile", "--quick", "--iterations", "4", *common]) == 2
    assert "4 iterations are too few to measure" in capsys.readouterr().err
    assert main(["profile", "--quick", "--workload", "nosuch", *common]) == 2
    assert "unknown workload 'nosuch'" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_the_validation_table_shows_each_clusters_gpus_per_worker_and_the_split_errors(monkeypatch, shipped_profile_path):
    from tasks.cli.profile import validation_lines
    from tasks.core.profile import load_profile
    from tests.helpers import validated_with_fake_runs

    report = validated_with_fake_runs(monkeypatch, load_profile(shipped_profile_path),
                                      [{"p3.2xlarge": 2}, {"g3.8xlarge": 3}], {"p3.2xlarge=2": 11.0, "g3.8xlarge=3": 8.0})
    lines = validation_lines(report)
    assert "GPUs/worker" in lines[0]
    assert lines[1].split()[:2] == ["p3.2xlarge=2", "1"] and lines[2].split()[:2] == ["g3.8xlarge=3", "2"]
    assert ("median time error by GPUs per worker: one-GPU clusters 9.1%, clusters with multi-GPU workers 25.0%"
            in lines)
