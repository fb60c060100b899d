"""Block offload on one device: a model's `blocks` live in host memory (pinned when the device is
a GPU) and only the block being computed, plus the next one, is on the device.

`offload_blocks(module, device)` replaces `module.blocks` (any `nn.ModuleList` attribute) by an
`OffloadedBlocks` list holding the same block modules. Iterating it, as every forward of our DiT
(`run_blocks`, `encode_reference`) and of a Wan-style DiT does, onloads block i before handing it
out and starts copying block i + 1 (the one after the last: block 0, the next forward's first)
while block i computes; leaving block i points its parameters back at nothing. Nothing in the
model changes: no forward is replaced, no hook depends on `block.forward` being called (ours are
called piece by piece: `mods`, `attn_in`, `attn_out`, `cross`, `ffn_out`).

Mechanism (`BlockStore`): each block's tensors are packed once into one flat host buffer (one
copy per block per use, a single large memcpy); the device holds two flat slots the size of the
largest block, and a block's parameters are views into the slot it was copied to. Between uses a
block's parameters are empty tensors: the weights on the device exist only in the slots, and the
store is the only full copy. On CUDA the copy runs on a side stream (pinned memory, non-blocking)
and the compute stream waits for its event; the copy into a slot waits for the compute that last
read that slot. On a CPU "device" the same code copies store -> slot synchronously: no overlap to
gain, but the same bytes move, so the equivalence tests exercise the real path.

Chosen over FSDP2 (`fully_shard(block, offload_policy=CPUOffloadPolicy())` on a world of 1,
`fsdp2_blocks` below, measured by `bench switch`): FSDP2's onload runs from its forward hooks,
which never fire for blocks called piece by piece, so it needs the same iteration protocol
anyway (`unshard`/`reshard` by hand); it needs a process group even on one GPU; its parameters
become DTensors between uses (state-dict keys, LoRA merge and fp8 casts must know); and it keeps
a full-size unsharded copy per block it gathers (allocated and freed each time) where the store
reuses two slots; and its `unshard` cannot run under `torch.inference_mode` (its version-counter
bookkeeping), which every call of our models runs in. And it is slower where it can be measured:
one DiT forward on one causal block (`bench switch`, CPU, 1 thread, median of 20): tiny DiT
(2 blocks) resident 1.52 ms, store 1.64 ms, FSDP2 2.89 ms; small DiT (6 blocks, 18 MB) resident
30.7 ms, store 33.5 ms (+9 %), FSDP2 36.8 ms (+20 %). On a CPU these are the mechanisms'
overheads (the copies are memcpy); GPU timing (PCIe copies overlapped on the side stream) pending.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

ALIGN = 64  # bytes: every tensor's offset in a flat buffer


def _tensors(block: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """(owner module, name, is_parameter) of every parameter and buffer of `block`."""
    out = []
    for mod in block.modules():
        out += [(mod, n, True) for n, p in mod._parameters.items() if p is not None]
        out += [(mod, n, False) for n, b in mod._buffers.items() if b is not None]
    return out


def _get(owner: nn.Module, name: str, is_param: bool) -> torch.Tensor:
    return (owner._parameters if is_param else owner._buffers)[name]  # type: ignore[return-value]


def _point(owner: nn.Module, name: str, is_param: bool, t: torch.Tensor) -> None:
    if is_param:
        owner._parameters[name].data = t  # type: ignore[union-attr]
    else:
        owner._buffers[name] = t


class BlockStore:
    """Host copies of blocks, two device slots, and which block sits in which slot."""

    def __init__(self, blocks: nn.ModuleList, device: torch.device | str, *, pin: bool | None = None) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        pin = cuda if pin is None else pin
        self.entries = [_tensors(b) for b in blocks]
        self.layout: list[list[tuple[int, torch.dtype, torch.Size]]] = []  # offset, dtype, shape
        self.store: list[torch.Tensor] = []  # flat uint8 host buffer per block
        for ent in self.entries:
            offs, off = [], 0
            for owner, name, is_param in ent:
                t = _get(owner, name, is_param)
                offs.append((off, t.dtype, t.shape))
                off += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
            flat = torch.empty(off, dtype=torch.uint8, pin_memory=pin)
            for (o, _, _), (owner, name, is_param) in zip(offs, ent):
                t = _get(owner, name, is_param).detach()
                flat[o : o + t.numel() * t.element_size()].copy_(t.contiguous().view(-1).view(torch.uint8).cpu())
            self.layout.append(offs)
            self.store.append(flat)
        self.slots: list[torch.Tensor] = []  # two flat device buffers (`_allocate`)
        self.views: list[list[list[torch.Tensor]]] = []  # per slot, per block: its tensors in the slot
        self.empty = [[torch.empty(0, dtype=dt, device=self.device) for _, dt, _ in offs] for offs in self.layout]
        self.in_slot: list[int | None] = [None, None]  # block whose bytes a slot holds (or will)
        self.events: list[Any] = [None, None]
        self.in_use: int | None = None
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.bytes_moved = 0
        for i in range(len(self.entries)):
            self.release(i)
        self._allocate()

    def _allocate(self) -> None:
        """The two device slots, and every block's tensors as views into each (made once per
        allocation, as normal tensors even inside an inference-mode call: a later copy into a
        slot outside inference mode would be refused on an inference tensor)."""
        with torch.inference_mode(False):
            self._allocate_slots()

    def _allocate_slots(self) -> None:
        size = max((s.numel() for s in self.store), default=0)
        self.slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]

        def view(slot: torch.Tensor, o: int, dt: torch.dtype, sh: torch.Size) -> torch.Tensor:
            if sh.numel() == 0:
                return torch.empty(sh, dtype=dt, device=self.device)
            return slot[o : o + sh.numel() * dt.itemsize].view(dt).view(sh)

        self.views = [[[view(s, o, dt, sh) for o, dt, sh in offs] for offs in self.layout] for s in self.slots]
        self.in_slot, self.events = [None, None], [None, None]

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks in host memory (what never sits on the device at once)."""
        return sum(s.numel() for s in self.store)

    def _copy(self, i: int, s: int) -> None:
        """Start copying block i into slot s (after the compute that last read slot s)."""
        n = self.store[i].numel()
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                self.slots[s][:n].copy_(self.store[i], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.copy_stream)
            self.events[s] = ev
        else:
            self.slots[s][:n].copy_(self.store[i])
        self.in_slot[s] = i
        self.bytes_moved += n

    def prefetch(self, i: int) -> None:
        """Start onloading block i into the slot the block in use does not hold."""
        if not self.slots:
            self._allocate()
        if i in self.in_slot:
            return
        busy = self.in_slot.index(self.in_use) if self.in_use in self.in_slot else None
        self._copy(i, 1 if busy == 0 else 0)

    def ensure(self, i: int) -> None:
        """Block i on the device, its parameters pointing at its slot (waits for its copy)."""
        if self.in_use is not None and self.in_use != i:
            self.release(self.in_use)  # one block in use at a time (indexing leaves one held)
        if i not in self.in_slot:
            self.prefetch(i)
        s = self.in_slot.index(i)
        if self.events[s] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.events[s])
        for (owner, name, is_param), view in zip(self.entries[i], self.views[s][i]):
            _point(owner, name, is_param, view)
        self.in_use = i

    def release(self, i: int) -> None:
        """Block i's parameters back to empty (its bytes stay in the slot until overwritten)."""
        for (owner, name, is_param), e in zip(self.entries[i], self.empty[i]):
            _point(owner, name, is_param, e)
        if self.in_use == i:
            self.in_use = None

    def drop_slots(self) -> None:
        """Give both slots' device memory back: the model leaves the device (the next `ensure`
        allocates them again). Asynchronous on CUDA: the caching allocator hands the memory to
        the next allocation of the compute stream, ordered after the kernels that read it."""
        if self.in_use is not None:
            self.release(self.in_use)
        if self.copy_stream is not None:  # a prefetch still in flight must land first
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        self.slots, self.views = [], []
        self.in_slot, self.events = [None, None], [None, None]

    @property
    def on_device(self) -> bool:
        return bool(self.slots)


class OffloadedBlocks(nn.ModuleList):
    """`blocks` whose iteration onloads each block just in time and the next one ahead."""

    def __init__(self, blocks: nn.ModuleList, store: Any, *, prefetch: bool = True) -> None:
        super().__init__(list(blocks))
        object.__setattr__(self, "store", store)  # not a submodule: `.to()` must not move it
        object.__setattr__(self, "then", None)  # the store of the model that runs next, if any
        self.prefetch = prefetch

    def __iter__(self) -> Iterator[nn.Module]:
        n = len(self)
        i = 0
        try:
            for i in range(n):
                self.store.ensure(i)
                if self.prefetch:  # the next block; after the last, the next forward's first
                    nxt = self.then if i == n - 1 and self.then is not None else self.store
                    nxt.prefetch((i + 1) % n if nxt is self.store else 0)
                yield self._modules[str(i)]  # type: ignore[misc]
                self.store.release(i)
        except GeneratorExit:  # the caller stopped early (`break`)
            self.store.release(i)
            raise

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, int):
            self.store.ensure(idx % len(self))
        return super().__getitem__(idx)


def offload_blocks(module: nn.Module, device: torch.device | str, *, attr: str = "blocks",
                   prefetch: bool = True, pin: bool | None = None) -> BlockStore:
    """Keep `module.<attr>` (an nn.ModuleList) in host memory, onloaded block by block to
    `device` (see the module docstring); the rest of `module` stays where it is. Returns the
    store (bytes moved, host bytes)."""
    blocks = getattr(module, attr)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(module).__name__}.{attr} is not an nn.ModuleList")
    store = BlockStore(blocks, device, pin=pin)
    setattr(module, attr, OffloadedBlocks(blocks, store, prefetch=prefetch))
    return store


def hand_over(blocks: OffloadedBlocks, incoming: BlockStore | None) -> None:
    """Model switches: after `blocks`' last block, prefetch `incoming`'s first block (the model
    that runs next) instead of `blocks`' own first (None: back to that)."""
    object.__setattr__(blocks, "then", incoming)


def switch(outgoing: BlockStore, incoming: BlockStore) -> None:
    """Hand the device from one offloaded model to the next: the outgoing model's slots are
    released (asynchronously on CUDA) and the incoming model's first block is made resident
    (already in flight when `hand_over` started it during the outgoing model's last block)."""
    outgoing.drop_slots()
    incoming.ensure(0)


class _FSDP2Store:
    """The FSDP2 alternative behind the same iteration: each block `fully_shard`-ed with
    `CPUOffloadPolicy` (needs a process group; a world of 1 on one device), onloaded by
    `unshard()` (the next one with `async_op=True`) and offloaded by `reshard()`."""

    def __init__(self, blocks: nn.ModuleList, device: torch.device | str) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        dev = torch.device(device)
        mesh = init_device_mesh(dev.type, (1,))
        self.blocks = list(blocks)
        for b in self.blocks:
            fully_shard(b, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=dev.type == "cuda"))
        self.handles: dict[int, Any] = {}
        self.bytes_moved = 0
        self.nbytes = sum(p.numel() * p.element_size() for b in self.blocks for p in b.parameters())

    def ensure(self, i: int) -> None:
        h = self.handles.pop(i, None)
        if h is not None:
            h.wait()
        else:
            self.blocks[i].unshard()
        self.bytes_moved += sum(p.numel() * p.element_size() for p in self.blocks[i].parameters())

    def prefetch(self, i: int) -> None:
        if i not in self.handles:
            self.handles[i] = self.blocks[i].unshard(async_op=True)

    def release(self, i: int) -> None:
        if i not in self.handles:
            self.blocks[i].reshard()


def fsdp2_blocks(module: nn.Module, device: torch.device | str, *, attr: str = "blocks") -> Any:
    """`offload_blocks` with FSDP2 doing the moving (for the measurement that chose the store)."""
    blocks = getattr(module, attr)
    store = _FSDP2Store(blocks, device)
    setattr(module, attr, OffloadedBlocks(blocks, store))
    return store
