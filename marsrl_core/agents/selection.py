"""Input selection for downstream agents: which upstream outputs get a Verifier or Corrector group.

Each downstream agent picks `k` inputs per problem and turn from the previous agent's finished
outputs. Strategies (the paper's ablation found adaptive > balanced > random):
- `adaptive`: prefer the informative inputs (the Verifier: incorrect solutions; the Corrector:
  Verifier outputs that rightly flagged an incorrect solution); each pick is instead uniformly random
  with probability `explore`, so the other kind is still seen;
- `balanced`: alternate between preferred and other inputs while both remain;
- `random`: uniform without replacement.

Deliberate simplification: "preferred" is a yes/no property; no scoring beyond it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def select_inputs(
    candidates: Sequence[T],
    k: int,
    strategy: str,
    is_preferred: Callable[[T], bool],
    rng: random.Random,
    explore: float = 0.0,
) -> list[T]:
    """Pick up to `k` distinct candidates."""
    pool = list(candidates)
    if strategy == "random":
        return rng.sample(pool, min(k, len(pool)))
    preferred = [c for c in pool if is_preferred(c)]
    other = [c for c in pool if not is_preferred(c)]
    rng.shuffle(preferred)
    rng.shuffle(other)
    picks: list[T] = []
    if strategy == "balanced":
        take_preferred = True
        while len(picks) < k and (preferred or other):
            source = preferred if (take_preferred and preferred) or not other else other
            picks.append(source.pop())
            take_preferred = not take_preferred
        return picks
    if strategy == "adaptive":
        while len(picks) < k and (preferred or other):
            if rng.random() < explore:
                index = rng.randrange(len(preferred) + len(other))
                source = preferred if index < len(preferred) else other
                picks.append(source.pop(index if source is preferred else index - len(preferred)))
            else:
                picks.append((preferred or other).pop())
        return picks
    raise ValueError(f"selection={strategy!r}: expected adaptive, balanced or random")
