"""Parquet records: one file per (case, request, repeat), written atomically, resumable.

Owns: the on-disk layout of results, writing a row so that a crash never leaves a partial
file (temporary file in the same folder, then an atomic rename), knowing which rows of a
case are complete (so a rerun skips them and writes each row once), and reading a results
tree back as one DataFrame. Figures and tables read results through `load` only.
Does not own: what goes into a row (runner.py).

Layout: <out_dir>/records/<case_id>/<request_id>__r<repeat>.parquet, plus case.json with the
case's configuration. A case is everything that determines the measurement (model, budget,
system, dataset, hardware, workload, seed); workers sweeping different cases into one tree
never write the same path, and two runs of one case write a row at most once.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq


def case_id(case: dict[str, Any]) -> str:
    """Stable id of a case's configuration (`case` must be JSON-serialisable)."""
    blob = json.dumps(case, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class CaseStore:
    def __init__(self, out_dir: str | Path, case: dict[str, Any]):
        self.case = case
        self.case_id = case_id(case)
        self.dir = Path(out_dir) / "records" / self.case_id

    def row_path(self, request_id: str, repeat: int) -> Path:
        return self.dir / f"{request_id}__r{repeat}.parquet"

    def done(self, request_id: str, repeat: int) -> bool:
        return self.row_path(request_id, repeat).exists()

    def write(self, row: dict[str, Any]) -> Path:
        """Write one row atomically, at most once: FileExistsError when the row is already
        recorded, also when a concurrent writer of the same row published it first."""
        self.dir.mkdir(parents=True, exist_ok=True)
        manifest = self.dir / "case.json"
        if not manifest.exists():
            _atomic_write_bytes(manifest, json.dumps(self.case, indent=2, sort_keys=True,
                                                     default=str).encode())
        path = self.row_path(row["request_id"], row["repeat"])
        if path.exists():
            raise FileExistsError(f"row already recorded: {path}")
        table = pa.Table.from_pylist([row])
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".parquet")
        os.close(fd)
        try:
            pq.write_table(table, tmp)
            # Publish without replacing: of two workers finishing the same row at once (one
            # case run twice, possibly on two machines sharing the folder) exactly one link
            # succeeds; the other gets FileExistsError, as for a row recorded earlier.
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise FileExistsError(f"row already recorded: {path}") from None
            except OSError:  # a file system without hard links: last writer wins, whole
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def row_files(out_dir: str | Path) -> list[Path]:
    return sorted(p for p in (Path(out_dir) / "records").glob("*/*.parquet")
                  if not p.name.startswith(".tmp-"))


def load(out_dir: str | Path) -> pd.DataFrame:
    """Every completed row under `out_dir` as one DataFrame (columns are the union)."""
    files = row_files(out_dir)
    if not files:
        return pd.DataFrame()
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)
