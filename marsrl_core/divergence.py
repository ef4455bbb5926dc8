"""The error that stops a run whose policy diverged.

Raised by the learner when an update leaves a parameter non-finite or past `learner.max_weight_abs`,
and by the rollouts when the engine's log-probs come back non-finite; never retried (the same weights
diverge again). The run's processes record it as the `diverged` run event (`runtime/events.py`) and
end with its one line.
"""

from __future__ import annotations


class PolicyDiverged(RuntimeError):
    """The policy's weights or its rollouts' log-probs are non-finite or absurd: the run cannot go on
    with its settings. The message is one line that names the step or version, the cause and the
    setting to look at; nothing non-finite was committed."""
