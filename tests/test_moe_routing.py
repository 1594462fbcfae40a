"""The routing ops behind jax_ncclx.moe.dispatch (plan_sends, place_received) against the NumPy reference in
reference.py, on CPU and on one GPU, for routings that stress them: ids outside [0, E), every pair on one
expert, more choices than members, repeated experts within a token, many experts (few sorting warps), blocks
of 256, 512 and 1024 threads, enough pairs for a cluster of several blocks, router weights in the suffixes,
suffixes at unaligned offsets, tags that were corrupted on the way, and a vmapped batch."""

import functools

import jax
import numpy as np
import pytest

from jax_ncclx._src.ops import moe_routing
from reference import moe_exchange_suffixes, moe_place_received, moe_plan_sends


def skewed_ids(rng, shape, num_experts):
    """Expert ids skewed towards low experts, with some -1 and some ids >= num_experts (both: no expert)."""
    ids = np.minimum(rng.integers(0, num_experts, size=shape), rng.integers(0, num_experts, size=shape))
    ids = np.where(rng.random(shape) < 0.05, -1, ids)
    return np.where(rng.random(shape) < 0.02, num_experts + 3, ids).astype(np.int32)


def routings():
    """(name, ids [N, T, k] for N members, num_experts, capacity)."""
    rng = np.random.default_rng(0)
    yield "random_ample", skewed_ids(rng, (4, 16, 4), 16), 16, 64
    yield "random_tight", skewed_ids(rng, (4, 16, 4), 16), 16, 5
    yield "no_expert", np.full((2, 8, 2), -1, np.int32), 4, 4
    yield "all_on_expert_0", np.zeros((4, 12, 3), np.int32), 8, 7
    yield "k_above_members", skewed_ids(rng, (2, 10, 8), 6), 6, 40         # repeated experts in a token
    yield "one_expert_per_member", skewed_ids(rng, (4, 9, 2), 4), 4, 3
    yield "one_token", skewed_ids(rng, (3, 1, 5), 9), 9, 2
    yield "decode_128", skewed_ids(rng, (2, 128, 8), 16), 16, 600          # 512 threads per block on GPU
    yield "many_pairs", skewed_ids(rng, (4, 300, 8), 64), 64, 500          # many warp segments
    yield "two_blocks", skewed_ids(rng, (4, 700, 8), 32), 32, 600          # a cluster of 2 blocks on GPU
    yield "prefill", skewed_ids(rng, (4, 4096, 8), 32), 32, 9000           # a cluster of 8 blocks on GPU
    yield "many_experts", skewed_ids(rng, (8, 200, 8), 2048), 2048, 150    # few sorting warps
    yield "one_member", skewed_ids(rng, (1, 64, 4), 2048), 2048, 64
    # DeepSeek-V3's 256 experts at a prefill size: 1024-thread blocks whose sorting warps fill shared memory
    # (once too full for the kernel's static shared memory beside it: a failed launch)
    yield "many_experts_prefill", skewed_ids(rng, (2, 600, 8), 256), 256, 2500

ROUTINGS = {name: (ids, experts, capacity) for name, ids, experts, capacity in routings()}
WEIGHTED = ("random_tight", "k_above_members", "one_token", "decode_128", "two_blocks")  # also run with router weights


def on_device(device):
    return functools.partial(jax.device_put, device=device)


@pytest.mark.parametrize("name, weighted", [(n, False) for n in ROUTINGS] + [(n, True) for n in WEIGHTED])
def test_plan_and_place_match_reference(one_device, name, weighted):
    """Each member plans its sends; the suffixes travel as the exchange would move them; each member places
    them."""
    ids, num_experts, capacity = ROUTINGS[name]
    num_members, num_tokens, top_k = ids.shape
    weights = np.random.default_rng(3).standard_normal(ids.shape).astype(np.float32) if weighted else [None] * len(ids)
    put = on_device(one_device)
    plan = jax.jit(functools.partial(moe_routing.plan_sends, num_experts=num_experts, num_members=num_members,
                                     capacity=capacity))
    expected_plans = [moe_plan_sends(i, num_experts, num_members, capacity, w) for i, w in zip(ids, weights)]
    for member, expected in enumerate(expected_plans):
        actual = plan(put(ids[member]), None if weights[member] is None else put(weights[member]))._asdict()
        for field, value in expected.items():
            np.testing.assert_array_equal(actual[field], value, err_msg=f"member {member}: {field}")

    local = num_experts // num_members
    place = jax.jit(functools.partial(moe_routing.place_received, local_experts=local, capacity=capacity,
                                      top_k=top_k, suffix_offset=0, with_weights=weighted))
    received = moe_exchange_suffixes(expected_plans, min(capacity, num_tokens))
    for member, (suffixes, recv_tokens) in enumerate(received):
        actual = place(put(suffixes), put(recv_tokens))._asdict()
        for field, value in moe_place_received(suffixes, recv_tokens, local, capacity, top_k, weighted).items():
            np.testing.assert_array_equal(actual[field], value, err_msg=f"member {member}: {field}")


def test_place_received_reads_unaligned_suffixes(one_device):
    """Suffixes after a token of 3 bytes (uint8 rows): the same placement as aligned ones."""
    ids, num_experts, capacity = ROUTINGS["random_tight"]
    num_members, num_tokens, top_k = ids.shape
    weights = np.random.default_rng(4).standard_normal(ids.shape).astype(np.float32)
    plans = [moe_plan_sends(i, num_experts, num_members, capacity, w) for i, w in zip(ids, weights)]
    suffixes, recv_tokens = moe_exchange_suffixes(plans, min(capacity, num_tokens))[0]
    rows = np.concatenate([np.full((len(suffixes), 3), 7, np.uint8), suffixes.view(np.uint8)], axis=1)
    local = num_experts // num_members
    put = on_device(one_device)
    actual = jax.jit(functools.partial(moe_routing.place_received, local_experts=local, capacity=capacity,
                                       top_k=top_k, suffix_offset=3, with_weights=True))(put(rows), put(recv_tokens))
    for field, value in moe_place_received(suffixes, recv_tokens, local, capacity, top_k, True).items():
        np.testing.assert_array_equal(getattr(actual, field), value, err_msg=field)


@pytest.mark.parametrize("capacity", [3, 40])
def test_place_received_survives_corrupted_tags(one_device, capacity):
    """Tags and counts that no sender wrote (negative, huge, unsorted, more than fit) still give indices within
    their documented ranges, the same on CPU and GPU."""
    rng = np.random.default_rng(1)
    num_members, rows_per_source, top_k, local = 4, 6, 3, 5
    tags = rng.integers(-5, 40, size=(num_members * rows_per_source, 4)).astype(np.int32)  # k = 3, padded
    tags[0, 0] = np.iinfo(np.int32).max
    recv_tokens = np.array([rows_per_source, 0, 2, rows_per_source + 9], np.int32)  # the last one lies
    put = on_device(one_device)
    actual = jax.jit(functools.partial(moe_routing.place_received, local_experts=local, capacity=capacity,
                                       top_k=top_k, suffix_offset=0))(put(tags), put(recv_tokens))._asdict()
    expected = moe_place_received(tags, recv_tokens, local, capacity, top_k)
    for field, value in expected.items():
        if field != "row_pairs":  # tags that name one entry twice leave either row there (GPU: either thread)
            np.testing.assert_array_equal(actual[field], value, err_msg=field)
    received = num_members * rows_per_source
    actual = {field: np.asarray(value) for field, value in actual.items()}  # the op's indices stay in range
    assert np.all((actual["expand_rows"] >= 0) & (actual["expand_rows"] <= received))
    assert np.all((actual["pair_entry"] >= 0) & (actual["pair_entry"] <= received * top_k))
    assert np.all((actual["send_back_rows"] >= 0) & (actual["send_back_rows"] <= received))
    for field in ("to_expert_major", "to_source_major"):
        assert np.all((actual[field] >= 0) & (actual[field] <= num_members * capacity)), field
    row_pairs = np.asarray(actual["row_pairs"]).reshape(-1)
    named = set(expected["pair_entry"].tolist()) - {received * top_k}
    for entry, x in enumerate(row_pairs):  # each named entry holds one of the rows that name it
        if entry in named:
            assert expected["pair_entry"][x] == entry, entry
        else:
            assert x == num_members * capacity, entry


def test_vmap_is_one_call(one_device):
    """vmap over a batch of routings: one custom call each, equal to the routings one by one."""
    ids, num_experts, capacity = ROUTINGS["random_tight"]
    num_members = ids.shape[0]
    plan = functools.partial(moe_routing.plan_sends, num_experts=num_experts, num_members=num_members,
                             capacity=capacity)
    text = jax.jit(jax.vmap(plan)).lower(ids).as_text()
    assert text.count("ncclx_moe_plan_sends") == 1
    batched = jax.jit(jax.vmap(plan))(on_device(one_device)(ids))
    for member in range(num_members):
        for field, value in moe_plan_sends(ids[member], num_experts, num_members, capacity).items():
            np.testing.assert_array_equal(getattr(batched, field)[member], value, err_msg=field)

    plans = [moe_plan_sends(i, num_experts, num_members, capacity) for i in ids]
    received = moe_exchange_suffixes(plans, min(capacity, ids.shape[1]))
    suffixes = np.stack([t for t, _ in received])
    recv_tokens = np.stack([r for _, r in received])
    top_k = ids.shape[2]
    place = functools.partial(moe_routing.place_received, local_experts=num_experts // num_members,
                              capacity=capacity, top_k=top_k, suffix_offset=0)
    batched = jax.jit(jax.vmap(place))(on_device(one_device)(suffixes), on_device(one_device)(recv_tokens))
    for member in range(num_members):
        expected = moe_place_received(suffixes[member], recv_tokens[member], num_experts // num_members, capacity,
                                      top_k)
        for field, value in expected.items():
            np.testing.assert_array_equal(getattr(batched, field)[member], value, err_msg=field)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_experts=4096, num_members=4, capacity=2), "at most 2048"),
    (dict(num_experts=6, num_members=4, capacity=2), "multiple of the axis size"),
    (dict(num_experts=8, num_members=4, capacity=0), "capacity must be 1 to 2147483647, got 0"),
    (dict(num_experts=8, num_members=4, capacity=2**31), "capacity must be 1 to 2147483647, got 2147483648"),
])
def test_bad_sizes_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        moe_routing.plan_sends(np.zeros((4, 2), np.int32), **kwargs)
