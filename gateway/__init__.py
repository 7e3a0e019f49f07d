"""The HTTP gateway: the OpenAI-compatible API, the admin console, auth, metrics and the CLI."""

if not __name__.startswith("lockgate."):
    # The repository's top-level folders are importable only as parts of the lockgate namespace,
    # so that no module is loaded twice under two names.
    raise ImportError(f"{__name__!r} is part of Lockgate: import it as 'lockgate.{__name__}'")
