"""An on-disk cache of per-config results (matrix rows, lint coverage) keyed by rule set and config.

One sqlite file per (rule-set content hash, moerules code fingerprint): the same rules decide
the same way only under the same code, so an edit of the engine starts a fresh file instead of
serving stale rows. Inside, a row is keyed by a digest of (evaluator, task, canonical config
JSON). sqlite in WAL mode lets two tools (say `matrix` and `diff`) write at once. At most
`MAX_FILES` files are kept (least recently opened go first), so the folder stays bounded and
deleting it is always safe. A corrupt file is never fatal: it is reported once and rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sqlite3
from pathlib import Path
from typing import Iterable, Optional

from pydantic import BaseModel

from moerules import config
from moerules.engine import decide

log = logging.getLogger("moerules")
CACHE_ENV = "MOERULES_CACHE_DIR"
MAX_FILES = 16
_BATCH = 900   # under sqlite's oldest bound-parameter limit (999)
_SCHEMA = "CREATE TABLE IF NOT EXISTS entries (key BLOB PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID"


def default_root() -> Path:
    """$MOERULES_CACHE_DIR, else $XDG_CACHE_HOME/moerules/decisions, else ~/.cache/moerules/decisions."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moerules" / "decisions"


def config_key(config: BaseModel) -> str:
    """The config's JSON: equal configs, equal text, in any process (fields in declaration order,
    sets serialised sorted by the models themselves)."""
    return config.model_dump_json()


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """Digest of the sources a decision depends on (the vocabulary and the engine)."""
    digest = hashlib.sha256()
    for folder in (Path(config.__file__).parent, Path(decide.__file__).parent):
        for source in sorted(folder.glob("*.py")):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


class DecisionCache:
    """Results of one task under one rule set and evaluator; `None` root = no cache (always misses)."""

    def __init__(self, root: Optional[Path], rules_hash: str, evaluator: str, task: str):
        self.prefix = f"{evaluator}\0{task}\0".encode()
        self.path = Path(root) / f"{rules_hash[:24]}-{code_fingerprint()[:12]}.sqlite" if root else None
        self._db: Optional[sqlite3.Connection] = None

    def get_many(self, keys: Iterable[str]) -> dict[str, dict]:
        digests = {k: self._digest(k) for k in keys}
        found = self._guarded(self._read, list(digests.values())) or {}
        return {k: found[d] for k, d in digests.items() if d in found}

    def put_many(self, values: dict[str, dict]) -> None:
        self._guarded(self._write, [(self._digest(k), json.dumps(v, sort_keys=True)) for k, v in values.items()])

    def _digest(self, key: str) -> bytes:
        return hashlib.blake2b(self.prefix + key.encode(), digest_size=16).digest()

    def _read(self, digests: list[bytes]) -> dict[bytes, dict]:
        found, db = {}, self._connect()
        for start in range(0, len(digests), _BATCH):
            batch = digests[start:start + _BATCH]
            query = f"SELECT key, value FROM entries WHERE key IN ({','.join('?' * len(batch))})"
            found.update((digest, json.loads(value)) for digest, value in db.execute(query, batch))
        return found

    def _write(self, items: list) -> None:
        with self._connect() as db:
            db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?)", items)

    def _guarded(self, operation, argument):
        """Run a read or write; a damaged file is reported, removed and rebuilt, never fatal."""
        if self.path is None:
            return None
        try:
            return operation(argument)
        except sqlite3.OperationalError as error:
            if "locked" not in str(error):
                return self._rebuilt(operation, argument, error)
            log.warning("moerules: decision cache %s stayed locked; going on without it (%s)", self.path, error)
        except (sqlite3.DatabaseError, ValueError, OSError) as error:
            return self._rebuilt(operation, argument, error)
        return None

    def _rebuilt(self, operation, argument, error: Exception):
        log.warning("moerules: decision cache %s is unusable (%s); rebuilding it", self.path, error)
        try:
            self._discard()
            return operation(argument)
        except (sqlite3.DatabaseError, ValueError, OSError) as again:
            log.warning("moerules: decision cache disabled for this run (%s)", again)
            self.path = None
            return None

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _evict(self.path)
            self._db = sqlite3.connect(self.path, timeout=60)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)
        return self._db

    def _discard(self) -> None:
        self.close()
        _remove(self.path)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _evict(current: Path) -> None:
    """Keep the folder bounded: mark `current` as recently used, drop the oldest files beyond MAX_FILES."""
    if current.exists():
        os.utime(current)
    others = sorted((f for f in current.parent.glob("*.sqlite") if f != current), key=_mtime, reverse=True)
    for stale in others[MAX_FILES - 1:]:
        _remove(stale)


def _mtime(file: Path) -> float:
    try:
        return file.stat().st_mtime
    except FileNotFoundError:  # another process evicted it meanwhile
        return 0.0


def _remove(file: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(str(file) + suffix).unlink(missing_ok=True)
