"""Errors a user can cause and fix. Commands print these as one line, never a traceback."""


class RoseError(Exception):
    """A problem the user can fix; the message names the problem and the fix."""


class ConfigError(RoseError, ValueError):
    """An option or parameter outside its allowed range."""


class ModelLoadError(RoseError):
    """A model could not be found, read or understood."""


class RequestError(RoseError, ValueError):
    """A single request is invalid (too long, bad parameters); the engine keeps running. ``param``
    names the input it is about ("prompt", "messages", "stop_token_ids"), for callers (the HTTP
    server) that point at a field."""

    def __init__(self, message: str, param: str = "prompt"):
        super().__init__(message)
        self.param = param


class OverloadedError(RoseError):
    """Admission refused because too many requests are in flight."""


class RequestFailedError(RoseError):
    """The engine failed on one request (an internal error, chained as ``__cause__``); that request
    ended, the engine goes on serving the others. Its message says nothing of the internals."""

    def __init__(self, message: str = "the engine failed on this request (an internal error); it was "
                                      "stopped, other requests are unaffected"):
        super().__init__(message)
