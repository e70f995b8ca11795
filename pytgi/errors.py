"""The errors that are the user's to fix (a model path, a file pytgi cannot read): the command line
prints their message as one line, without a traceback."""


class UserError(Exception):
    """Something the user asked for cannot be done; the message names the fix."""
