"""Which of our contexts is current in each thread: the mark every CUDA call of this package
checks before it trusts the thread's current context, and the count of its writes that the
compiled core reads.

CUDA keeps one current context per thread, whoever set it; the mark says which device incarnation
(a ``CudaDevice``'s ``token``) this package last made current here. Anything that changes the
thread's current context must write the mark (``set_thread_token``, None when no context of ours
is known current): otherwise a later call trusts a context that is no longer current and CUDA
refuses the handles it is given (``CUDA_ERROR_INVALID_HANDLE``).

Thread rule: any thread, each for itself (only a thread's own calls read its mark).
"""

from __future__ import annotations

import threading
from array import array

__all__ = ["TOKEN_WRITES", "set_thread_token", "tls"]

#: Which context incarnation is current in this thread (``tls.token``: a device's ``token``),
#: shared by every CudaDriver: CUDA has one current context per thread, whoever set it. Written
#: only through :func:`set_thread_token`.
tls = threading.local()

#: How many times any thread's ``tls.token`` was written (by :func:`set_thread_token`, its only
#: writer): a one-cell ``array('q')`` that the compiled core reads through a pointer. The core
#: keeps the last calling thread's token and trusts it while this count is the one it saw, so a
#: repeated call reads two integers instead of the thread's dict (about 150 instructions).
TOKEN_WRITES = array("q", [0])


def set_thread_token(token: object | None) -> None:
    """Record ``token`` (a device's ``token``, or None: no context of ours is known current) as
    this thread's, and count the write (see :data:`TOKEN_WRITES`).

    Args:
        token: the token, or None.
    Thread rule: any thread, for itself (only a thread's own calls read its token).
    """
    tls.token = token
    TOKEN_WRITES[0] += 1
