"""How the operator finds the cluster checkpoint secret and derives its tokens (checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrixpool.k8s import daemonclient
from matrixpool_recovery import credentials


@pytest.fixture
def secret_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in (daemonclient.SECRET_FILE_ENV, daemonclient.OLD_SECRET_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    return path


@pytest.mark.parametrize(
    "variable", [daemonclient.SECRET_FILE_ENV, daemonclient.OLD_SECRET_FILE_ENV], ids=str
)
def test_the_operator_asks_with_the_operator_token(
    secret_file: Path, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, str(secret_file))

    assert daemonclient.secret() == "s3cret"
    assert daemonclient.token() == credentials.operator_token("s3cret")


def test_a_jobs_pods_get_the_token_of_that_job(
    secret_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(daemonclient.SECRET_FILE_ENV, str(secret_file))

    token = daemonclient.job_token_for("ml.llm")

    assert token == credentials.job_token("s3cret", "ml.llm")
    assert token != daemonclient.job_token_for("ml.other")
    assert token != daemonclient.token()


@pytest.mark.parametrize("content", [None, "\n"], ids=["no file", "an empty file"])
def test_without_a_secret_the_operator_has_no_token(
    secret_file: Path, monkeypatch: pytest.MonkeyPatch, content: str | None
) -> None:
    if content is None:
        secret_file.unlink()
    else:
        secret_file.write_text(content)
    monkeypatch.setenv(daemonclient.SECRET_FILE_ENV, str(secret_file))

    assert daemonclient.token() is None
    assert daemonclient.job_token_for("ml.llm") is None
