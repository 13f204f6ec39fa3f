"""Shared inputs of the fine-tuning data tests: a chat tokenizer (BPE with ChatML's special
tokens and template, from ``examples/sft_example.py``) and records in every source format."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from helpers import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import sft_example

__all__ = ["chat_dir", "sft_example", "write_sources"]


def chat_dir(directory: Path, n: int = 300, *, template: str = sft_example.CHATML):
    """``(tokenizer.json, conversations)``: ``n`` arithmetic chats and a tokenizer for them."""
    rows = sft_example.conversations(n)
    texts = [m["content"] for row in rows for m in row["messages"]]
    return sft_example.chat_tokenizer(directory, texts, template=template), rows


def write_sources(directory: Path, rows: list[dict]) -> dict[str, Path]:
    """``rows`` as JSONL (plain, gzip, zstd), Parquet, Arrow (file and stream) and a
    ``datasets.save_to_disk`` directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    directory.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    out = {"jsonl": directory / "d.jsonl", "gz": directory / "d.jsonl.gz",
           "zst": directory / "d.jsonl.zst", "parquet": directory / "d.parquet",
           "arrow": directory / "d.arrow", "hf": directory / "hf"}
    out["jsonl"].write_bytes(lines)
    out["gz"].write_bytes(gzip.compress(lines))
    out["zst"].write_bytes(zstandard.ZstdCompressor().compress(lines))
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, out["parquet"], row_group_size=max(1, len(rows) // 3))
    with pa.OSFile(str(out["arrow"]), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=50)
    out["hf"].mkdir()  # as datasets' save_to_disk: Arrow streams listed in state.json
    with pa.OSFile(str(out["hf"] / "data-00000-of-00001.arrow"), "wb") as f, \
            pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=64)
    (out["hf"] / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": None}))
    (out["hf"] / "dataset_info.json").write_text("{}")
    return out
