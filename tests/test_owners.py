"""``Owners.failing_at``: whatever escapes a step once its messages are posted leaves the
exchange unusable (its messages may still land in the step's buffers), for both exchanges."""

from __future__ import annotations

import pytest

from datastore.errors import DataStoreError, ExchangeTimeout
from datastore.sources.owners import ExchangeSetup, Owners


class _Exchange(Owners):
    kind = "test"


def _owners() -> Owners:
    setup = ExchangeSetup(
        owner=None, data_world=1, spatial_size=1, store=None, fields={0: []}, gather=None,
        timeout=1.0,
    )  # fmt: skip
    return _Exchange(0, setup)


@pytest.mark.parametrize(
    "error",
    [ExchangeTimeout("step 3 timed out"), OSError("a sample's file vanished"), KeyboardInterrupt()],
    ids=["timeout", "read-error", "interrupt"],
)
def test_any_error_of_a_step_marks_the_exchange_failed_after_abandoning(error):
    owners, abandoned = _owners(), []
    with pytest.raises(type(error)), owners.failing_at(3, lambda: abandoned.append(True)):
        raise error
    assert abandoned == [True] and owners.failed_at == 3
    with pytest.raises(DataStoreError) as info:
        owners.usable()
    assert str(info.value) == (
        "the test exchange failed at step 3 and cannot be used again (messages of that step "
        "may still arrive): make a new loader"
    )


def test_a_step_that_completes_leaves_the_exchange_usable():
    owners, abandoned = _owners(), []
    for step in range(3):
        owners.usable()
        with owners.failing_at(step, lambda s=step: abandoned.append(s)):
            pass
    assert owners.failed_at is None and abandoned == []
