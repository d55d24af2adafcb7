"""`mtp`: placeholder, being written."""
from __future__ import annotations

from shuili.core.spec.base import Drafter


class MtpDrafter(Drafter):
    name = "mtp"
    on_device = True
    needs_hidden = True

    @classmethod
    def unsupported(cls, model) -> str | None:
        if getattr(model, "mtp", None) is None:
            return "the model has no MTP block"
        return None
