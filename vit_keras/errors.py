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
    one release name serves many variants.

    Args:
      release: the release name given.
      variant_flag: how the caller names the variant: None for the library's `variant=`
        argument, or an app's flag (`"--model"`), so that the one message names what to pass.
    """

    def __init__(self, release, variant_flag=None):
        self.release = release
        example = f"{variant_flag} ViT-B/16" if variant_flag else "variant='ViT-B/16'"
        super().__init__(
            f"{release!r} is a release name: give the variant it is for ({example}, for example); "
            f"vit_keras.list_weights() lists the variants of each release.")


class ReleaseNotFoundError(UserError, ValueError):
    """A release the variant does not have, or a `weights=` value that is neither a file nor a
    release name; the message lists what there is."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be loaded: an unknown format, a truncated or corrupt file, keys or
    shapes that do not fit the model, another architecture than asked for, NaN or Inf. The
    message names the file and what is wrong with it."""


class CheckpointNotFoundError(UserError, FileNotFoundError):
    """No checkpoint at a path, or a Hugging Face folder without its weight files."""


class AdaptersError(UserError, ValueError):
    """An adapters file (`adapters.npz`, `vit_keras.tools.finetuning.apply_adapters`) that cannot
    be applied: not one vit_keras wrote, incomplete, non-finite, or of shapes that do not fit the
    base model. The message names the file and what is wrong with it."""
