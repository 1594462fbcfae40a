"""What the Python half and the C++ handlers agree on, read from the native CPU module, which compiles
``xla_ffi/common/contract.h`` as the CUDA module does: the names and values of the enums that FFI attributes
carry, and the limits the lowering checks before a handler would. Python holds no copy of them; sizes that
depend on shapes (workspaces, slots, scratch) are asked of the CUDA module where a call site is lowered.
"""

from jax_ncclx._src import lib

_CONTRACT = lib.cpu_module().contract()


def _in_value_order(table: dict) -> tuple[str, ...]:
    """The names of a table whose values are 0, 1, ...: its index is its value."""
    names = tuple(sorted(table, key=table.get))
    if [table[name] for name in names] != list(range(len(names))):
        raise RuntimeError(f"jax_ncclx: the native contract's values are not 0..n-1: {table}")
    return names


# Injected fault kinds, by the value of monitor.h's FaultKind (JAX_NCCLX_FAULT's names).
FAULT_KINDS: tuple[str, ...] = _in_value_order(_CONTRACT["fault_kinds"])
# all_reduce / reduce_scatter's reduce_op attribute.
REDUCE_OPS: dict[str, int] = dict(_CONTRACT["reduce_ops"])
# The NVLink one-shot protocols, by their protocol attribute (JAX_NCCLX_NVLINK_PROTOCOL's names).
NVLINK_PROTOCOLS: tuple[str, ...] = _in_value_order(_CONTRACT["nvlink_protocols"])
# The NVLink all_reduce's algorithm attribute.
ONE_SHOT: int = _CONTRACT["nvlink_algorithms"]["one_shot"]
TWO_SHOT: int = _CONTRACT["nvlink_algorithms"]["two_shot"]
# moe.dispatch's wire attribute, by the wire dtype's name ("none": tokens' dtype).
MOE_WIRES: dict[str, int] = dict(_CONTRACT["moe_wires"])
# The float dtypes the MoE kernels convert and add (the 8-bit wire's tokens, moe.combine's rows), by dtype name.
FLOAT_TYPES: tuple[str, ...] = _in_value_order(_CONTRACT["float_types"])
# The dtypes the NVLink all_reduce and reduce_scatter kernels reduce, by dtype name.
REDUCE_TYPES: tuple[str, ...] = _in_value_order(_CONTRACT["reduce_types"])
# Values per float32 scale on moe.dispatch's 8-bit wire.
MOE_WIRE_BLOCK: int = _CONTRACT["moe_wire_block"]
# Device trace and fault records name their kernel by number.
TRACE_KERNELS: dict[int, str] = {value: name for name, value in _CONTRACT["trace_kernels"].items()}
# Ranks an NVLink communicator may have.
MAX_NVLINK_RANKS: int = _CONTRACT["max_nvlink_ranks"]
# The largest capacity (rows or pairs per member) the handlers take: their kernels index rows with int32.
MAX_CAPACITY: int = _CONTRACT["max_capacity"]
# The most experts moe's routing takes: its CUDA kernels count experts in shared memory.
MAX_EXPERTS: int = _CONTRACT["max_experts"]
