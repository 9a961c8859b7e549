"""How bytes travel between workers and servers (the algorithms never see this layer).

* :mod:`.mailbox` / :mod:`.client` -- request/reply: ``MailboxServer(handler)`` /
  ``MailboxClient.call(op, **fields)``; control on the server's c10d ``TCPStore`` queues,
  tensors on a pair group; :mod:`.peer` -- a client as the server sees it, and a ``Reply``.
* :mod:`.pairs` -- the data plane: a 2-rank gloo process group per (server, client
  incarnation), so a restarted worker simply builds a new pair; a client in the server's own
  process hands its tensors over in memory (``LocalLink``).
* :mod:`.wire` -- a message as JSON control + one packed byte buffer of tensors (no pickling).
* :mod:`.errors` -- what a lost peer raises (``LINK_ERRORS``; gloo's transport errors named as
  ``LinkLost``), told apart from a bug, and a server's error as its client raises it.
* :mod:`.all_reduce` -- the one all-reduce of gradients and their mean over the ranks (one rule
  for sparse rows); :mod:`.collectives` -- lists of tensors over a process group;
  :mod:`.process_group` -- :func:`~gradfleet.distributed.init`.
* :mod:`.world_group` / :mod:`.elastic_group` -- the all-reduce exchange's members: the job's
  process group, or (losses allowed) one process group per generation that loses members and
  takes restarted ones back; :mod:`.state_transfer` -- a live member's state broadcast to the
  others (how a rank heals without a checkpoint file).

Layer: communication.
"""

from .client import MailboxClient, store_client
from .errors import (
    LINK_ERRORS,
    JobEnded,
    LinkLost,
    ServerClosed,
    ServerUnreachable,
    gloo_link,
    lost_peer,
)
from .mailbox import MailboxServer
from .pairs import LocalLink, PairLink, local_address_towards
from .peer import Reply
from .wire import Packer, join, split

__all__ = [
    "LINK_ERRORS",
    "LinkLost",
    "LocalLink",
    "MailboxClient",
    "MailboxServer",
    "PairLink",
    "Packer",
    "Reply",
    "JobEnded",
    "ServerClosed",
    "ServerUnreachable",
    "gloo_link",
    "join",
    "local_address_towards",
    "lost_peer",
    "split",
    "store_client",
]
