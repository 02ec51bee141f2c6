"""`pipeline.output` on an object store: the stages run in a local staging directory (the same
files, the same resume), and each finished result is then published to the URL.

Every file goes up under a temporary name and is copied to its real name (data/objstore.py), in
an order that makes a finished set visible last: first the data files, then each token shard set's
`meta.json` (after every shard it lists), then each stage's `_DONE.json`, then `report.json` and
`report.md`. A kill at any moment leaves every file under its real name whole; a shard set without
its `meta.json` is not read as one (data/shards.py, data/remote.py); leftover temporaries are
removed and missing files uploaded by the next run. A file already there with the same size and
contents (the staging copy's hash, kept beside it) is not uploaded again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from ultratron.atomic import cache_dir, is_temp
from ultratron.curation.config import DataPipelineConfig
from ultratron.data.objstore import Remote
from ultratron.data.shards import META, sha256_file
from ultratron.errors import DataError

PUBLISHED = ".published.json"  # in the staging directory: what went up, by relative path → sha256
LAST = ("report.json", "report.md")


def staging_dir(cfg: DataPipelineConfig) -> Path:
    if cfg.pipeline.staging:
        return Path(cfg.pipeline.staging).resolve()
    return cache_dir("curation", hashlib.sha256(cfg.pipeline.output.encode()).hexdigest()[:16]).resolve()


def publish_order(names: list[str]) -> list[str]:
    """Data files, then shard sets' meta.json, then stages' _DONE.json, then the report."""
    def rank(name: str) -> int:
        base = name.rsplit("/", 1)[-1]
        return 3 if name in LAST else 2 if base == "_DONE.json" else 1 if base == META else 0
    return sorted(names, key=lambda n: (rank(n), n))


def publish(staging: Path, url: str, endpoint: str | None, log: Callable[[str], None] = print) -> int:
    """Upload every finished file under `staging` to `url`; returns how many went up."""
    try:
        remote = Remote(url, endpoint)
        present = remote.files()  # one listing of the prefix, for both
        if stale := remote.remove_temp(present):
            log(f"data: removed {len(stale)} half-uploaded object(s) an interrupted run left (e.g. {stale[0]})")
            present = {name: size for name, size in present.items() if name not in stale}
    except (ImportError, ValueError, OSError) as err:
        raise DataError(f"pipeline.output {url!r}: {err}") from None
    record_path = staging / PUBLISHED
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    local = [p.relative_to(staging).as_posix() for p in staging.rglob("*")
             if p.is_file() and not is_temp(p.name) and p.name != PUBLISHED]
    sent = 0
    for name in publish_order(local):
        path = staging / name
        digest = sha256_file(path)
        if record.get(name) == digest and present.get(name) == path.stat().st_size:
            continue
        remote.publish_file(path, remote.child(name))
        record[name] = digest
        sent += 1
        if sent % 50 == 0 or name in LAST:
            record_path.write_text(json.dumps(record))
    record_path.write_text(json.dumps(record))
    return sent


def run_to_object_store(cfg: DataPipelineConfig, run: Callable[[DataPipelineConfig], dict],
                        log: Callable[[str], None] = print) -> dict:
    """`run` (the pipeline) with its output in the staging directory, then published to the URL."""
    url, staging = cfg.pipeline.output.rstrip("/"), staging_dir(cfg)
    local = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, output=str(staging), shared_fs=False))
    log(f"data: staging in {staging}, publishing to {url}")
    report = run(local)
    sent = publish(staging, url, cfg.pipeline.endpoint or None, log)
    log(f"data: published {sent} file(s) to {url}")
    return report
