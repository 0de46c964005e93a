"""Finding, reading and validating the validator's three input tables.

Every table is read with an explicit schema (JSONL) or checked against one (Parquet); nothing
is inferred. Problems with the input raise :class:`InputError`, which the job turns into exit
code 2 with the message. The normalised tables use integer microseconds for every time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

CORRUPT = "_corrupt_record"
WRITER_REQUIRED = ("stream", "writer", "stream_id", "room_id", "event_id", "reserved_at",
                   "completed_at", "outcome")
TOKEN_REQUIRED = ("reader", "stream", "token", "issued_at", "delivered")
INSTANCE_REQUIRED = ("instance_id", "instance_name")
TIME_COLUMNS = {"reserved_at", "completed_at", "issued_at", "announced_at", "lost_from", "lost_until"}
KEY_SAMPLE = 10_000

_S, _L, _I = T.StringType(), T.LongType(), T.IntegerType()
_ARR = T.ArrayType(T.StringType())
#: Column types as read; timestamps are read as text from JSONL and as timestamps from Parquet.
TYPES: dict[str, dict[str, T.DataType]] = {
    "writer_logs": {"stream": _S, "writer": _S, "stream_id": _L, "room_id": _S, "event_id": _S,
                    "reserved_at": _S, "completed_at": _S, "outcome": _S, "kind": _S,
                    "from_stream_id": _L, "to_stream_id": _L, "lost_from": _S, "lost_until": _S},
    "token_logs": {"reader": _S, "stream": _S, "seq": _L, "token": _S, "issued_at": _S,
                   "delivered": _ARR, "since": _S, "issued_by": _S, "rooms": _ARR, "kind": _S,
                   "readers": _ARR, "lost_from": _S, "lost_until": _S},
    "instance_map": {"instance_id": _I, "instance_name": _S},
}
REQUIRED = {"writer_logs": WRITER_REQUIRED, "token_logs": TOKEN_REQUIRED,
            "instance_map": INSTANCE_REQUIRED}


class InputError(Exception):
    """The input cannot be validated: missing or unreadable files, missing columns, bad values."""


@dataclass
class Table:
    """One input table as read.

    Attributes:
        name: ``writer_logs``, ``token_logs`` or ``instance_map``.
        path: where it was read from.
        fmt: ``json`` or ``parquet``.
        files: how many data files.
        columns: the columns the input has (for JSONL: seen in the first records).
        df: the raw DataFrame with every column of :data:`TYPES` (absent ones null).
    """

    name: str
    path: str
    fmt: str
    files: int
    columns: set[str]
    df: DataFrame
    stats: dict = field(default_factory=dict)


def _hadoop_files(spark: SparkSession, path: str) -> list[str]:
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    p = jvm.org.apache.hadoop.fs.Path(path)
    fs = p.getFileSystem(conf)
    if not fs.exists(p):
        raise InputError(f"{path} does not exist")
    found = []
    base = fs.makeQualified(p).toUri().getPath().rstrip("/")
    it = fs.listFiles(p, True)
    while it.hasNext():
        st = it.next()
        full = st.getPath().toUri().getPath()
        rel = full[len(base):] if full.startswith(base) else st.getPath().getName()
        # Spark and Hadoop ignore names starting with "." or "_" (_SUCCESS, .crc files).
        if any(part.startswith((".", "_")) for part in rel.split("/") if part):
            continue
        found.append(st.getPath().toString())
    return found


def detect_format(path: str, files: list[str]) -> str:
    """``parquet`` or ``json`` from the file extensions under ``path``.

    Raises:
        InputError: no data files, unknown extensions, or a mixture.
    """
    if not files:
        raise InputError(f"{path} has no data files")
    kinds = set()
    for f in files:
        name = f.rsplit("/", 1)[-1].lower()
        for suffix in (".gz", ".bz2", ".zst", ".deflate"):
            name = name.removesuffix(suffix)
        if name.endswith(".parquet"):
            kinds.add("parquet")
        elif name.endswith((".jsonl", ".json", ".ndjson")):
            kinds.add("json")
        else:
            raise InputError(f"{f}: unknown file type (expected .parquet, .jsonl, .json or .ndjson)")
    if len(kinds) > 1:
        raise InputError(f"{path} mixes Parquet and JSON Lines files; use one format per table")
    return kinds.pop()


def _record_keys(text: DataFrame) -> set[str]:
    """The keys the JSON records of ``text`` (a ``spark.read.text`` frame) have, and its partition columns."""
    keys = text.select(F.explode(F.json_object_keys("value")).alias("k")).distinct().collect()
    return {r.k for r in keys} | (set(text.columns) - {"value"})


def _json_keys(spark: SparkSession, path: str, name: str, files: list[str]) -> set[str]:
    text = spark.read.option("basePath", path).text(files)
    if name == "writer_logs":
        kind = F.get_json_object("value", "$.kind")
        text = text.where(kind.isNull() | (kind == "fact"))
    elif name == "token_logs":  # gap records (spark/gaps.py) carry other columns
        kind = F.get_json_object("value", "$.kind")
        text = text.where(kind.isNull() | (kind != "gap"))
    return _record_keys(text.limit(KEY_SAMPLE))


def read_table(spark: SparkSession, logs: str, name: str) -> Table:
    """Find, check and read one table under ``logs``.

    Raises:
        InputError: missing files or required columns, or unreadable Parquet footers.
    """
    path = logs.rstrip("/") + "/" + name
    files = _hadoop_files(spark, path)
    fmt = detect_format(path, files)
    types = TYPES[name]
    # Read the files found (not the directory): writers lay files out in
    # plain per-instance subdirectories (writer_logs/<instance>/part-*.jsonl),
    # which a directory read would skip; basePath keeps stream=<name>
    # partition directories working.
    try:
        if fmt == "json":
            columns = _json_keys(spark, path, name, files)
            schema = T.StructType([T.StructField(c, t) for c, t in types.items()]
                                  + [T.StructField(CORRUPT, _S)])
            df = (spark.read.schema(schema).option("mode", "PERMISSIVE").option("basePath", path)
                  .option("columnNameOfCorruptRecord", CORRUPT).json(files))
        else:
            raw = spark.read.option("basePath", path).parquet(*files)
            columns = set(raw.columns)
            df = _parquet_select(raw, name, path)
    except InputError:
        raise
    except Exception as e:  # Spark raises several types for unreadable input.
        raise InputError(f"cannot read {path}: {first_line(e)}") from e
    if fmt == "json" and not columns - set(spark.read.option("basePath", path).text(files).columns):
        raise InputError(f"{path}: no records (the table is empty)")
    missing = [c for c in REQUIRED[name] if c not in columns]
    if missing:
        raise InputError(f"{path}: missing column(s) {', '.join(missing)} "
                         f"(found: {', '.join(sorted(columns)) or 'none'})")
    return Table(name, path, fmt, len(files), columns, df)


def _parquet_select(raw: DataFrame, name: str, path: str) -> DataFrame:
    have = {f.name: f.dataType for f in raw.schema.fields}
    cols = []
    for c, t in TYPES[name].items():
        if c not in have:
            cols.append(F.lit(None).cast(t).alias(c))
            continue
        got = have[c]
        if c in TIME_COLUMNS:
            if not isinstance(got, T.TimestampType | T.TimestampNTZType | T.LongType):
                raise InputError(f"{path}: column {c} is {got.simpleString()}, expected timestamp")
            cols.append(F.col(c).alias(c))
        elif isinstance(t, T.LongType | T.IntegerType) and isinstance(got, T.LongType | T.IntegerType | T.ShortType):
            cols.append(F.col(c).cast(t).alias(c))
        elif got != t:
            raise InputError(f"{path}: column {c} is {got.simpleString()}, expected {t.simpleString()}")
        else:
            cols.append(F.col(c))
    return raw.select(*cols)


def first_line(e: Exception) -> str:
    """The first line of an exception's message (a Java exception's own message for Py4J errors)."""
    java = getattr(e, "java_exception", None)
    text = (str(java.getMessage()) if java is not None else str(e)).strip()
    return text.splitlines()[0][:500] if text else type(e).__name__


def micros(df: DataFrame, c: str) -> Column:
    """Integer µs for a time column: a Parquet timestamp/long, or JSONL integer or ISO-8601 text."""
    t = df.schema[c].dataType
    if isinstance(t, T.TimestampType | T.TimestampNTZType):
        return F.unix_micros(F.col(c).cast(T.TimestampType()))
    if isinstance(t, T.LongType):
        return F.col(c)
    s = F.trim(F.col(c))
    return (F.when(s.rlike("^-?[0-9]+$"), s.try_cast("bigint"))
            .otherwise(F.unix_micros(F.expr(f"try_to_timestamp(trim(`{c}`))"))))


def convert_to_parquet(spark: SparkSession, src: str, dst: str) -> None:
    """Rewrite a JSONL log directory as Parquet (timestamps as timestamps, ``stream=`` kept).

    Only the columns some record of a table has are written: a column no record has (``seq`` in
    a token log written without it) stays absent rather than becoming a column of nulls, which
    the validator would refuse.

    Args:
        spark: the session.
        src: a directory with ``writer_logs``, ``token_logs`` and ``instance_map``.
        dst: the directory to write (overwritten).
    """
    extra = {"writer_logs": {"position": _L, "announced_at": _S}}
    for name, types in TYPES.items():
        types = {**types, **extra.get(name, {})}
        path = f"{src}/{name}"
        schema = T.StructType([T.StructField(c, t) for c, t in types.items()])
        df = spark.read.schema(schema).json(path)
        text = spark.read.text(path)
        partitioned = "stream" in text.columns
        present = _record_keys(text)  # every record's keys, gap records' included
        out = df.select(*[F.timestamp_micros(micros(df, c)).alias(c) if c in TIME_COLUMNS else F.col(c)
                          for c in df.columns if c in present])
        writer = out.write.mode("overwrite").option("compression", "zstd")
        if partitioned:
            writer = writer.partitionBy("stream")
        writer.parquet(f"{dst}/{name}")
