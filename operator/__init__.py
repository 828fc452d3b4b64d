"""kvpark.operator: the Kubernetes operator (kopf). Installed as `kvpark.operator`; this folder
is never meant to be imported as a top-level `operator`."""

if __name__ == "operator":
    # Python puts the current directory first on sys.path (`python -m`, `-c`, the REPL), so from
    # the repository root this folder is found as the standard library's `operator`, which
    # `collections` imports: runpy itself failed there, before any kvpark code ran (`python -m
    # kvpark.operator`, `-m kvpark.pod`, even `-m pip`), wherever nothing had imported the real
    # one first. Import the real one instead: once this file has run, the import system hands
    # out what sys.modules holds under the name.
    import os as _os
    import sys as _sys

    def _is_here(entry: str) -> bool:
        here = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
        return _os.path.realpath(entry or _os.curdir) == here

    del _sys.modules["operator"]
    _saved = list(_sys.path)
    _sys.path[:] = [p for p in _sys.path if not _is_here(p)]
    try:
        import operator  # noqa: F401  (the standard library's, now in sys.modules)
    finally:
        _sys.path[:] = _saved
