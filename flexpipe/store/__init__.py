"""The store: gear table, calibrated factor sets, instances and shift log in SQLite (or any
SQLAlchemy URL)."""

from flexpipe.store.store import STORE_ENV, Store, StoreError, default_store_url

__all__ = ["STORE_ENV", "Store", "StoreError", "default_store_url"]
