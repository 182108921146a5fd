"""User-facing errors.

`UserError` is for bad input a user can fix (unknown names, missing checkpoints, impossible
budgets, empty prompts). The command-line edges (`run.py`, scripts) print its message as one
sentence and exit non-zero; nothing else in the code catches it. Programming errors stay
ordinary exceptions with tracebacks.
"""


class UserError(Exception):
    """Bad input: the message says what is wrong and what to do, in one sentence."""

    exit_code = 2
