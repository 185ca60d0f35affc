"""Names that become paths in the checkpoint daemon: job names, ranks, steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrixpool_recovery import errors, names


@pytest.mark.parametrize("job", ["llm", "ns.llm-7b", "a", "A_1.b-2", "x" * 253], ids=repr)
def test_plain_job_names_are_accepted(job: str) -> None:
    assert names.job(job) == job


ESCAPING = ["", "..", "../evil", "a/../b", "/etc", "a/b", "a\\b", ".hidden", "trailing."]
MISLEADING = ["a..b", "nul\x00", "sp ace", "x" * 254, "é"]


@pytest.mark.parametrize("job", ESCAPING + MISLEADING, ids=repr)
def test_names_that_could_escape_or_mislead_are_refused(job: str) -> None:
    with pytest.raises(errors.InvalidNameError, match="invalid job name"):
        names.job(job)


@pytest.mark.parametrize(
    ("text", "value"), [("0", 0), ("17", 17), (5, 5)], ids=["zero", "text", "an int"]
)
def test_ranks_are_plain_non_negative_integers(text: str | int, value: int) -> None:
    assert names.rank(text) == value


@pytest.mark.parametrize("text", ["-1", "1e3", "../1", "", " 1", True, "١"], ids=repr)
def test_other_ranks_are_refused(text: str | int) -> None:
    with pytest.raises(errors.InvalidNameError):
        names.rank(text)


def test_steps_sort_by_directory_name() -> None:
    assert sorted([names.step_dir(100), names.step_dir(20)]) == [
        names.step_dir(20),
        names.step_dir(100),
    ]


def test_a_path_resolving_outside_the_root_is_refused(tmp_path: Path) -> None:
    assert names.inside(tmp_path, "job", "step") == tmp_path / "job" / "step"
    with pytest.raises(errors.InvalidNameError, match="escapes"):
        names.inside(tmp_path, "..", "elsewhere")
