"""Can another process map XLA's device buffers? A diagnostic for one GPU, not a test or a benchmark.

With one process per GPU, jax_ncclx's kernels stage rows in the peers' symmetric memory, because they cannot
write into a peer's XLA output: that needs the output's allocation mapped into this process. This script
checks what that would take, under XLA's three allocators (BFC grown on demand, BFC preallocated, cuda_async):
for arrays of 64 B to 256 MiB, made by `jnp` and returned by a jitted function, it prints the allocation that
holds each buffer (`cuMemGetAddressRange`), its allowed export handle types (`cuPointerGetAttribute`) and
whether `cuIpcGetMemHandle` gives a legacy CUDA IPC handle; handles that it gives are opened in a second
process, which reads the first elements back and times the open.

    python tools/xla_buffer_ipc_probe.py            # every allocator, each in its own process
"""
import ctypes
import json
import os
import subprocess
import sys
import time

ALLOCATORS = {
    "bfc, grown on demand": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "bfc, preallocated": {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"},
    "cuda_async": {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"},
}
CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 17
ELEMENTS = (16, 1 << 12, 1 << 20, 1 << 24, 1 << 26)  # float32


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def driver():
    return ctypes.CDLL("libcuda.so.1")


def check(cu, result, call):
    if result != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{call} failed: {name.value.decode()}")


def error_name(cu, result):
    name = ctypes.c_char_p()
    cu.cuGetErrorName(result, ctypes.byref(name))
    return name.value.decode() if name.value else str(result)


def probe_allocator():
    """Runs in a process whose environment picks the allocator; prints one line per buffer."""
    import jax
    import jax.numpy as jnp

    cu = driver()
    made = [jnp.arange(n, dtype=jnp.float32) + 1 for n in ELEMENTS]
    returned = jax.jit(lambda xs: [x * 2 for x in xs])(made)
    jax.block_until_ready(returned)
    allocations, handles = set(), []
    for origin, arrays in (("jnp", made), ("jit output", returned)):
        for array in arrays:
            ptr = ctypes.c_uint64(array.addressable_data(0).unsafe_buffer_pointer())
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            check(cu, cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
            handle_types = ctypes.c_uint64()
            attribute = cu.cuPointerGetAttribute(ctypes.byref(handle_types),
                                                 CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, ptr)
            handle = IpcHandle()
            ipc = cu.cuIpcGetMemHandle(ctypes.byref(handle), ptr)
            allocations.add(base.value)
            print(f"  {origin:>10} {array.nbytes:>10} B: allocation of {size.value / 2**20:.1f} MiB, offset "
                  f"{ptr.value - base.value}, export handle types "
                  f"{handle_types.value if attribute == 0 else error_name(cu, attribute)}, "
                  f"cuIpcGetMemHandle {error_name(cu, ipc)}")
            if ipc == 0:
                handles.append((bytes(handle.reserved).hex(), ptr.value - base.value))
    print(f"  {len(allocations)} allocations hold the {2 * len(ELEMENTS)} buffers")
    if handles:
        opened = subprocess.run([sys.executable, __file__, "--open", json.dumps(handles)], capture_output=True,
                                text=True, timeout=120)
        print("  opened in another process:", opened.stdout.strip() or opened.stderr[-2000:])


def open_handles(handles):
    """Runs in a second process: opens each handle, reads its buffer's first float, times the open."""
    cu = driver()
    check(cu, cu.cuInit(0), "cuInit")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    check(cu, cu.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    check(cu, cu.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    check(cu, cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    results = []
    for hexed, offset in handles:
        handle = IpcHandle()
        ctypes.memmove(ctypes.byref(handle), bytes.fromhex(hexed), 64)
        mapped = ctypes.c_uint64()
        start = time.perf_counter()
        status = cu.cuIpcOpenMemHandle_v2(ctypes.byref(mapped), handle, 1)  # lazy peer access
        open_us = (time.perf_counter() - start) * 1e6
        first = ctypes.c_float()
        if status == 0:
            check(cu, cu.cuMemcpyDtoH_v2(ctypes.byref(first), ctypes.c_uint64(mapped.value + offset), 4), "copy")
            check(cu, cu.cuIpcCloseMemHandle(mapped), "cuIpcCloseMemHandle")
        results.append({"status": error_name(cu, status), "open_us": round(open_us, 1), "first": first.value})
    print(json.dumps(results))


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--open":
        return open_handles(json.loads(sys.argv[2]))
    if len(sys.argv) == 2 and sys.argv[1] == "--probe":
        return probe_allocator()
    for name, env in ALLOCATORS.items():
        print(f"== {name} ({' '.join(f'{k}={v}' for k, v in env.items())})", flush=True)
        subprocess.run([sys.executable, __file__, "--probe"], env={**os.environ, **env}, check=True, timeout=300)


if __name__ == "__main__":
    main()
