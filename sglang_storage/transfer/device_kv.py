"""The device side of a KV transfer: per-layer tensors shaped as SGLang's device pools.

SGLang's device pools (``MHATokenToKVPool``, ``MLATokenToKVPool``) hold one tensor per layer,
indexed by token: MHA has a K and a V tensor per layer, each ``(tokens, head_num,
head_dim)``; MLA has one latent tensor per layer, ``(tokens, 1, kv_lora_rank +
qk_rope_head_dim)``. :class:`DeviceKV` describes such a pool without importing SGLang
(``DeviceKV(geometry=..., k=tuple(pool.k_buffer), v=tuple(pool.v_buffer))`` wraps an
SGLang pool's own tensors, no copy), checked once against the host pool's
:class:`~sglang_storage.memory.KVGeometry`.

Contract, one line per primitive:

- ``DeviceKV(geometry, k, v)`` - validated on construction: layer count, shape, element
  type, one device, contiguous rows; :class:`ConfigError` naming what was wrong.
- ``DeviceKV.allocate(geometry, tokens, device)`` - a zero-filled pool of ``tokens`` slots.
- ``require_compatible(host)`` - :class:`ConfigError` unless ``host`` has this pool's
  attention kind, element type, layer count, heads, head dim and page size.
- ``planes(layer)`` - the layer's tensors: ``(k, v)`` for MHA, ``(latent,)`` for MLA.
- ``device_pages(tokens, distinct=...)`` - token indices naming whole device pages
  (``page_size`` consecutive tokens from a multiple of ``page_size``) to page numbers;
  :class:`ConfigError` for partial pages, out-of-range or repeated pages.
- ``trusted_pages(tokens)`` - the same without looking at the values (no device sync; a
  device tensor stays on its device), for indices the caller vouches for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import attrs
import numpy as np
import torch

from sglang_storage.config import instance_of, require_int
from sglang_storage.errors import ConfigError
from sglang_storage.memory import KVGeometry, KVHostPool

__all__ = ["DeviceKV", "as_index_tensor", "check_distinct"]

_SHOWN = 8  # offending values an error lists


def _tensors(value: object) -> tuple[torch.Tensor, ...]:
    if not isinstance(value, list | tuple):
        raise ConfigError(
            owner="DeviceKV",
            field="k/v",
            value=type(value).__name__,
            reason="must be a list or tuple of per-layer tensors",
        )
    return tuple(value)


def _optional_tensors(value: object) -> tuple[torch.Tensor, ...] | None:
    return None if value is None else _tensors(value)


def as_index_tensor(
    values: torch.Tensor | Sequence[int], *, owner: str, field: str
) -> torch.Tensor:
    """``values`` as a 1-D int64 CPU tensor (a device tensor is copied to the host).

    Raises:
        ConfigError: ``values`` is not a 1-D integer tensor or a sequence of ints.
    """
    if isinstance(values, torch.Tensor):
        return _index_tensor(values, owner=owner, field=field).to(device="cpu")
    items = list(values)
    if any(isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer) for v in items):
        raise ConfigError(
            owner=owner, field=field, value=items[:_SHOWN], reason="must be a sequence of ints"
        )
    return torch.tensor([int(v) for v in items], dtype=torch.int64)


def _index_tensor(values: torch.Tensor, *, owner: str, field: str) -> torch.Tensor:
    """``values`` (1-D, integer) as int64 on its own device; only metadata is read."""
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ConfigError(
            owner=owner,
            field=field,
            value=f"tensor of {values.dtype}",
            reason="must be an integer tensor",
            allowed="torch.int64 or torch.int32",
        )
    if values.dim() != 1:
        raise ConfigError(
            owner=owner,
            field=field,
            value=f"tensor of shape {tuple(values.shape)}",
            reason="must be 1-D",
        )
    return values.to(dtype=torch.int64)


def check_distinct(index: torch.Tensor, *, owner: str, field: str, what: str) -> None:
    """Raise :class:`ConfigError` when ``index`` (1-D int64 CPU) repeats a value."""
    if index.numel() < 2:
        return
    values, counts = np.unique(index.numpy(), return_counts=True)
    if values.size != index.numel():
        raise ConfigError(
            owner=owner,
            field=field,
            value=values[counts > 1][:_SHOWN].tolist(),
            reason=f"are repeated; {what}",
        )


def _fail(field: str, value: object, reason: str) -> NoReturn:
    raise ConfigError(owner="DeviceKV", field=field, value=value, reason=reason)


def _check_tensor(geometry: KVGeometry, field: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        _fail(field, type(tensor).__name__, "must be a torch.Tensor")
    g = geometry
    shape = tuple(tensor.shape)
    want = (g.head_num, g.head_dim)
    kind = "(tokens, 1, kv_lora_rank + qk_rope_head_dim)" if g.is_mla else "(tokens, H, D)"
    if tensor.dim() != 3 or shape[1:] != want:
        _fail(field, f"shape {shape}", f"must be {kind} with (H, D) = {want}")
    if tensor.dtype != g.dtype:
        _fail(field, str(tensor.dtype), f"must have the host pool's element type {g.dtype}")
    if not tensor.is_contiguous():
        _fail(field, "a non-contiguous tensor", "must be contiguous")
    return tensor


@attrs.frozen(kw_only=True, eq=False)
class DeviceKV:
    """A device KV pool as SGLang holds it: one tensor per layer (and per K/V for MHA).

    Attributes:
        geometry: The host pool's geometry; attention kind, element type, layer count,
            ``head_num``, ``head_dim`` and ``page_size`` must match. (Layout and page count
            are the host's own.)
        k: Per layer, the K tensor ``(tokens, head_num, head_dim)`` (MHA) or the latent
            tensor ``(tokens, 1, head_dim)`` (MLA).
        v: Per layer, the V tensor (MHA); ``None`` for MLA.

    Raises:
        ConfigError: a tensor has the wrong shape, element type, device or layout in
            memory, or the layer counts differ.
    """

    geometry: KVGeometry = attrs.field(validator=instance_of(KVGeometry))
    k: tuple[torch.Tensor, ...] = attrs.field(converter=_tensors)
    v: tuple[torch.Tensor, ...] | None = attrs.field(default=None, converter=_optional_tensors)

    def __attrs_post_init__(self) -> None:
        g = self.geometry
        if g.is_mla and self.v is not None:
            _fail("v", "a V tensor list", "must be None for MLA (the latent is in k)")
        if not g.is_mla and self.v is None:
            _fail("v", None, "is required for MHA (one V tensor per layer)")
        planes = {"k": self.k} if self.v is None else {"k": self.k, "v": self.v}
        for name, layers in planes.items():
            if len(layers) != g.layer_num:
                _fail(name, f"{len(layers)} tensors", f"must hold one per layer ({g.layer_num})")
        checked = [
            (field, _check_tensor(g, field, tensor))
            for name, layers in planes.items()
            for field, tensor in ((f"{name}[{i}]", t) for i, t in enumerate(layers))
        ]
        first = checked[0][1]
        for field, tensor in checked:
            if tensor.shape[0] != first.shape[0]:
                _fail(
                    field,
                    f"{tensor.shape[0]} tokens",
                    f"must hold as many tokens as k[0] ({first.shape[0]})",
                )
            if tensor.device != first.device:
                _fail(field, str(tensor.device), f"must be on k[0]'s device ({first.device})")
        if first.shape[0] < g.page_size:
            _fail("k[0]", f"{first.shape[0]} tokens", f"must hold a page ({g.page_size} tokens)")

    @classmethod
    def allocate(
        cls, geometry: KVGeometry, tokens: int, device: torch.device | str = "cpu"
    ) -> DeviceKV:
        """A zero-filled device pool of ``tokens`` token slots on ``device``.

        Raises:
            ConfigError: ``tokens`` is not an int of at least one page.
        """
        g = geometry
        require_int(tokens, owner="DeviceKV.allocate", field="tokens", low=g.page_size)

        def layers() -> tuple[torch.Tensor, ...]:
            shape = (tokens, g.head_num, g.head_dim)
            return tuple(
                torch.zeros(shape, dtype=g.dtype, device=device) for _ in range(g.layer_num)
            )

        return cls(geometry=g, k=layers(), v=None if g.is_mla else layers())

    # ------------------------------------------------------------------ facts

    @property
    def device(self) -> torch.device:
        """Where the tensors live."""
        return self.k[0].device

    @property
    def tokens(self) -> int:
        """Token slots per layer."""
        return int(self.k[0].shape[0])

    @property
    def num_pages(self) -> int:
        """Whole pages per layer (a trailing partial page is not addressable)."""
        return self.tokens // self.geometry.page_size

    def require_compatible(self, host: KVHostPool) -> None:
        """Check that pages can move between this pool and ``host`` as they are.

        Raises:
            ConfigError: a shape fact differs (the error names it and both values).
        """
        mine, theirs = self.geometry, host.geometry
        for name in ("attention", "dtype", "layer_num", "head_num", "head_dim", "page_size"):
            want, got = getattr(theirs, name), getattr(mine, name)
            if want != got:
                raise ConfigError(
                    owner="DeviceKV",
                    field=f"geometry.{name}",
                    value=got,
                    reason=f"must match the host pool {host.label!r}",
                    allowed=str(want),
                )

    def planes(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s tensors: ``(k, v)`` for MHA, ``(latent,)`` for MLA."""
        return (self.k[layer],) if self.v is None else (self.k[layer], self.v[layer])

    def device_pages(
        self, tokens: torch.Tensor | Sequence[int], *, distinct: bool, owner: str
    ) -> torch.Tensor:
        """The device page numbers that token indices ``tokens`` name, in order.

        ``tokens`` must list whole pages: for each page, its ``page_size`` tokens in
        order, starting at a multiple of ``page_size`` (what SGLang's paged allocator hands
        out). A device tensor is copied to the host to be checked (a device sync).

        Args:
            tokens: Token indices.
            distinct: Whether a page may appear only once (it is written to).
            owner: Named in errors.

        Raises:
            ConfigError: partial or misaligned pages, out-of-range or repeated pages.
        """
        index = as_index_tensor(tokens, owner=owner, field="device_tokens")
        ps = self._whole_pages(index, owner)
        rows = index.view(-1, ps)
        starts = rows[:, 0]
        offsets = torch.arange(ps, dtype=torch.int64)
        partial = (starts % ps != 0) | (rows != starts.unsqueeze(1) + offsets).any(dim=1)
        if bool(partial.any()):
            bad = rows[partial][:2].tolist()
            raise ConfigError(
                owner=owner,
                field="device_tokens",
                value=bad,
                reason=(
                    f"must be whole pages: {ps} consecutive tokens starting at a multiple "
                    f"of page_size ({ps})"
                ),
            )
        pages = starts // ps
        limit = self.num_pages
        out = (pages < 0) | (pages >= limit)
        if bool(out.any()):
            raise ConfigError(
                owner=owner,
                field="device_tokens",
                value=(pages[out][:_SHOWN] * ps).tolist(),
                reason="name pages outside the device pool",
                allowed=f"tokens 0 .. {limit * ps - 1}",
            )
        if distinct:
            check_distinct(
                pages,
                owner=owner,
                field="device_tokens",
                what="a transfer writes each device page once (page numbers listed)",
            )
        return pages

    def trusted_pages(self, tokens: torch.Tensor | Sequence[int], *, owner: str) -> torch.Tensor:
        """The device page numbers of ``tokens``, trusted to list whole pages; no device sync.

        The caller must guarantee that every ``page_size`` tokens of ``tokens`` are one
        whole page: ``page_size`` consecutive tokens starting at a multiple of
        ``page_size``, in this pool's index space. Each page is named by its first token
        divided by ``page_size``, so a misaligned run is copied as the page its first token
        falls in, silently (tokens ``1 .. 4`` of pages of 4 become tokens ``0 .. 3``).
        Only what needs no look at the values is checked: a 1-D integer tensor (or ints)
        whose length is a multiple of ``page_size``; a device tensor stays on its device, so
        nothing waits for the GPU. Partial, misaligned, out-of-range or repeated pages are
        not detected (on CUDA an out-of-range index is a device-side error). Callers
        establish the guarantee once, where the indices come from (the SGLang adapters
        accept only allocators that hand out whole pages); :meth:`device_pages` checks
        every call instead.

        Raises:
            ConfigError: not a 1-D integer tensor or sequence of ints, or not whole pages.
        """
        if isinstance(tokens, torch.Tensor):
            index = _index_tensor(tokens, owner=owner, field="device_tokens")
        else:
            index = as_index_tensor(tokens, owner=owner, field="device_tokens")
        ps = self._whole_pages(index, owner)
        return index.reshape(-1, ps)[:, 0].div(ps, rounding_mode="floor")

    def _whole_pages(self, index: torch.Tensor, owner: str) -> int:
        """``page_size``, once ``index`` is checked to hold a whole number of pages."""
        ps = self.geometry.page_size
        n = index.numel()
        if n % ps:
            raise ConfigError(
                owner=owner,
                field="device_tokens",
                value=f"{n} tokens",
                reason=f"must be whole pages: a multiple of page_size ({ps})",
            )
        return ps
