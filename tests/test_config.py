"""Option validation of HyLoConfig (hylo/config.py), directly and through HyLoPreconditioner.

Invalid options raise a ValueError naming the option; rank/rank_ratio and ``rows_kept``.
"""

from __future__ import annotations

import pytest

from hylo import HyLoConfig, HyLoPreconditioner
from tests.kit.models import classifier_mlp

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------- rank and rank_ratio
@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.5, float("nan")])
def test_invalid_rank_ratio(value: float) -> None:
    with pytest.raises(ValueError, match="rank_ratio"):
        HyLoConfig(solver="kid", rank_ratio=value)
    with pytest.raises(ValueError, match="rank_ratio"):
        HyLoPreconditioner(classifier_mlp(), solver="kis", rank_ratio=value)


@pytest.mark.parametrize("value", [0, -3, 2.5])
def test_invalid_rank(value: float) -> None:
    with pytest.raises(ValueError, match=r"\brank\b"):
        HyLoConfig(solver="kis", rank=value)
    with pytest.raises(ValueError, match=r"\brank\b"):
        HyLoPreconditioner(classifier_mlp(), solver="kid", rank=value)


def test_rows_kept() -> None:
    assert HyLoConfig(rank_ratio=0.1).rows_kept(64) == 6
    assert HyLoConfig(rank_ratio=1e-9).rows_kept(64) == 1
    assert HyLoConfig(rank_ratio=1.0).rows_kept(64) == 64
    assert HyLoConfig(rank_ratio=0.1, rank=9).rows_kept(64) == 9  # rank overrides rank_ratio
    assert HyLoConfig(rank=100).rows_kept(64) == 64
