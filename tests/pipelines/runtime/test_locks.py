"""The writer lock's fence on a local root (pipelines/runtime/locks.py `LocalFence`): a micro-batch of a run that is no
longer the holder (over Spark Connect, the query of a killed run goes on in the server) stops before committing."""

from __future__ import annotations

import pickle

import pytest

from pipelines.runtime.locks import LeaseLostError, lock_state, writer_lock


def test_a_local_fence_passes_for_its_holder_and_fails_once_another_run_holds_the_lock(tmp_path):
    with writer_lock(tmp_path, "payments", 5) as fence:
        fence()
        shipped = pickle.loads(pickle.dumps(fence))  # as the server's Python worker gets it
        shipped()
        assert lock_state(tmp_path, "payments")["held"]
    with writer_lock(tmp_path, "payments", 5) as later:
        later()
        with pytest.raises(LeaseLostError, match="no longer holds the writer lock"):
            shipped()
    state = lock_state(tmp_path, "payments")  # the line, token included, still names the last holder
    assert not state["held"] and state["pid"] is not None and state["since"] is not None
