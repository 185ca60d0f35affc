"""matrixpool_recovery.credentials, and how the daemon's command line takes the cluster secret.

The scopes themselves are exercised on real daemons in tests/checkpoint/test_trust.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from matrixpool_recovery import credentials, daemon

SECRET = "cluster-secret"


def test_each_job_gets_its_own_token() -> None:
    assert credentials.job_token(SECRET, "ml.a") != credentials.job_token(SECRET, "ml.b")


def test_a_token_is_the_same_wherever_it_is_derived() -> None:
    assert credentials.job_token(SECRET, "ml.a") == credentials.job_token(SECRET, "ml.a")
    assert credentials.operator_token(SECRET) == credentials.operator_token(SECRET)


@pytest.mark.parametrize("job", ["operator", "job", "", "ml.a"], ids=repr)
def test_no_job_token_is_the_operator_token(job: str) -> None:
    assert credentials.job_token(SECRET, job) != credentials.operator_token(SECRET)


def test_a_service_token_is_never_the_job_token_of_the_same_uid() -> None:
    uid = "3f1c2a9e-0000-4000-8000-000000000001"
    assert credentials.service_token(SECRET, uid) != credentials.job_token(SECRET, uid)
    assert credentials.service_token(SECRET, uid) != credentials.operator_token(SECRET)
    assert credentials.service_token(SECRET, "a") != credentials.service_token(SECRET, "b")


def test_a_scoped_token_is_the_jobs_or_the_services() -> None:
    assert credentials.scoped_token(SECRET, "job", "x") == credentials.job_token(SECRET, "x")
    assert credentials.scoped_token(SECRET, "service", "x") == credentials.service_token(
        SECRET, "x"
    )
    with pytest.raises(ValueError, match="scope"):
        credentials.scoped_token(SECRET, "operator", "x")


def test_another_secret_gives_other_tokens() -> None:
    assert credentials.job_token("other", "ml.a") != credentials.job_token(SECRET, "ml.a")
    assert credentials.operator_token("other") != credentials.operator_token(SECRET)


def test_a_token_does_not_contain_the_secret() -> None:
    token = credentials.operator_token(SECRET)
    assert SECRET not in token
    assert len(token) == 64  # hex of SHA-256


def test_matches_compares_whole_tokens() -> None:
    token = credentials.job_token(SECRET, "ml.a")
    assert credentials.matches(token, token)
    assert not credentials.matches(token[:-1], token)
    assert not credentials.matches("", token)


def test_the_secret_file_is_read_stripped(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("  s3cret\n")
    assert credentials.read_secret(path) == "s3cret"


def test_an_empty_secret_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no secret"):
        credentials.read_secret(path)


def folders(tmp_path: Path) -> list[str]:
    return ["--memory-dir", str(tmp_path / "memory"), "--data-dir", str(tmp_path / "disk")]


def test_the_daemon_finds_its_secret_file_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    monkeypatch.setenv(daemon.SECRET_ENV, str(path))

    args = daemon.arguments([*folders(tmp_path), "--persistent-root", str(tmp_path / "shared")])

    assert args.secret == "s3cret"
    assert args.persistent_root == tmp_path / "shared"


def test_the_daemon_will_not_start_without_a_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(daemon.SECRET_ENV, raising=False)

    with pytest.raises(SystemExit):
        daemon.arguments(folders(tmp_path))

    assert "the cluster secret is needed" in capsys.readouterr().err


def test_the_default_persistent_root_is_apart_from_the_default_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    monkeypatch.setenv(daemon.SECRET_ENV, str(path))

    args = daemon.arguments([])

    assert args.persistent_root == daemon.PERSISTENT_ROOT
    assert daemon._overlap(args) == ""
