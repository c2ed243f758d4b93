"""The one error type for a problem with what the user gave: a flag's value, a file, a dataset,
a run folder, the machine's memory or network. Its message says what was wrong and what to do;
the apps print it as one line, `ERROR: <message>`, and exit with status 2 (`apps/_common.py`).

Each error of the library that a user can cause subclasses `UserError` (and the built-in type it
has always been, so that existing `except ValueError:` code keeps working). An error that is not
a `UserError` is a bug in vit_keras or below it, and keeps its traceback.
"""


class UserError(Exception):
    """Something the user gave cannot be used; the message names it and says what to do."""


class ReleaseNeedsVariantError(UserError, ValueError):
    """A published release's name (`augreg_in21k`, ...) was given without the variant it is for:
    one release name serves many variants."""
