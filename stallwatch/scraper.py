"""Who is scraping: the agent's web server names the scraper of each request, a collector may read it.

Prometheus stores a series' samples only in time order, so samples with their own timestamps (the
correlator's windows) go to each scraper once: an HA pair of Prometheus replicas, or any second
scraper, must each get every window, not the ones the other left. A scraper is known by its address,
the address it scraped and its User-Agent; collectors run in the scrape's context (`contextvars`). Scrapes
that overlap share a running call of a collector (`ScrapeCollector`), unless it says `per_scraper`: then
only the same scraper's do.
"""

from __future__ import annotations

from contextvars import ContextVar

SCRAPER: ContextVar[str] = ContextVar("scraper", default="")
