"""vescale.checkpoint: save on one mesh and strategy, load on any other.

Scope (being built): online resharding on load, a pickle-free format (safetensors + JSON), async and deduplicated
saves, fsspec storage, and export to Hugging Face safetensors. Useful without the rest of vescale.
"""

from __future__ import annotations

__all__: list[str] = []
