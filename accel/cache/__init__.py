"""The pack's persistent compile cache (see store.py): torch's on-disk caches in a directory the pack owns,
Mega-Cache artifacts per compile key, export/import between machines of the same GPU and torch."""
from .location import ENV_VAR, cache_root
from .portable import export_cache, import_cache
from .store import COMPILE_CACHE, CacheBusy, EnvironmentCache, clear_disk_cache, disk_info

__all__ = ["COMPILE_CACHE", "CacheBusy", "ENV_VAR", "EnvironmentCache", "cache_root", "clear_disk_cache", "disk_info",
           "export_cache", "import_cache"]
