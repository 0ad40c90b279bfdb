"""The device under the caching-allocator twin: what cudaMalloc and cuMemCreate can still get.

``DeviceMemory`` is the twin's CUDA driver. It knows three numbers: ``total_bytes`` (what
``cudaMemGetInfo`` reports as total), ``capacity_bytes`` (what this process's allocator can ever
obtain: total minus the CUDA context and other processes) and ``external_bytes`` (memory held outside
the caching allocator right now: NCCL buffers, a KV-cache arena allocated by other means, another
tenant). A request succeeds iff it fits in ``capacity - external - used``; nothing is fragmented at
this level (the real driver maps 2 MiB pages anywhere in virtual address space).

Addresses come from a bump pointer aligned to 2 MiB and are never reused, so a run is deterministic;
an expandable segment reserves ``1 1/8 x total`` of address space, as the real one does.

The allocator only talks to a driver through the six methods below, so a replay can substitute one
that answers from a recorded trace (``torch_allocator.replay.TraceDriver``).
"""

from __future__ import annotations

from typing import Protocol

DEFAULT_BASE_ADDRESS = 0x7F0000000000  # where CUDA's device address space usually starts on Linux
_ALIGN = 2 << 20


class Driver(Protocol):
    """What the caching allocator asks of CUDA."""

    def cuda_malloc(self, size: int) -> int | None: ...
    def cuda_free(self, address: int, size: int) -> None: ...
    def reserve_address_space(self, size: int) -> int: ...
    def release_address_space(self, address: int, size: int) -> None: ...
    def map_pages(self, address: int, size: int) -> bool: ...
    def unmap_pages(self, address: int, size: int) -> None: ...
    def mem_get_info(self) -> tuple[int, int]: ...


class ExternalReservationFailed(MemoryError):
    """Memory outside the allocator could not be taken: the device has less free than asked."""

    def __init__(self, requested_bytes: int, free_bytes: int):
        self.requested_bytes = requested_bytes
        self.free_bytes = free_bytes
        super().__init__(f"reserve_external({requested_bytes}): only {free_bytes} bytes are free on the device; "
                         f"free cached memory first (empty_cache) or reserve less")


class DeviceMemory:
    """A GPU's memory as CUDA's driver sees it (see the module docstring)."""

    def __init__(self, capacity_bytes: int, *, total_bytes: int | None = None,
                 base_address: int = DEFAULT_BASE_ADDRESS):
        total_bytes = capacity_bytes if total_bytes is None else total_bytes
        if capacity_bytes <= 0 or capacity_bytes > total_bytes:
            raise ValueError(f"capacity_bytes: expected 0 < capacity_bytes <= total_bytes ({total_bytes}), "
                             f"got {capacity_bytes}")
        self.total_bytes = total_bytes
        self.capacity_bytes = capacity_bytes
        self.external_bytes = 0
        self.used_bytes = 0  # held by the caching allocator: cudaMalloc'd segments and mapped pages
        self._next_address = base_address

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.external_bytes - self.used_bytes

    # ---- memory held outside the caching allocator -------------------------------------------
    def reserve_external(self, size: int) -> None:
        """Take ``size`` bytes for something the allocator does not manage; raises if they are not free."""
        if size < 0:
            raise ValueError(f"reserve_external: size must be >= 0, got {size}")
        if size > self.free_bytes:
            raise ExternalReservationFailed(size, self.free_bytes)
        self.external_bytes += size

    def release_external(self, size: int) -> None:
        if not 0 <= size <= self.external_bytes:
            raise ValueError(f"release_external: expected 0 <= size <= {self.external_bytes} reserved, got {size}")
        self.external_bytes -= size

    # ---- the driver calls the allocator makes ---------------------------------------------------
    def cuda_malloc(self, size: int) -> int | None:
        if size > self.free_bytes:
            return None
        self.used_bytes += size
        return self._take_addresses(size)

    def cuda_free(self, address: int, size: int) -> None:
        self.used_bytes -= size

    def reserve_address_space(self, size: int) -> int:
        return self._take_addresses(size)

    def release_address_space(self, address: int, size: int) -> None:
        """Address space is never reused (determinism); physical pages were unmapped before."""

    def map_pages(self, address: int, size: int) -> bool:
        if size > self.free_bytes:
            return False
        self.used_bytes += size
        return True

    def unmap_pages(self, address: int, size: int) -> None:
        self.used_bytes -= size

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) as cudaMemGetInfo reports them."""
        return self.free_bytes, self.total_bytes

    def _take_addresses(self, size: int) -> int:
        address = self._next_address
        self._next_address += -(-size // _ALIGN) * _ALIGN
        return address
