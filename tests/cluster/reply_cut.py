"""The two ends of ``test_lost_mid_message``: ``server ADDR PORT`` answers every request with a
reply of ``MB`` megabytes of tensors; ``client ADDR PORT TIMEOUT`` asks once and prints, as
JSON, what its call raised and when (seconds since the call began)."""

from __future__ import annotations

import json
import sys
import time

import torch

from gradfleet.distributed.transport.client import MailboxClient
from gradfleet.distributed.transport.mailbox import MailboxServer


def main() -> None:
    role, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "server":
        big = torch.ones(int(float(sys.argv[4]) * 2**20) // 4)
        MailboxServer(lambda msg, reply: reply.send({"x": big}), host=addr, port=port)
        print("serving", flush=True)
        time.sleep(600)
    client = MailboxClient(f"{addr}:{port}", "c0", float(sys.argv[4]), "the server")
    print("connected", flush=True)
    start = time.monotonic()
    try:
        client.call("get")
        print(json.dumps({"raised": None, "after_s": time.monotonic() - start}), flush=True)
    except Exception as exc:
        print(json.dumps({"raised": type(exc).__name__, "message": str(exc)[:300],
                          "after_s": time.monotonic() - start}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
