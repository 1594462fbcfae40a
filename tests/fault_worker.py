"""One process of the multi-process fault test:
python fault_worker.py PROCESS_ID NUM_PROCESSES PORT SCENARIO TRANSPORT.

Each process drives one GPU (every GPU visible, so the NVLink kernels map their peers through CUDA IPC; or
TRANSPORT=nccl). After a healthy all_reduce, the last rank fails the next one: SCENARIO "skip" makes it skip
the call (JAX_NCCLX_FAULT), "kill" makes its process exit before it. Every other process must get an error
naming the call within seconds and print FAULT REPORTED; the skipping process prints SKIPPED.
"""

import logging
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
scenario, transport = sys.argv[4], sys.argv[5]
os.environ.update(JAX_NCCLX_TRANSPORT=transport, JAX_NCCLX_TIMEOUT_S="3", JAX_NCCLX_TRACE="1")

import jax  # noqa: E402

logging.basicConfig(format="%(asctime)s %(message)s")
logging.getLogger("jax_ncclx").setLevel(logging.DEBUG)

jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id,
                           local_device_ids=[process_id])

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ncclx as nx  # noqa: E402
from jax_ncclx._src import compat  # noqa: E402

n = jax.device_count()
last = n - 1
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
x = jax.make_array_from_callback((n, 256), NamedSharding(mesh, P("x")), lambda i: np.ones((n, 256), np.float32)[i])


def program(scale):
    return jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "x") * scale, mesh=mesh, in_specs=P("x"),
                                 out_specs=P("x")))


healthy = program(1.0)(x)
assert float(healthy.addressable_shards[0].data[0, 0]) == n, healthy.addressable_shards[0].data
seq = max(r["seq"] for r in nx.trace.records()) + 1
os.environ["JAX_NCCLX_FAULT"] = f"skip:rank={last},seq={seq}" if scenario == "skip" else ""
faulty = program(2.0)
faulty.lower(x).compile()  # every process lowers (communicator set-up is collective) before one goes away
client = compat.distributed_client()
client.wait_at_barrier("compiled", 60_000)

if scenario == "kill" and process_id == last:
    print("KILLED", flush=True)
    os._exit(3)

started = time.monotonic()
jax.block_until_ready(faulty(x))
print(f"faulty call returned after {time.monotonic() - started:.2f} s", flush=True)
if process_id == last and scenario == "skip":
    print("SKIPPED", flush=True)
    for peer in range(last):  # keep this process (and its memory, which peers write into) until they report
        client.blocking_key_value_get(f"reported/{peer}", 60_000)
    sys.exit(0)
try:
    nx.check_errors()
    print("NO FAULT REPORTED", flush=True)
    sys.exit(1)
except nx.CollectiveError as error:
    print(f"FAULT REPORTED: {error}", flush=True)
client.key_value_set(f"reported/{process_id}", "1")
if scenario == "kill":
    if process_id == 0:  # this process hosts the key-value store: keep it until the other survivors are done
        for peer in range(1, last):
            try:
                client.blocking_key_value_get(f"reported/{peer}", 60_000)
            except Exception as error:  # noqa: BLE001 - that peer's own output says what went wrong
                print(f"process {peer} did not report within 60 s: {error}", flush=True)
    # JAX's distributed shutdown would wait at its exit barrier for the dead process: leave directly.
    sys.stdout.flush()
    os._exit(0)
