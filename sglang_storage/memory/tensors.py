"""Host tensors as what storage speaks: byte views and object specs.

- :func:`tensor_bytes` - the memory of a contiguous CPU tensor as a flat byte
  ``memoryview`` (no copy), what a :class:`~sglang_storage.core.GetRequest` fills and a
  :class:`~sglang_storage.core.PutRequest` stores.
- :func:`dtype_name` / :func:`tensor_spec` - torch's element type by the name an
  :class:`~sglang_storage.core.ObjectSpec` records, and the spec of a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_storage.core import ObjectSpec
from sglang_storage.errors import ConfigError

__all__ = ["dtype_name", "tensor_bytes", "tensor_spec"]


def tensor_bytes(tensor: torch.Tensor, *, owner: str = "tensor_bytes") -> memoryview:
    """A writable byte view of a contiguous CPU ``tensor``'s memory (no copy).

    Raises:
        ConfigError: the tensor is not on the CPU or not contiguous (a copy would not be
            the caller's memory).
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ConfigError(
            owner=owner,
            field="tensor",
            value=f"{tensor.device.type} tensor, contiguous={tensor.is_contiguous()}",
            reason="cannot be viewed as bytes in place",
            allowed="a contiguous CPU tensor",
        )
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data.cast("B")


def dtype_name(dtype: torch.dtype) -> str:
    """``dtype`` by its name without the ``torch.`` prefix (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def tensor_spec(dtype: torch.dtype, shape: Sequence[int], layout: str = "") -> ObjectSpec:
    """The stored-object spec of a tensor of ``dtype`` and ``shape``."""
    return ObjectSpec(dtype=dtype_name(dtype), shape=tuple(shape), layout=layout)
