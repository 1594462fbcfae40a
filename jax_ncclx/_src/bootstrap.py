"""How the ranks of a jax_ncclx communicator find each other: the bootstrap protocol, as pure functions of the
mesh's shape, so that ``comm.py`` and the at-scale simulation (``benchmarks/bootstrap_simulation.py``) run the
same code. ``docs/bootstrap.md`` explains the protocol and its cost.

A communicator is made from an NCCL unique id that all its members pass to ``ncclCommInitRank``:

* world communicator (every device of the mesh, ranked by device id): the process holding rank 0 makes the id
  and publishes it in JAX's distributed key-value store; every other process reads that one key;
* axis communicator (the devices that differ only in their coordinate along one mesh axis, ranked by that
  coordinate): each process works out, from the mesh shape and its own devices' coordinates alone, which
  groups its devices belong to, their ranks, and which device is each group's rank 0; the process holding a
  group's rank 0 makes and publishes the group's id, the others read it. No all-gather of membership
  (``ncclCommSplit`` exchanges every rank's colour with every other rank): a process does O(devices it holds x
  mesh rank) work and one key-value operation per group it is in, however many ranks the mesh has.
* A group whose members are all in this process needs no key-value store at all.

Processes create their groups in the order of :func:`axis_groups` (sorted by key), the same everywhere, so a
process waiting for one group's members never waits for a process that waits for it.
"""

import dataclasses
from collections.abc import Callable, Sequence


class KeyValueStore:
    """What the protocol needs of a key-value store (JAX's coordination service implements it)."""

    def set(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        """Blocks until ``key`` is set."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class AxisGroup:
    """One axis communicator as seen by one process.

    Attributes:
      key: the group's name, the same in every process: the mesh axis and the coordinates on the other axes.
      size: ranks in the group (the axis size).
      members: (rank, flat mesh position) of this process's devices in the group.
      root_process: the process that holds the group's rank 0.
    """

    key: str
    size: int
    members: tuple[tuple[int, int], ...]
    root_process: int


def coordinates(position: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinates of flat mesh position ``position``."""
    coords = []
    for extent in reversed(shape):
        position, c = divmod(position, extent)
        coords.append(c)
    return tuple(reversed(coords))


def flat_position(coords: Sequence[int], shape: Sequence[int]) -> int:
    position = 0
    for c, extent in zip(coords, shape):
        position = position * extent + c
    return position


def position_of_rank(shape: Sequence[int], axis: int, position: int, rank: int) -> int:
    """The flat mesh position of rank ``rank`` of the axis group that holds the device at ``position``."""
    coords = coordinates(position, shape)
    return flat_position(coords[:axis] + (rank,) + coords[axis + 1:], shape)


def axis_groups(shape: Sequence[int], axis: int, local_positions: Sequence[int],
                process_of: Callable[[int], int]) -> list[AxisGroup]:
    """The axis communicators along mesh axis ``axis`` that this process's devices (at flat mesh positions
    ``local_positions``) belong to, sorted by key. ``process_of(position)`` is the process holding a device;
    it is asked once per group."""
    by_key: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for position in local_positions:
        coords = coordinates(position, shape)
        rest = coords[:axis] + (-1,) + coords[axis + 1:]
        by_key.setdefault(rest, []).append((coords[axis], position))
    groups = []
    for rest, members in sorted(by_key.items()):
        root = position_of_rank(shape, axis, members[0][1], 0)
        key = f"axis{axis}/" + ",".join(map(str, rest))
        groups.append(AxisGroup(key, shape[axis], tuple(sorted(members)), process_of(root)))
    return groups


def unique_id(key: str, root_process: int, all_local: bool, me: int, kv: KeyValueStore | None,
              new_id: Callable[[], bytes]) -> bytes:
    """The NCCL unique id of the communicator named ``key``: made here when this process holds its rank 0
    (and published unless every member is local), else read from the store."""
    if all_local:
        return new_id()
    if kv is None:
        raise RuntimeError(
            "jax_ncclx: the mesh spans several processes but jax.distributed is not initialised; call "
            "jax.distributed.initialize() before the first collective")
    if root_process == me:
        uid = new_id()
        kv.set(key, uid)
        return uid
    return kv.get(key)
