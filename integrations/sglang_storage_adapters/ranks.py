"""Bounded agreement between the ranks of an SGLang process group, for the adapters.

SGLang agrees across TP ranks with blocking collectives (``all_reduce(MIN)`` on gloo
groups); a rank that never joins hangs the others. The adapters agree through
:class:`~sglang_storage.managers.ranks.StoreRankSync` on the default ``torch.distributed``
store instead: no collective, and a rank that does not answer within the bound makes the
operation a miss on every rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Final

from sglang_storage.errors import ConfigError
from sglang_storage.managers.ranks import ProposingRankSync, SingleRank, StoreRankSync

__all__ = ["rank_sync"]

_OWNER: Final = "sglang_storage rank agreement"
_GENERATIONS: Counter[str] = Counter()


def rank_sync(groups: Sequence[Any], *, name: str = "hicache") -> ProposingRankSync:
    """Bounded agreement over the ranks of the one group in ``groups`` with several ranks.

    ``name`` keeps the agreements of different users (``hicache``, ``decode``) apart.
    Built on the default ``torch.distributed`` store (no collective, nothing blocks); one
    rank, or no initialised ``torch.distributed``, is :class:`SingleRank`.

    Raises:
        ConfigError: more than one of ``groups`` spans several ranks (TP with PP or CP).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return SingleRank()
    wide = [g for g in groups if g is not None and dist.get_world_size(group=g) > 1]
    if not wide:
        return SingleRank()
    if len(wide) > 1:
        raise ConfigError(
            owner=_OWNER,
            field="parallelism",
            value=len(wide),
            reason="spans several rank groups (e.g. TP with PP or attention CP)",
            allowed="one group of several ranks (TP); leave this manager out of "
            "--storage-managers under PP or attention CP",
        )
    ranks = sorted(int(r) for r in dist.get_process_group_ranks(wide[0]))
    group = f"{name}/" + "-".join(map(str, ranks))
    # Every rank builds its agreements in the same order (construction, reset), so the
    # n-th one of a group has the same generation everywhere and never reads old keys.
    _GENERATIONS[group] += 1
    store = dist.distributed_c10d.PrefixStore(
        f"sglang_storage/{group}/g{_GENERATIONS[group]}/",
        dist.distributed_c10d._get_default_store(),
    )
    return StoreRankSync(store, rank=ranks.index(dist.get_rank()), world_size=len(ranks))
