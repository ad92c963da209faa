"""The two Ulysses all-to-alls, for all heads or a chunk of them, synchronous or in flight.

Heads are chunked inside each rank's share: chunk `heads` (a slice of 0..H/N) of the exchange moves, for every
rank j, heads j*H/N + heads. Each exchange packs one send buffer (q, k, v together; output with the text rows
riding along) whose chunk j goes to rank j, hands it to a transport, and unpacks what comes back. The transport
of the backends is `all_to_all_single` on the group (NCCL, gloo); the kernel benchmark's loopback gives its own
(a copy), so that it runs exactly the backends' packing and schedule."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from ...runtime.distributed import waiting_for
from .layout import UlyssesLayout


class Waitable(Protocol):
    def wait(self) -> object: ...


@dataclass
class InFlight:
    """An exchange that was started: its receive buffer and, if asynchronous, what to wait on."""

    recv: torch.Tensor
    work: Waitable | None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.recv


# starts moving a send buffer (N, ...): chunk j to rank j; the receive buffer holds chunk j from rank j
Transport = Callable[[torch.Tensor], InFlight]

# the attention an exchange runs on what it gathered: this rank's q, k, v of head chunk `heads` (a slice of its
# share of the heads) over the whole sequence, (B, T + N*L, h, D) text first, to its output of the queries' rows
GatheredAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, slice], torch.Tensor]


def all_to_all(group: dist.ProcessGroup, async_op: bool = False) -> Transport:
    def what() -> str:  # described only when the exchange fails: this runs twice per attention layer
        return f"the attention all-to-all of its Ulysses group (ranks {dist.get_process_group_ranks(group)})"

    def start(send: torch.Tensor) -> InFlight:
        recv = torch.empty_like(send)
        with torch.no_grad(), waiting_for(what):  # inference only: collectives are not differentiable
            work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
        return InFlight(recv, None if work is None else _NamedWork(work, what))

    return start


@dataclass
class _NamedWork:
    """An all-to-all in flight whose failed wait says which rank waited for which peers."""

    work: Waitable
    what: Callable[[], str]

    def wait(self) -> object:
        with waiting_for(self.what):
            return self.work.wait()


def start_scatter(tensors: tuple[torch.Tensor, ...], layout: UlyssesLayout, transport: Transport,
                  heads: slice) -> InFlight:
    """Send chunk `heads` of every rank's head share of the image tokens of (B, T + L, H, D) tensors."""
    n_ranks = layout.degree
    parts = [layout.split(t)[1].unflatten(2, (n_ranks, -1))[:, :, :, heads] for t in tensors]  # (B, L, N, h, D)
    batch, local_len, _, chunk, head_dim = parts[0].shape
    send = parts[0].new_empty(n_ranks, len(parts), batch, local_len, chunk, head_dim)
    for i, part in enumerate(parts):
        send[:, i].copy_(part.permute(2, 0, 1, 3, 4))  # chunk j of the heads goes to rank j
    return transport(send)


def finish_scatter(flight: InFlight, tensors: tuple[torch.Tensor, ...], layout: UlyssesLayout,
                   heads: slice) -> list[torch.Tensor]:
    """(B, T + N*L, h, D) per input (queries without text rows: (B, N*L, h, D)): this rank's heads of the whole
    sequence, its text heads first."""
    recv = flight.wait()
    # recv[j] holds rank j's tokens: concatenating over j restores the sequence order
    image = recv.permute(1, 2, 0, 3, 4, 5).flatten(2, 3).unbind(0)
    if not layout.text_len:
        return list(image)
    share = tensors[0].shape[2] // layout.degree
    text_heads = slice(layout.rank * share + heads.start, layout.rank * share + heads.stop)
    return [torch.cat([layout.split(t)[0][:, :, text_heads], x], dim=1) for t, x in zip(tensors, image)]


def start_gather(out: torch.Tensor, layout: UlyssesLayout, transport: Transport) -> InFlight:
    """Send each rank its image rows of this rank's heads, and every rank this rank's text rows."""
    n_ranks, text_len = layout.degree, layout.query_text_len
    image = out[:, text_len:].unflatten(1, (n_ranks, layout.local_len)).transpose(0, 1)  # (N, B, L, h, D)
    if text_len:
        text = out[:, :text_len].unsqueeze(0).expand(n_ranks, -1, -1, -1, -1)
        send = torch.cat([text, image], dim=2)
    else:
        send = image.contiguous()
    return transport(send)


def finish_gather(flight: InFlight, layout: UlyssesLayout) -> torch.Tensor:
    """(B, T + L, N*h, D) in the layout's token order, heads ordered (rank, chunk head)."""
    recv = flight.wait()
    full = recv.permute(1, 2, 0, 3, 4).flatten(2, 3)  # recv[j]: this rank's rows of rank j's heads
    return layout.join(full[:, : layout.query_text_len], full[:, layout.query_text_len :])
