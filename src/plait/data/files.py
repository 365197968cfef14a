"""A user's document files: ``data.path`` resolved to files, cut into units, read with pyarrow.

``data.path`` is a file, a directory (every supported file under it, recursively) or a glob. The format
comes from the suffix:

* ``.parquet``: the ``data.text_field`` column; one unit per row group.
* ``.jsonl`` / ``.json``: JSON Lines (one object per line), the ``data.text_field`` key; one unit per file.
* ``.arrow``: an Arrow IPC file (random access; one unit per record batch) or stream (Hugging Face
  ``datasets`` writes these; one unit per file), the ``data.text_field`` column.
* ``.txt``: one document per line (empty lines skipped, as Hugging Face's ``text`` loader reads them
  with ``sample_by="line"``); one unit per file.

Everything is read by pyarrow (the ``data`` extra); nothing here parses a format by hand. A unit is the
smallest piece that is read at once: the streaming reader deals units to data-parallel ranks, the token
cache tokenises them in parallel. Files are sorted by path, so unit ids are the same on every rank.
A document's id is ``file_index << 40 | row`` (its row within the file), unique in the data set.
"""

from __future__ import annotations

import glob
import hashlib
from dataclasses import dataclass
from pathlib import Path

from plait.data.errors import DataError

FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".arrow": "arrow", ".txt": "txt"}
ROW_BITS = 40  # doc id = file_index << ROW_BITS | row


def require_pyarrow() -> None:
    """Raise a ``DataError`` naming the extra when pyarrow is missing."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise DataError("reading Parquet, JSON Lines, Arrow or text files needs pyarrow: pip install 'plait[data]' "
                        "(or pip install pyarrow)") from None


@dataclass(frozen=True)
class Unit:
    """A piece of one file read at once: a Parquet row group, an Arrow record batch, or a whole file."""

    file: int  # index into DataFiles.paths
    part: int  # row group / record batch index (0 for whole-file units)
    first_row: int  # the unit's first row within its file
    num_rows: int  # -1 when unknown before reading (JSON Lines, text, Arrow streams)


def _consecutive_units(file: int, rows: list[int]) -> list[Unit]:
    """One unit per row group / record batch of ``file``, holding ``rows[j]`` rows from the running start."""
    units, start = [], 0
    for j, n in enumerate(rows):
        units.append(Unit(file, j, start, n))
        start += n
    return units


def resolve_paths(spec: str) -> list[Path]:
    """The supported files ``spec`` names (a file, a directory searched recursively, or a glob), sorted."""
    p = Path(spec)
    if p.is_dir():
        found = [f for f in p.rglob("*") if f.is_file() and f.suffix in FORMATS and ".plait-cache" not in f.parts]
    elif p.is_file():
        found = [p]
    else:
        found = [Path(f) for f in glob.glob(spec, recursive=True) if Path(f).is_file()]
    supported = sorted(f for f in found if f.suffix in FORMATS)
    if not supported:
        other = f" (found {len(found)} file(s) of other kinds, e.g. {found[0].name})" if found else ""
        raise DataError(f"data path {spec!r} matches no .parquet, .jsonl, .json, .arrow or .txt file{other}; "
                        "point data.path at a file, a directory or a glob of those")
    return supported


def file_digest(path: Path) -> str:
    """A content hash of ``path`` (BLAKE2b, 16 bytes): what the token cache is keyed by."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


class DataFiles:
    """The files of ``data.path`` and their units; ``read(unit)`` returns the unit's texts.

    Construction opens every Parquet and Arrow file's metadata (not its data), so a corrupt file or a
    missing ``text_field`` is reported before training starts, naming the file and the columns found.
    """

    def __init__(self, spec: str, text_field: str = "text") -> None:
        require_pyarrow()
        self.spec, self.text_field = spec, text_field
        self.paths = resolve_paths(spec)
        self.units: list[Unit] = []
        for i, path in enumerate(self.paths):
            self.units.extend(self._units_of(i, path))

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_open"}  # an open file stays in its process

    def format(self, file: int) -> str:
        return FORMATS[self.paths[file].suffix]

    def _units_of(self, i: int, path: Path) -> list[Unit]:
        fmt = FORMATS[path.suffix]
        if fmt == "parquet":
            meta = self._parquet(path).metadata
            self._check_columns(path, meta.schema.names)
            return _consecutive_units(i, [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        if fmt == "arrow":
            reader, random_access = self._arrow(path)
            self._check_columns(path, reader.schema.names)
            if not random_access:
                return [Unit(i, 0, 0, -1)]
            return _consecutive_units(i, [reader.get_batch(b).num_rows for b in range(reader.num_record_batches)])
        if fmt == "jsonl":
            self._check_columns(path, self._jsonl_columns(path))
        return [Unit(i, 0, 0, -1)]

    def _check_columns(self, path: Path, names: list[str]) -> None:
        if self.text_field not in names:
            raise DataError(f"{path} has no column {self.text_field!r} (columns found: {', '.join(names) or 'none'}); "
                            "set data.text_field to the column that holds the text")

    def _parquet(self, path: Path):
        import pyarrow.parquet as pq

        if getattr(self, "_open", (None,))[0] == path:  # consecutive row groups of one file: one footer read
            return self._open[1]
        try:
            self._open = (path, pq.ParquetFile(path))
            return self._open[1]
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a damaged file
            raise DataError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e}); replace or remove it "
                            "from data.path") from None

    @staticmethod
    def _arrow(path: Path):
        import pyarrow as pa
        import pyarrow.ipc as ipc

        try:
            return ipc.open_file(pa.memory_map(str(path))), True
        except Exception:  # not the random-access file format: try the stream format (Hugging Face datasets)
            try:
                return ipc.open_stream(pa.memory_map(str(path))), False
            except Exception as e:
                raise DataError(f"{path} is not a readable Arrow IPC file or stream ({e}); replace or remove it from "
                                "data.path") from None

    @staticmethod
    def _jsonl_columns(path: Path) -> list[str]:
        import pyarrow.json as pj

        try:
            reader = pj.open_json(path)
            return list(reader.schema.names)
        except Exception as e:
            raise DataError(f"{path} is not readable JSON Lines ({type(e).__name__}: {e}); a .json/.jsonl file must "
                            "hold one JSON object per line") from None

    def read(self, unit: Unit) -> list[str]:
        """The texts of ``unit`` in row order (a null text reads as an empty document)."""
        path = self.paths[unit.file]
        fmt = FORMATS[path.suffix]
        try:
            if fmt == "parquet":
                column = self._parquet(path).read_row_group(unit.part, columns=[self.text_field]).column(0)
            elif fmt == "arrow":
                reader, random_access = self._arrow(path)
                table = reader.get_batch(unit.part) if random_access else reader.read_all()
                column = table.column(self.text_field)
            elif fmt == "jsonl":
                import pyarrow.json as pj

                table = pj.read_json(path)
                self._check_columns(path, table.schema.names)
                column = table.column(self.text_field)
            else:
                return self._read_lines(path)
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{path} could not be read ({type(e).__name__}: {e}); replace or remove it from "
                            "data.path") from None
        return ["" if t is None else str(t) for t in column.to_pylist()]

    @staticmethod
    def _read_lines(path: Path) -> list[str]:
        import pyarrow as pa

        with pa.memory_map(str(path)) as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it") from None
        return [line for line in text.splitlines() if line.strip()]

    def doc_id(self, unit: Unit, row_in_unit: int) -> int:
        """The data-set-wide id of row ``row_in_unit`` of ``unit``."""
        return unit.file << ROW_BITS | (unit.first_row + row_in_unit)

    def describe(self) -> str:
        kinds = sorted({FORMATS[p.suffix] for p in self.paths})
        return f"{len(self.paths)} {'/'.join(kinds)} file(s) under {self.spec}"
