"""The prefill paths an engine runs, and the reuse modes a request may name.

Adding a path: one module with a class implementing :class:`semkv.reuse.base.ReusePath`, and one
line in :data:`PATH_TYPES`. ``reuse="auto"`` asks every path but ``full`` for a plan.
"""

from __future__ import annotations

from pathlib import Path

from semkv.reuse.base import ReusePath
from semkv.reuse.blend import BlendReuse
from semkv.reuse.full import FullPrefill
from semkv.reuse.lsh import IndexConfig
from semkv.reuse.prefix import PrefixReuse
from semkv.reuse.share import SharePath

PATH_TYPES: dict[str, type] = {
    FullPrefill.name: FullPrefill,
    PrefixReuse.name: PrefixReuse,
    BlendReuse.name: BlendReuse,
    SharePath.name: SharePath,
}
FULL = FullPrefill.name
# "none" = full prefill; "auto" = the path that reuses most; otherwise one path by name.
REUSE_MODES: tuple[str, ...] = ("auto", "none", *(name for name in PATH_TYPES if name != FULL))


def build_paths(
    share_index_folder: Path | None = None, share_index: IndexConfig | None = None
) -> dict[str, ReusePath]:
    """One instance of every path for one engine (the share path owns that engine's reference index).

    share_index_folder: where the share path's index persists (None: memory only).
    """
    return {
        FULL: FullPrefill(),
        PrefixReuse.name: PrefixReuse(),
        BlendReuse.name: BlendReuse(),
        SharePath.name: SharePath(share_index_folder, share_index),
    }
