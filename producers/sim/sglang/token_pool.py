"""SGLang's token-to-KV pool allocator: slots of the KV pool handed out a page at a time.

Follows SGLang 0.5.23 ``srt/mem_cache/allocator/paged.py`` (``PagedTokenToKVPoolAllocator``) and,
for ``page_size == 1``, ``allocator/token.py`` (``TokenToKVPoolAllocator``), with ``need_sort=False``
(what the scheduler builds outside prefill/decode disaggregation, ``kv_cache_configurator.py``):

- the pool holds ``size`` token slots, ``size // page_size`` pages numbered from 1 (page 0 is the
  padded slot SGLang writes dummy outputs to: never handed out); slot ``s`` is in page
  ``s // page_size``;
- ``free_pages`` is an ordered list; an allocation takes pages from its head;
- a free puts the freed pages back at the head, in the order given, when ``page_size > 1``
  (``_release_page_ids``: ``cat(page_ids, free_pages)``), and at the tail when ``page_size == 1``
  (``TokenToKVPoolAllocator.free``: ``cat(free_pages, free_index)``). So the next request reuses
  the pages the last free returned first, or, at page size 1, the oldest free slots;
- ``available_size`` counts free tokens (free pages times ``page_size``).

Check, then act: ``alloc`` returns None and changes nothing when the pool is short.
"""

from __future__ import annotations

from collections import deque


class TokenPool:
    """The free-page list of one KV pool; see the module docstring."""

    def __init__(self, size_tokens: int, page_size: int):
        if page_size <= 0 or size_tokens < page_size:
            raise ValueError(f"a pool of {size_tokens} tokens cannot hold one page of {page_size}")
        self.size = size_tokens
        self.page_size = page_size
        self.num_pages = size_tokens // page_size
        self.free_pages: deque[int] = deque(range(1, self.num_pages + 1))

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        """``num_pages`` pages from the head of the free list, or None (nothing taken)."""
        if num_pages > len(self.free_pages):
            return None
        free = self.free_pages
        return [free.popleft() for _ in range(num_pages)]

    def free_pages_of(self, pages: list[int]) -> None:
        """Give ``pages`` back (each exactly once), where SGLang puts them (module docstring)."""
        if not pages:
            return
        if self.page_size == 1:
            self.free_pages.extend(pages)
        else:
            self.free_pages.extendleft(reversed(pages))

    def slots(self, pages: list[int]) -> list[int]:
        """The token slots of ``pages``, in order (what SGLang stores in a request's row)."""
        ps = self.page_size
        return [p * ps + i for p in pages for i in range(ps)]
