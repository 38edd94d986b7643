"""User-facing errors: one line naming the file or key and what was expected."""


class FeatCalError(Exception):
    """A problem with the user's input; the CLI prints it on one line and exits non-zero."""


class QuietExit(Exception):
    """A non-zero torchrun rank stops because of an error rank 0 reports (bad input): exit non-zero without printing."""


QUIET = {"warnings": False}  # set on the non-zero ranks of a distributed run: rank 0 speaks for all


def warn(message: str) -> None:
    """A one-line warning on stderr, in the same voice as errors."""
    import sys

    if QUIET["warnings"]:
        return
    print(f"featcal-llm: warning: {message}", file=sys.stderr)
