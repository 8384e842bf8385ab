"""One exception type for everything a user can get wrong.

The CLI prints its message as one sentence and exits non-zero; anything else is a bug and
keeps its traceback.
"""


class DFlashError(Exception):
    """A user-facing problem: bad input, missing or mismatched model, corrupt weights."""
