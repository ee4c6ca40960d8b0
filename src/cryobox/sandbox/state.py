"""A sandbox's lifecycle as a guarded state machine.

::

    creating ──> running ──> killed
        │         │    ^
        │         v    │
        │       paused ──> resuming ──> running     (a refused resume stays paused)
        │
        └─────────────────────────────> dead        (its VM or supervisor died unasked)

Every operation names the states it needs; :func:`require` raises a
:class:`~cryobox.errors.StateError` that says which state the sandbox is in
and which it needed, instead of failing three layers down.
"""

from __future__ import annotations

from cryobox.errors import StateError
from cryobox.models import SandboxState as SandboxState  # the names: part of the interface

_ENDS = (SandboxState.KILLED, SandboxState.DEAD)
TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    SandboxState.CREATING: frozenset({SandboxState.RUNNING, *_ENDS}),
    SandboxState.RUNNING: frozenset({SandboxState.PAUSED, *_ENDS}),
    SandboxState.PAUSED: frozenset({SandboxState.RESUMING, *_ENDS}),
    SandboxState.RESUMING: frozenset({SandboxState.RUNNING, SandboxState.PAUSED, *_ENDS}),
    SandboxState.KILLED: frozenset(),
    SandboxState.DEAD: frozenset(),
}


def require(
    sandbox_id: str, state: SandboxState, allowed: tuple[SandboxState, ...], action: str
) -> None:
    """Raise StateError unless ``state`` is one of ``allowed``."""
    if state not in allowed:
        raise StateError(sandbox_id, state.value, [s.value for s in allowed], action)


def check_transition(sandbox_id: str, current: SandboxState, target: SandboxState) -> None:
    """Raise StateError when the state machine has no edge from ``current`` to ``target``."""
    if target not in TRANSITIONS[current]:
        allowed = [s for s, targets in TRANSITIONS.items() if target in targets]
        raise StateError(
            sandbox_id, current.value, [s.value for s in allowed], f"make {target.value}"
        )
