"""The run events a process records in the store's `run_events` table for the others to see.

- `ROLLOUTS_FINISHED`: a run's rollouts have ended; its learner trains on what is left, then stops.
- `STOP_REQUESTED`: a split run's rollout side starts no new batch (those running finish).
- `batch_done(b)`: batch `b` has been decoded to its end; a resumed run skips it.
- `STORE_LOCK_RETRIES`: written when a split-run process ends: "<process>:<retries>".
- `DIVERGED`: the policy diverged (`divergence.PolicyDiverged`, its message in the detail): every process of the
  run stops, the learner before its next step, the rollouts without starting a batch.
"""

from __future__ import annotations

ROLLOUTS_FINISHED = "rollouts_finished"
STOP_REQUESTED = "stop_requested"
STORE_LOCK_RETRIES = "store_lock_retries"
BATCH_DONE = "batch_done:"
DIVERGED = "diverged"


def batch_done(batch_index: int) -> str:
    return f"{BATCH_DONE}{batch_index}"
