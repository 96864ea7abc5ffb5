"""``python -m sglang_storage``: the same as the ``sglang-storage`` command."""

from __future__ import annotations

from sglang_storage.cli import main

raise SystemExit(main())
