"""`ast.parse` for the tests that read the product's sources.

CPython 3.11 keeps the AST constructor's recursion counter in state shared by every thread
of the interpreter (python/cpython#106905): a parse that a garbage collection or a thread
switch interleaves with another thread's parse can fail with `SystemError: AST constructor
recursion depth mismatch` although the source is fine. The long test process has such
threads (torch's, gRPC's), so a parse that fails that way is tried again.
"""

from __future__ import annotations

import ast

TRIES = 5


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """The module's tree; a spurious recursion-depth SystemError is retried."""
    for attempt in range(TRIES):
        try:
            return ast.parse(source, filename=filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == TRIES - 1:
                raise
    raise AssertionError("unreachable")
