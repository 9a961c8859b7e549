"""How bytes travel between workers and servers (the algorithms never see this layer).

* :mod:`.mailbox` / :mod:`.client` -- request/reply: ``MailboxServer(handler)`` /
  ``MailboxClient.call(op, **fields)``; control on the server's c10d ``TCPStore`` queues,
  tensors on a pair group; :mod:`.peer` -- a client as the server sees it, and a ``Reply``.
* :mod:`.pairs` -- the data plane: a 2-rank gloo process group per (server, client
  incarnation), so a restarted worker simply builds a new pair; a client in the server's own
  process hands its tensors over in memory (``LocalLink``).
* :mod:`.wire` -- a message as JSON control + one packed byte buffer of tensors (no pickling).
* :mod:`.all_reduce` -- the one all-reduce of gradients and their mean over the ranks (one rule
  for sparse rows); :mod:`.collectives` -- lists of tensors over a process group;
  :mod:`.process_group` -- :func:`~gradfleet.distributed.init`.

Layer: communication.
"""

from .client import MailboxClient, store_client
from .mailbox import MailboxServer, ServerUnreachable
from .pairs import LINK_ERRORS, LocalLink, PairLink, local_address_towards
from .peer import Reply
from .wire import Packer, join, split

__all__ = [
    "LINK_ERRORS",
    "LocalLink",
    "MailboxClient",
    "MailboxServer",
    "PairLink",
    "Packer",
    "Reply",
    "ServerUnreachable",
    "join",
    "local_address_towards",
    "split",
    "store_client",
]
