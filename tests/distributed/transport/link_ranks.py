"""Rank functions for the lost-link tests (run by ``run_ranks``): what a survivor's gloo link
and store client raise once the other process is SIGKILLed."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gradfleet.distributed.testing import RankContext
from gradfleet.distributed.transport import PairLink, store_client
from gradfleet.distributed.transport.wire import Packer, layout


def _outcome(call) -> tuple[str, str]:
    """``(class name, first line)`` of what ``call()`` raised (``("", "")``: nothing)."""
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc).splitlines()[0]
    return "", ""


def lost_link(ctx: RankContext, port: int) -> dict[str, tuple[str, str]]:
    """Rank 0 and rank 1 build a pair link over rank 0's store and trade a message; rank 1
    also hosts a store of its own, then is SIGKILLed (``kill_on={1: "die"}``).  Rank 0 reports
    what each call raised: a receive posted before the death, a send and a receive after it,
    and calls on the dead rank's store."""
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=ctx.rank == 0, wait_for_workers=False,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    link = PairLink(store, "gf/pair/lost/0", ctx.rank, "127.0.0.1", 30.0)
    message = torch.arange(16, dtype=torch.uint8)
    if ctx.rank == 1:
        own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store.set("victim-store", str(own.port))
        link.send([message])
        link.wait_sent()
        store.wait(["survivor-ready"])  # rank 0 holds its store connection and posted receive
        ctx.signal("die")
        time.sleep(60)  # the harness SIGKILLs this rank
        return {}
    got = torch.empty(16, dtype=torch.uint8)
    link.recv([got])
    assert torch.equal(got, message)
    victim = dist.TCPStore(
        "127.0.0.1", int(store.get("victim-store")), is_master=False,
        timeout=timedelta(seconds=5),
    )  # fmt: skip
    posted = link.begin_receive(layout([torch.zeros(4)]), Packer())  # before the death
    store.set("survivor-ready", "1")  # only now may rank 1 die
    out = {"posted receive": _outcome(posted)}  # waits for the death
    out["send"] = _outcome(lambda: (link.send([message]), link.wait_sent()))
    out["receive"] = _outcome(lambda: link.recv([got]))
    out["store get"] = _outcome(lambda: victim.get("victim-store"))
    out["store set"] = _outcome(lambda: victim.set("k", "v"))
    out["store wait"] = _outcome(lambda: victim.wait(["never"]))
    host, port_ = "127.0.0.1", victim.port
    out["store connect"] = _outcome(lambda: store_client(host, port_, 5.0))
    return out
