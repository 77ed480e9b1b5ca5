"""The KV cache as a fast block's ``forward`` sees it: this rank's heads as plain tensors in and out.

Contract: the cache object itself is updated with DTensors sharded on the head dim (under the model's factory
capture), exactly as on the DTensor path, so a cache is the same object, with the same values, placements, strides
and ``requires_grad``, whichever path filled it. A decode step growing transformers' ``DynamicLayer`` (no gradient)
concatenates on local tensors below autograd; any other update goes through the cache's own ``update`` on DTensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vescale.core import torch_internals
from vescale.dtensor.api import from_local_nograd
from vescale.parallel.factory import capture_resumed
from vescale.parallel.fast.boundary import CACHE_KEYS, FromLocal, to_local

__all__ = ["CacheOfDTensors", "wrap_caches", "set_cache_mode"]


class CacheOfDTensors:
    """The KV cache ``cache`` wrapped for a fast block: ``update`` takes and returns this rank's heads as plain
    tensors while the cache stores DTensors of ``placements`` (see the module docstring). ``mode``: the factory
    capture mode to resume around the cache's own ``update``."""

    def __init__(self, cache: Any, mesh, placements: tuple) -> None:
        self.cache, self.mesh, self.placements, self.mode = cache, mesh, placements, None

    def update(self, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any):
        layer = self._growing_layer(args, kwargs, key, value)
        if layer is not None:
            # what ``DynamicLayer.update`` does (concatenate on the sequence dim, which no placement shards), on this
            # rank's heads; the layer then holds DTensors of the same placements, as the DTensor path leaves it.
            # No gradient flows here (checked), so they are built below autograd, their spec shared by the layers.
            keys = torch.cat([torch_internals.local_tensor(layer.keys), key], dim=-2)
            values = torch.cat([torch_internals.local_tensor(layer.values), value], dim=-2)
            layer.keys = from_local_nograd(keys, self.mesh, self.placements)
            layer.values = from_local_nograd(values, self.mesh, self.placements)
            return keys, values
        key = FromLocal.apply(key, self.mesh, self.placements, self.placements)
        value = FromLocal.apply(value, self.mesh, self.placements, self.placements)
        with capture_resumed(self.mode):
            key, value = self.cache.update(key, value, *args, **kwargs)
        return to_local(key, self.placements), to_local(value, self.placements)

    def _growing_layer(self, args: tuple, kwargs: dict, key: torch.Tensor, value: torch.Tensor) -> Any:
        """The cache layer ``update`` would grow, if it is exactly transformers' ``DynamicLayer`` of a cache without
        offloading, already holding DTensors of these placements, and no gradient flows through the update (a
        decode step): then the concatenation can run on local tensors. None otherwise."""
        idx = args[0] if args else kwargs.get("layer_idx")
        layers = getattr(self.cache, "layers", None)
        if not isinstance(idx, int) or not isinstance(layers, list) or not 0 <= idx < len(layers):
            return None
        layer = layers[idx]
        if (type(layer).__qualname__, type(layer).__module__) != ("DynamicLayer", "transformers.cache_utils") \
                or getattr(self.cache, "offloading", True) or not getattr(layer, "is_initialized", False):
            return None
        for t in (layer.keys, layer.values):
            if not (isinstance(t, DTensor) and t.device_mesh == self.mesh and tuple(t.placements) == self.placements
                    and t.ndim == key.ndim and t.numel() > 0):
                return None
        if torch.is_grad_enabled() and any(t.requires_grad for t in (key, value, layer.keys, layer.values)):
            return None
        return layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


def wrap_caches(kwargs: dict, mesh, placements: tuple) -> dict:
    """``kwargs`` with a KV cache (if any) wrapped as a :class:`CacheOfDTensors` of head ``placements``."""
    for key in CACHE_KEYS:
        if kwargs.get(key) is not None:
            kwargs[key] = CacheOfDTensors(kwargs[key], mesh, placements)
    return kwargs


def set_cache_mode(kwargs: dict, mode) -> None:
    """Give a wrapped KV cache in ``kwargs`` the factory capture ``mode`` to resume around its own ``update``."""
    for key in CACHE_KEYS:
        if isinstance(kwargs.get(key), CacheOfDTensors):
            kwargs[key].mode = mode
