"""Composition of metadata transforms: ``compose(f, g, h)(cam) == h(g(f(cam)))``.

Transforms take a CAM and return a CAM, except ``split_microbatches`` which returns a list: after a
list-returning stage the remaining stages are mapped over each part and the composition returns a list.
Bind parameters with ``functools.partial``::

    trim = partial(trim_sliding_window, sliding_window=512)
    step = compose(trim, partial(split_microbatches, num_ubatches=2))
    parts = step(cam)   # list of 2 trimmed microbatches
"""

from __future__ import annotations

from collections.abc import Callable

from hybridkv.metadata import CommonAttentionMetadata

__all__ = ["Transform", "compose"]

Transform = Callable[[CommonAttentionMetadata], "CommonAttentionMetadata | list[CommonAttentionMetadata]"]


def compose(*transforms: Transform) -> Callable[[CommonAttentionMetadata], CommonAttentionMetadata | list]:
    """Left-to-right composition; ``compose()`` is the identity. See the module docstring for lists."""
    for t in transforms:
        if not callable(t):
            raise ValueError(f"transforms: {t!r} is not callable")

    def run(cam: CommonAttentionMetadata) -> CommonAttentionMetadata | list[CommonAttentionMetadata]:
        value: CommonAttentionMetadata | list[CommonAttentionMetadata] = cam
        for t in transforms:
            if isinstance(value, list):
                flat: list[CommonAttentionMetadata] = []
                for part in value:
                    res = t(part)
                    flat.extend(res if isinstance(res, list) else [res])
                value = flat
            else:
                value = t(value)
        return value

    return run
