"""Cache-aware routing over several ``semkv serve`` backends (``semkv route``)."""

from semkv.route.app import RouterConfig, create_router_app
from semkv.route.pool import Backend, BackendPool
from semkv.route.ring import HashRing, affinity_key

__all__ = ["Backend", "BackendPool", "HashRing", "RouterConfig", "affinity_key", "create_router_app"]
