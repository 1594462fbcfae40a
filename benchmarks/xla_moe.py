"""The MoE token shuffle written with XLA's own ops: the layer that ``jax_ncclx.moe`` is timed against.

The same contract as ``moe.dispatch(tokens, expert_ids, ...)`` and ``moe.combine(expert_out, handle, weights)``
(expert placement, capacity, which pairs drop, expert-major rows and group sizes), done the way an MoE layer
written with ``jax.lax`` alone does it:

- dispatch sorts the (token, choice) pairs by expert, gathers each member's first C pairs into a padded
  ``[N * C, H]`` buffer, sends it with ``lax.all_to_all`` together with the local expert of every slot
  (``[N * C]`` int32, a second ``lax.all_to_all``), and sorts the received rows by local expert;
- combine undoes that sort, sends the rows back with ``lax.all_to_all``, gathers each pair's row and sums
  the pairs of each token with their router weights in float32.

One row per pair crosses the wire each way (no send-once) and the padding crosses too: that is the cost of
doing it with a fixed-size collective. Call both inside ``jax.shard_map`` over ``axis_name``.
"""

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """What combine needs from dispatch (N members, C = capacity, T tokens, k choices), int32 arrays.

    send_slot: ``[T * k]`` the slot of the padded send buffer that carries each (token, choice) pair (member
      m's slots from m * C); ``N * C`` for a pair that was dropped or chose no expert.
    from_expert_major: ``[N * C]`` the expert-major row of each received slot.
    dropped: ``[N]`` pairs this member had for each member that did not fit in the capacity.
    """

    send_slot: jax.Array
    from_expert_major: jax.Array
    dropped: jax.Array
    axis_name: str = dataclasses.field(metadata=dict(static=True))


def dispatch(tokens, expert_ids, *, num_experts: int, axis_name: str, capacity: int):
    """Sends every (token, choice) pair's row to the member that owns its expert (expert e on member
    e // (num_experts // N)).

    Args:
      tokens: ``[T, H]`` any dtype.
      expert_ids: ``[T, k]`` integers; an id outside ``[0, num_experts)`` chooses no expert.
      num_experts: E, a multiple of the axis size N (static).
      axis_name: the mesh axis (static).
      capacity: C, the most pairs one member sends another (static); each destination keeps its lowest
        experts' pairs first, in token order within an expert.

    Returns:
      ``(expert_rows [N * C, H] tokens' dtype, group_sizes [E / N] int32, Routing)``: the received rows
      grouped by local expert (source-major within one), zeros past them.
    """
    n = jax.lax.axis_size(axis_name)
    local_experts = num_experts // n
    pairs = expert_ids.size
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    chosen = (flat >= 0) & (flat < num_experts)
    order = jnp.argsort(jnp.where(chosen, flat, num_experts), stable=True)  # pairs by expert, unchosen last
    member = jnp.where(chosen, flat // local_experts, n)[order]
    per_member = jnp.zeros(n + 1, jnp.int32).at[member].add(1)
    slot = jnp.arange(pairs, dtype=jnp.int32) - (jnp.cumsum(per_member) - per_member)[member]
    kept = (member < n) & (slot < capacity)
    sorted_slot = jnp.where(kept, member * capacity + slot, n * capacity)
    send_slot = jnp.zeros(pairs, jnp.int32).at[order].set(sorted_slot)

    # The padded send buffer, gathered: the token of every slot (T, out of range, for an empty one).
    pair = jnp.arange(pairs, dtype=jnp.int32)
    slot_token = jnp.full(n * capacity, tokens.shape[0], jnp.int32).at[send_slot].set(pair // expert_ids.shape[1],
                                                                                      mode="drop")
    slot_expert = jnp.full(n * capacity, local_experts, jnp.int32).at[send_slot].set(flat % local_experts,
                                                                                     mode="drop")
    send = tokens.at[slot_token].get(mode="fill", fill_value=0)
    received = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)
    received_expert = jax.lax.all_to_all(slot_expert, axis_name, 0, 0, tiled=True)

    to_expert_major = jnp.argsort(received_expert, stable=True)  # empty slots (local_experts) last
    group_sizes = jnp.zeros(local_experts + 1, jnp.int32).at[received_expert].add(1)[:local_experts]
    from_expert_major = jnp.zeros(n * capacity, jnp.int32).at[to_expert_major].set(
        jnp.arange(n * capacity, dtype=jnp.int32))
    dropped = per_member[:n] - jnp.minimum(per_member[:n], capacity)
    return received[to_expert_major], group_sizes, Routing(send_slot, from_expert_major, dropped, axis_name)


def combine(expert_out, routing: Routing, weights):
    """``[T, H]`` in expert_out's dtype: sum over each token's k pairs of weight * its expert's output row (float32
    sums), zero for a dropped pair.

    Args:
      expert_out: ``[N * C, H]`` rows in dispatch's expert-major order.
      routing: dispatch's ``Routing``.
      weights: ``[T, k]`` any float dtype, the router weights.
    """
    returned = jax.lax.all_to_all(expert_out[routing.from_expert_major], routing.axis_name, 0, 0, tiled=True)
    pair_rows = returned.at[routing.send_slot].get(mode="fill", fill_value=0)  # [T * k, H]
    pair_rows = pair_rows.reshape(*weights.shape, -1).astype(jnp.float32)
    return (pair_rows * weights.astype(jnp.float32)[..., None]).sum(axis=1).astype(expert_out.dtype)
