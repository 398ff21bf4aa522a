"""Error text that is safe to store: no filesystem paths, bounded length.

Stored errors are shown in the admin and in metrics labels' neighbourhood; a traceback's
absolute paths would leak the deployment's layout, so they are replaced by file names.
"""

from __future__ import annotations

import re

MAX_ERROR_CHARS = 500
# An absolute POSIX or Windows path, up to the last separator before a file name.
_PATH = re.compile(r"""(?:[A-Za-z]:\\|/)(?:[^\s'"\\/:]+[\\/])+""")


def sanitize_error(exc: BaseException | str, limit: int = MAX_ERROR_CHARS) -> str:
    """Return ``"Type: message"`` with directory paths stripped, at most ``limit`` chars."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    text = _PATH.sub("", text)
    return text if len(text) <= limit else text[: limit - 1] + "…"
