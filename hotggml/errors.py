"""One exception family for hotggml; every message says what to do next."""


class HotggmlError(Exception):
    """Base class of every error hotggml raises on purpose."""


class PinError(HotggmlError):
    """The pinned ggml source is missing, unreachable, tampered with or dirty."""


class UnsafeDirectoryError(HotggmlError):
    """git refuses a repository owned by another user (its safe.directory check: "dubious ownership")."""


class PatchError(HotggmlError):
    """A patch in the series is malformed (CRLF, no name), does not apply, or misses a marker."""


class BuildError(HotggmlError):
    """CMake configure or build failed, or no build exists for the current pin + series."""


class LibraryError(HotggmlError, ImportError):
    """The shared library is missing or stale (built from another pin or series)."""


class BackendError(HotggmlError, RuntimeError):
    """A requested backend is not in the registry, or a node did not run on it."""


class UnsupportedOpError(BackendError):
    """A backend's supports_op answered false for a node at the run's real shape."""


class CheckoutError(HotggmlError):
    """A command that works on the repository's files (patches/, vendor/ggml) ran from an installed package."""


class SettingError(HotggmlError):
    """An environment variable of hotggml's (HOTGGML_STATE_DIR, HOTGGML_BUILD_ROOT) holds a value it cannot use."""


class InputError(HotggmlError, ValueError):
    """An argument's value cannot be accepted (shape, range, size); checked before any C call."""


class InputTypeError(HotggmlError, TypeError):
    """An argument has the wrong type or dtype (a Tensor of another Graph, float64 where f32 is needed)."""


class UsageError(HotggmlError, RuntimeError):
    """A call made in the wrong state: on a closed Graph or Backend, before build() or compute(), twice."""


class OutOfMemoryError(HotggmlError, MemoryError):
    """A context, buffer or graph allocation failed on a backend."""


class ConnectionLostError(BackendError):
    """An RPC server did not compute a graph: it died, closed the connection or refused the graph. The
    buffers on it are gone: close the Graph and Backend, and open new ones once a server listens again."""
