"""A live peer's state, sent to the members of a group that are behind (how a rank heals
without a checkpoint file).

:func:`send_state` sends a nested structure -- dicts, lists, tuples, plain values and
tensors, such as an optimizer's ``state_dict()`` -- from one member to the others named.  The
skeleton (the structure with each tensor replaced by its dtype and shape) is small: it travels
as ``torch.save`` bytes and is read back with ``weights_only=True``, so a peer can send
nothing but data.  The tensors travel on the data plane, never pickled: their bytes
concatenated into one buffer, sent in pieces (:data:`CHUNK_BYTES`).

:func:`pack_state` / :func:`unpack_state` are the same split for a message of the mailbox wire
(:mod:`.wire`), whose JSON control part would turn an optimizer state's int keys into strings:
the skeleton as a ``uint8`` tensor, the tensors beside it.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

__all__ = ["send_state", "pack_state", "unpack_state"]

_TENSOR = "__gradfleet_tensor__"


class PointToPoint(Protocol):
    """What :func:`send_state` needs of a group (:class:`~.elastic_group.ElasticGroup`'s)."""

    def isend(self, tensor: torch.Tensor, dst: int) -> Any: ...

    def irecv(self, tensor: torch.Tensor, src: int) -> Any: ...

    def wait(self, handle: Any) -> Any: ...


def _walk(obj: Any, leaf: Callable[[Any], bool], fn: Callable[[Any], Any]) -> Any:
    """``obj`` with every ``leaf`` inside its dicts, lists and tuples replaced by ``fn(leaf)``
    (in a fixed order: the dicts' own)."""
    if leaf(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, leaf, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_walk(v, leaf, fn) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


def _is_placeholder(obj: Any) -> bool:
    return isinstance(obj, tuple) and len(obj) == 5 and obj[0] == _TENSOR


def _skeleton(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with each tensor replaced by ``(_TENSOR, index, dtype, shape, kind)``; the
    tensors appended to ``tensors`` in that order."""

    def placeholder(t: torch.Tensor) -> tuple:
        tensors.append(t)
        return (_TENSOR, len(tensors) - 1, t.dtype, tuple(t.shape), "cuda" if t.is_cuda else "cpu")

    return _walk(obj, _is_tensor, placeholder)


def pack_state(state: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``state`` as ``(skeleton, tensors)``: the skeleton's ``torch.save`` bytes as a ``uint8``
    tensor, and the tensors it refers to (:func:`unpack_state` puts them back)."""
    tensors: list[torch.Tensor] = []
    buffer = io.BytesIO()
    torch.save(_skeleton(state, tensors), buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8), tensors


def unpack_state(skeleton: torch.Tensor, tensors: list[torch.Tensor]) -> Any:
    """The state :func:`pack_state` split (the skeleton read with ``weights_only=True``; the
    tensors used as they are, on the CPU)."""
    shape = torch.load(io.BytesIO(skeleton.cpu().numpy().tobytes()), weights_only=True)
    return _walk(shape, _is_placeholder, lambda p: tensors[p[1]])


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


CHUNK_BYTES = 4 << 20
"""The state's bytes travel in pieces of this size, :data:`WINDOW` in flight: a gloo send or
receive times out counted from when it was posted, so one message of the whole state (120 MB
for 10M parameters of Adam: 4.8 s at 200 Mbit/s) outlasted a 5 s group timeout."""
WINDOW = 2


def _chunks(flat: torch.Tensor) -> list[torch.Tensor]:
    return [flat[i : i + CHUNK_BYTES] for i in range(0, flat.numel(), CHUNK_BYTES)]


def _windowed(group: PointToPoint, posting: Iterable[list[Any]]) -> None:
    """Post each piece's operations (``posting`` posts them as it is iterated), at most
    :data:`WINDOW` pieces in flight, waiting for the oldest before the next is posted."""
    flight: deque[list[Any]] = deque()
    for handles in posting:
        flight.append(handles)
        if len(flight) >= WINDOW:
            for handle in flight.popleft():
                group.wait(handle)
    while flight:
        for handle in flight.popleft():
            group.wait(handle)


def send_state(
    group: PointToPoint, state: Any, src: int, me: int, to: Sequence[int], device: torch.device
) -> Any:
    """``state`` as rank ``src`` of ``group`` holds it, sent to the ranks ``to`` (``me``: this
    rank; ``device``: where the group takes tensors).  Returns ``state`` on ``src``, what
    arrived on a rank of ``to``, None elsewhere (a rank neither sending nor receiving takes no
    part).  The tensors arrive on the CPU, or on this process's current CUDA device where the
    sender's were on one.

    Why point to point and not a broadcast: only the ranks behind need the state, and a
    broadcast's tree makes the sender's link carry it once per level (gloo's binomial tree: 2
    for 4 ranks).  Measured with 4 emulated hosts at 200 Mbit/s and 10M parameters of Adam
    (120 MB): the broadcast held the job 10-15 s while one restarted rank healed."""
    if me == src:
        raw, tensors = pack_state(state)
        size = torch.tensor([raw.numel()], dtype=torch.int64, device=device)
        flat = torch.cat([_bytes_of(t).to(device) for t in tensors]) if tensors else None
        for part in (size, raw.to(device)):  # each stage whole before the next
            for handle in [group.isend(part, r) for r in to]:
                group.wait(handle)
        if flat is not None:
            _windowed(group, ([group.isend(c, r) for r in to] for c in _chunks(flat)))
        return state
    if me not in to:
        return None
    size = torch.zeros(1, dtype=torch.int64, device=device)
    group.wait(group.irecv(size, src))
    shipped = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.wait(group.irecv(shipped, src))
    skeleton = torch.load(io.BytesIO(shipped.cpu().numpy().tobytes()), weights_only=True)
    specs: list[tuple[torch.dtype, tuple[int, ...], str]] = []
    _walk(skeleton, _is_placeholder, lambda p: specs.append((p[2], p[3], p[4])))
    sizes = [
        int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        for dtype, shape, _ in specs
    ]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    _windowed(group, ([group.irecv(c, src)] for c in _chunks(flat)))
    received, offset = [], 0
    for (dtype, shape, kind), n in zip(specs, sizes, strict=True):
        part = flat[offset : offset + n]
        offset += n
        where = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else "cpu"
        received.append(part.to(where).clone().view(dtype).reshape(shape))
    return _walk(skeleton, _is_placeholder, lambda p: received[p[1]])
