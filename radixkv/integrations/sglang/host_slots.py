"""SGLang's host slots as whole pages: the first slot of each page a call names, up to the first
one that is not a whole, aligned page inside the host pool."""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("radixkv.integrations.sglang")


class HostSlots:
    """Checks the host slots a get or set names against SGLang's host pool `host` (its
    `page_size` and `kv_buffer`; `direct`: the `page_first_direct` layout); logs once."""

    def __init__(self, host: Any, direct: bool) -> None:
        self.host = host
        self.direct = direct
        self.warned = False

    def page_starts(self, host_indices: torch.Tensor, pages: int) -> torch.Tensor:
        """The first slot of each of the leading `pages` pages of `host_indices` (page_size
        slots each), up to the first page not whole, aligned and inside SGLang's host pool
        (that one and those after it are left out, logged once)."""
        page = self.host.page_size
        tokens = self.host.kv_buffer.shape[1] * (page if self.direct else 1)
        whole = min(pages, len(host_indices) // page)
        slots = host_indices[:whole * page].to(torch.long).cpu().view(whole, page)
        starts = slots[:, 0]
        bad = ((starts < 0) | (starts % page != 0) | (starts > tokens - page)
               | (slots != starts[:, None] + torch.arange(page)).any(1)).nonzero()
        good = int(bad[0]) if len(bad) else whole
        if good < pages and not self.warned:
            self.warned = True
            log.error("radixkv: SGLang gave host slots that are not whole pages of its "
                      "%d-slot host pool (page %d of %d: %s); that page and those after it "
                      "are not copied (logged once)", tokens, good, pages,
                      host_indices[good * page:(good + 1) * page].tolist())
        return starts[:good]
