"""``SyncReplicasOptimizer``'s checkpoints: what each rank's ``state_dict`` holds, and its checks.

Checkpoints are per rank: the chief's holds ``global_step``, the tokens and shard 0 (``"server"``),
another server rank's the shards it hosts (``"shards"``), lockstep's its accumulator
(``"allreduce"``), and every rank its own ``local_step`` and counters.  Loading refuses a
checkpoint of another rank's role or of another ``replicas_to_aggregate`` /
``total_num_replicas``, and changes nothing then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SyncCheckpoints"]

_OWNER = "SyncReplicasOptimizer"


class SyncCheckpoints:
    """The wrapper-state hooks of :class:`~gradfleet.distributed.wrapper.WrapperOptimizer`
    for ``SyncReplicasOptimizer`` (a mixin: it reads the optimizer's attributes)."""

    local_step: int
    global_step: int
    counters: dict[str, int]
    replicas_to_aggregate: int
    total_num_replicas: int
    server_ranks: list[int]
    _servers: Any
    _allreduce: Any
    _links: Any
    optimizer: Any
    wait_reads: Callable[[], None]

    def _wrapper_state(self) -> dict[str, Any]:
        self.wait_reads()  # streamed reads: the counters and steps are final once all are in
        return {
            "local_step": self.local_step,
            "global_step": self.global_step,
            "counters": dict(self.counters),
            "replicas_to_aggregate": self.replicas_to_aggregate,
            "total_num_replicas": self.total_num_replicas,
            "server": self._chief.state_dict() if self._chief is not None else None,
            "allreduce": self._allreduce.state_dict() if self._allreduce is not None else None,
            **self._shards_state(),
        }

    def _shards_state(self) -> dict[str, Any]:
        """Sharded: ``{"shards": {k: state}}`` for the shards hosted by this rank (shard 0 is
        in ``"server"``); unsharded checkpoints keep their old layout."""
        if len(self.server_ranks) == 1:
            return {}
        return {"shards": {k: srv.shard.state_dict() for k, (srv, _) in self._hosted.items()}}

    def applied_state(self) -> tuple[Any, dict[int, Any], int] | None:
        """What the updates are applied with on this rank: ``(optimizer, {parameter index:
        variable}, global_step)`` -- the chief's optimizer copy and variables with one server,
        this rank's own optimizer with ``transport="allreduce"`` (its parameters are the
        variables: an empty map); None on a rank that holds no such state (a plain worker,
        or any rank of a sharded job, whose variables are spread over the shards)."""
        if self._allreduce is not None:
            return self.optimizer, {}, int(self._allreduce.global_step)
        chief = self._chief
        if chief is None or len(self.server_ranks) > 1:
            return None
        return (
            chief.opt,
            dict(zip(chief.shard.indices, chief.params, strict=True)),
            int(chief.global_step),
        )

    @property
    def _chief(self) -> Any:
        return self._servers.chief if self._servers is not None else None

    @property
    def _hosted(self) -> dict[int, Any]:
        return self._servers.shards if self._servers is not None else {}

    def _check_wrapper_state(self, counters: dict[str, Any]) -> None:
        super()._check_wrapper_state(counters)
        for key in ("replicas_to_aggregate", "total_num_replicas"):
            if counters[key] != getattr(self, key):
                raise ValueError(
                    f"{_OWNER}.load_state_dict: checkpoint has {key}="
                    f"{counters[key]}, this optimizer {getattr(self, key)}"
                )
        if (counters["server"] is None) != (self._chief is None):
            raise ValueError(f"{_OWNER}.load_state_dict: load the chief's checkpoint on the chief")
        if set(counters.get("shards", {})) != set(self._hosted):
            raise ValueError(
                f"{_OWNER}.load_state_dict: checkpoint holds shards "
                f"{sorted(counters.get('shards', {}))}, this rank hosts {sorted(self._hosted)} "
                "(load each server rank's own checkpoint, same server_ranks)"
            )

    def _load_wrapper_state(self, state: dict[str, Any]) -> None:
        self.wait_reads()
        if self._chief is not None:
            self._chief.load_state_dict(state["server"])
        if self._allreduce is not None:
            self._allreduce.load_state_dict(state["allreduce"])
        for k, shard_state in state.get("shards", {}).items():
            self._hosted[int(k)][0].shard.load_state_dict(shard_state)
        self.local_step, self.global_step = int(state["local_step"]), int(state["global_step"])
        self.counters = dict(state["counters"])
        if self._links is not None:  # the next step reloads the variables from the server(s)
            self._links.forget_versions()
