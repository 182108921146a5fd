"""Parquet records: one file per (case, request, repeat), written atomically, resumable.

Owns: the on-disk layout of results, writing a row so that a crash never leaves a partial
file (temporary file in the same folder, then an atomic rename), knowing which rows of a
case are complete (so a rerun skips them and writes each row once), and reading a results
tree back as one DataFrame. Figures and tables read results through `load` only.
Does not own: what goes into a row (runner.py).

Layout: <out_dir>/records/<case_id>/<request_id>__r<repeat>.parquet, plus case.json with the
case's configuration. A row counts as done only if it reads back (valid parquet holding its
own request_id and repeat); an unreadable row file is moved to <case_id>/quarantine/ with one
warning line and recomputed by the rerun, and temporary files of a killed writer are removed
when the case runs again. `load` skips unreadable or foreign files with one warning line. A case is everything that determines the measurement (model, budget,
system, dataset, hardware, workload, seed); workers sweeping different cases into one tree
never write the same path, and two runs of one case write a row at most once.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq


def case_id(case: dict[str, Any]) -> str:
    """Stable id of a case's configuration (`case` must be JSON-serialisable)."""
    blob = json.dumps(case, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


KEY_COLUMNS = ("request_id", "repeat")  # every row holds its own key
STALE_TMP_S = 3600.0  # a temp file this old is a dead writer's, whichever machine wrote it


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def read_row_file(path: Path) -> pd.DataFrame | None:
    """The rows of one record file, or None when it is not a readable record (not parquet,
    truncated, or without the key columns)."""
    try:
        df = pq.read_table(path).to_pandas()
    except Exception:  # noqa: BLE001 (pyarrow raises several kinds for a damaged file)
        return None
    if any(c not in df.columns for c in KEY_COLUMNS) or df.empty:
        return None
    return df


def _tmp_prefix() -> str:
    return f".tmp-{socket.gethostname()}-{os.getpid()}-"


def _writer_alive(name: str) -> bool:
    """Whether the writer of temp file `name` may still be running: another machine's (until
    it is STALE_TMP_S old), or a live process on this one."""
    parts = name.split("-")
    if len(parts) < 4 or parts[1] != socket.gethostname():
        return True
    try:
        os.kill(int(parts[2]), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


class CaseStore:
    def __init__(self, out_dir: str | Path, case: dict[str, Any], warn=_warn):
        self.case = case
        self.case_id = case_id(case)
        self.dir = Path(out_dir) / "records" / self.case_id
        self.warn = warn
        self._clean_temp_files()

    def _clean_temp_files(self) -> None:
        """Remove the temp files of writers that died mid-row (a killed run)."""
        if not self.dir.is_dir():
            return
        now = time.time()
        for tmp in self.dir.glob(".tmp-*"):
            try:
                if not _writer_alive(tmp.name) or now - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink()
            except FileNotFoundError:  # its writer finished meanwhile
                pass

    def row_path(self, request_id: str, repeat: int) -> Path:
        return self.dir / f"{request_id}__r{repeat}.parquet"

    def done(self, request_id: str, repeat: int) -> bool:
        """The row is recorded and reads back; an unreadable one is quarantined (and so not
        done: the rerun computes it again)."""
        path = self.row_path(request_id, repeat)
        if not path.exists():
            return False
        df = read_row_file(path)
        if df is not None and str(df["request_id"].iloc[0]) == request_id \
                and int(df["repeat"].iloc[0]) == repeat:
            return True
        self.quarantine(path)
        return False

    def quarantine(self, path: Path) -> None:
        """Move an unreadable row file aside (<case>/quarantine/), one warning line."""
        aside = self.dir / "quarantine"
        aside.mkdir(exist_ok=True)
        target = aside / f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}"
        try:
            os.replace(path, target)
        except FileNotFoundError:  # a concurrent worker moved it first
            return
        self.warn(f"unreadable record {path} moved to {target}; this run computes the row again")

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
        tmp = None
        try:  # from the temp file's creation on: an interrupt anywhere leaves no temp file
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=_tmp_prefix(), suffix=".parquet")
            os.close(fd)
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
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        return path


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_tmp_prefix())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def row_files(out_dir: str | Path) -> list[Path]:
    return sorted(p for p in (Path(out_dir) / "records").glob("*/*.parquet")
                  if not p.name.startswith(".tmp-"))


def load(out_dir: str | Path, warn=_warn) -> pd.DataFrame:
    """Every completed row under `out_dir` as one DataFrame (columns are the union); files
    that are not readable records are skipped with one warning line naming them."""
    frames, bad = [], []
    for f in row_files(out_dir):
        df = read_row_file(f)
        (bad.append(f) if df is None else frames.append(df))
    if bad:
        warn(f"skipped {len(bad)} unreadable or foreign record file(s) under {out_dir}: "
             + ", ".join(str(p) for p in bad))
    if not frames:
        return pd.DataFrame()
    return pd.concat(frames, ignore_index=True)
