"""A restarted process becomes the asynchronous EASGD centre's standby.

Where the centre has no standby (its own took over after a loss, or was lost), a restarted
process -- a worker with ``standby=True``, or the dedicated server rank the centre lived on --
serves an empty copy of the centre and asks the live centre to take it (``ATTACH``).  The
centre's first copy to it is the centre's whole state, so the copy is a live peer's, not a
checkpoint's, and a second loss of the centre's host is survived as the first was.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..easgd.server.centre_server import CentreServer
from ..transport import MailboxClient
from .hosted_server import HostedServer
from .standby import ATTACH

__all__ = ["attach_centre_standby"]


def attach_centre_standby(
    centre: MailboxClient,
    values: Sequence[torch.Tensor],
    *,
    num_worker: int,
    timeout: float,
    host: str,
    name: str,
    worker: int,
    rank: int,
) -> tuple[CentreServer, HostedServer]:
    """Serve an empty copy over ``values`` (the centre's shapes) on ``host`` and ask the
    centre behind ``centre`` to take it as its standby, as ``worker`` (-1: a server rank) of
    rank ``rank``.  Returns the copy and its hosting.  Refused (the centre has a standby
    already, or is gone): the centre's ``RuntimeError``, with nothing left serving here."""
    server = CentreServer(values, num_worker, timeout, keep_reads=True)
    hosted = HostedServer(server, server.members, host, name, standby=True)
    try:
        centre.call(ATTACH, worker=worker, address=hosted.address, rank=rank, seconds=timeout)
    except RuntimeError:
        hosted.close(time.monotonic())
        raise
    return server, hosted
