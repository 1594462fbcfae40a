"""How the ranks of a jax_ncclx communicator find each other: the bootstrap protocol, as pure functions of the
mesh's shape, so that ``comm.py`` and the at-scale simulation (``benchmarks/bootstrap_simulation.py``) run the
same code. ``docs/bootstrap.md`` explains the protocol and its cost.

A communicator is made from an NCCL unique id that all its members pass to ``ncclCommInitRank``:

* axis communicator (the devices that differ only in their coordinate along one mesh axis, ranked by that
  coordinate): each process works out, from the mesh shape and its own devices' coordinates alone, which
  groups its devices belong to, their ranks, and which devices are each group's roots (rank 0, or for a
  large group the first rank of each of a few blocks: NCCL's multi-root scalable init); the process holding
  a root makes and publishes its id, the others read it. No all-gather of membership
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
      root_processes: the processes holding the group's root ranks (:func:`root_ranks`), in unique-id order;
        one root (rank 0) unless the group is created with NCCL's multi-root scalable init.
    """

    key: str
    size: int
    members: tuple[tuple[int, int], ...]
    root_processes: tuple[int, ...]


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


def root_ranks(size: int, roots: int) -> list[int]:
    """The ranks that make the unique ids of a communicator of ``size`` ranks created from ``roots`` ids, in
    id order. NCCL's rule for ``ncclCommInitRankScalable``: the ranks are cut into ``roots`` contiguous
    blocks, the first ``size % roots`` of them one rank longer, and each block's first rank is a root."""
    base, longer = divmod(size, roots)
    return [i * (base + 1) if i < longer else longer * (base + 1) + (i - longer) * base for i in range(roots)]


def axis_groups(shape: Sequence[int], axis: int, local_positions: Sequence[int],
                process_of: Callable[[int], int], roots: int = 1) -> list[AxisGroup]:
    """The axis communicators along mesh axis ``axis`` that this process's devices (at flat mesh positions
    ``local_positions``) belong to, sorted by key, each to be created from ``roots`` unique ids.
    ``process_of(position)`` is the process holding a device; it is asked once per root of each group."""
    by_key: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for position in local_positions:
        coords = coordinates(position, shape)
        rest = coords[:axis] + (-1,) + coords[axis + 1:]
        by_key.setdefault(rest, []).append((coords[axis], position))
    groups = []
    for rest, members in sorted(by_key.items()):
        root_processes = tuple(process_of(position_of_rank(shape, axis, members[0][1], rank))
                               for rank in root_ranks(shape[axis], roots))
        key = f"axis{axis}/" + ",".join(map(str, rest))
        groups.append(AxisGroup(key, shape[axis], tuple(sorted(members)), root_processes))
    return groups


def publish_ids(key: str, group: AxisGroup, me: int, kv: KeyValueStore | None,
                new_id: Callable[[], bytes]) -> dict[int, bytes]:
    """Makes the NCCL unique ids of the roots of ``group`` that this process holds (all of them when every
    member is local) and, unless every member is local, publishes each under ``<key>/<root index>``.

    Returns:
      root index -> id, for the ids made here.
    """
    all_local = len(group.members) == group.size
    if not all_local and kv is None:
        raise RuntimeError(
            "jax_ncclx: the mesh spans several processes but jax.distributed is not initialised; call "
            "jax.distributed.initialize() before the first collective")
    made = {}
    for i, root in enumerate(group.root_processes):
        if all_local or root == me:
            made[i] = new_id()
            if not all_local:
                kv.set(f"{key}/{i}", made[i])
    return made


def read_ids(key: str, group: AxisGroup, kv: KeyValueStore | None, made: dict[int, bytes]) -> list[bytes]:
    """All of ``group``'s unique ids in root order: those made here, the others read from the store (blocking
    until their roots publish them). Publish every group's ids (:func:`publish_ids`) before reading any, so
    that no two processes wait for each other."""
    return [made[i] if i in made else kv.get(f"{key}/{i}") for i in range(len(group.root_processes))]


def all_gather_blobs(key: str, entries: Sequence[tuple[int, int, bytes]], group_of: Callable[[int], str],
                     size: int, kv: KeyValueStore | None) -> list[list[bytes]]:
    """A host all-gather among the ranks of each group (symmetric-memory addresses and IPC handles, a few
    hundred bytes a rank), so that setting up the NVLink kernels makes no NCCL call: an NCCL collective would
    make NCCL connect its rings and allocate their buffers, hundreds of MiB per GPU.

    Args:
      key: names this exchange, the same in every process and new for each exchange.
      entries: (device, rank, blob) for each local rank.
      group_of: the group key of a local device.
      size: ranks per group.
      kv: the key-value store; only used (a set per local rank, a get per remote rank) when a group has
        members in other processes.

    Returns:
      For each entry, in order, the blobs of all ranks of its group in rank order.
    """
    local = {(group_of(device), rank): blob for device, rank, blob in entries}
    groups = {group_of(device) for device, _, _ in entries}
    complete = {g for g in groups if all((g, r) in local for r in range(size))}
    if complete != groups:
        if kv is None:
            raise RuntimeError(
                "jax_ncclx: the mesh spans several processes but jax.distributed is not initialised; call "
                "jax.distributed.initialize() before the first collective")
        for (group, rank), blob in local.items():
            if group not in complete:
                kv.set(f"{key}/{group}/{rank}", blob)
    return [[local[group_of(device), r] if (group_of(device), r) in local else kv.get(f"{key}/{group_of(device)}/{r}")
             for r in range(size)] for device, _, _ in entries]
