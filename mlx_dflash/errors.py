"""One exception type for everything a user can get wrong.

The CLI prints its message as one sentence and exits non-zero; anything else is a bug and
keeps its traceback.
"""


class DFlashError(Exception):
    """A user-facing problem: bad input, missing or mismatched model, corrupt weights."""


class NoDrafterKnown(DFlashError):
    """No published drafter is registered for a target the user named no drafter for."""
