"""What differs between two runs besides their results: the environment recorded in
``run.json`` (:func:`environment_differences`), the resolved suites (:func:`suite_differences`),
and whether the two can be compared at all (:func:`check_comparable`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .results_reader import (
    _csv_path,
)
from .results_writer import (
    read_json,
)

ENV_FIELDS = (
    ("deqbench", "versions.deqbench"),
    ("torch", "versions.torch"),
    ("CUDA", "versions.cuda"),
    ("device", "device"),
    ("device name", "device_name"),
    ("GPUs", "gpus"),
    ("dtype", "dtype"),
    ("threads", "flags.threads"),
    ("TF32 matmul", "flags.tf32_matmul"),
)


def _get(meta: dict[str, Any], dotted: str) -> Any:
    node: Any = meta
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return None
        node = node[k]
    return node


def _commit_text(meta: dict[str, Any]) -> str:
    git = meta.get("git") or {}
    commit = git.get("commit")
    if not commit:
        return "unknown"
    return str(commit)[:10] + (" (dirty)" if git.get("dirty") else "")


def run_environment(meta: dict[str, Any]) -> str:
    """One line about a run from its ``run.json``: commit (dirty), torch, device, dtype, threads
    (the parts it records)."""
    parts = []
    if _get(meta, "git.commit"):
        parts.append(f"commit {_commit_text(meta)}")
    if _get(meta, "versions.torch"):
        parts.append(f"torch {_get(meta, 'versions.torch')}")
    if meta.get("device"):
        name = meta.get("device_name")
        parts.append(f"{meta['device']} ({name})" if name else str(meta["device"]))
    if meta.get("dtype"):
        parts.append(str(meta["dtype"]))
    threads = _get(meta, "flags.threads")
    if threads is not None:
        parts.append(f"{threads} thread{'s' * (threads != 1)}")
    if not meta:
        return "no run.json"
    return ", ".join(parts) or "no environment in run.json"


def environment_differences(meta_a: dict[str, Any], meta_b: dict[str, Any]) -> list[str]:
    """What differs between two runs' ``run.json``: the commit (and dirty tree), versions,
    device, GPU names, dtype, threads; each as ``torch 2.3.0 vs 2.4.0``. A run without
    ``run.json`` gives one line saying so; the same commit with edits on both sides says that
    the edits may differ."""
    if not meta_a or not meta_b:
        missing = " and ".join(s for s, m in (("A", meta_a), ("B", meta_b)) if not m)
        return [f"{missing}: no run.json, environment unknown"]
    out = []
    ga, gb = meta_a.get("git") or {}, meta_b.get("git") or {}
    if ga.get("commit") != gb.get("commit") or ga.get("dirty") != gb.get("dirty"):
        out.append(f"commit {_commit_text(meta_a)} vs {_commit_text(meta_b)}")
    elif ga.get("dirty") and gb.get("dirty"):
        out.append(f"commit {_commit_text(meta_a)} on both sides: uncommitted edits may differ")
    for label, key in ENV_FIELDS:
        va, vb = _get(meta_a, key), _get(meta_b, key)
        if va != vb:
            sa = ", ".join(map(str, va)) if isinstance(va, list) else str(va)
            sb = ", ".join(map(str, vb)) if isinstance(vb, list) else str(vb)
            out.append(f"{label} {sa or '-'} vs {sb or '-'}")
    return out


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> dotted keys; a list of one-key mappings (``analyses``) by those keys."""
    if isinstance(obj, list) and obj and all(isinstance(x, dict) and len(x) == 1 for x in obj):
        obj = {k: v for x in obj for k, v in x.items()}
    if not isinstance(obj, dict):
        return {prefix: obj}
    out: dict[str, Any] = {}
    for k, v in obj.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _run_meta(run: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(run.json or {}, resolved suite.yaml or None) of a run directory (or of a results.csv's)."""
    d = _csv_path(run).parent
    meta = read_json(d / "run.json") if (d / "run.json").exists() else {}
    suite = None
    if (d / "suite.yaml").exists():
        from .yamlio import read_yaml  # its limits refuse a YAML bomb

        suite = read_yaml(d / "suite.yaml")[0] or {}
    return meta, suite


def suite_differences(suite_a: dict[str, Any], suite_b: dict[str, Any]) -> list[str]:
    """Dotted keys where two resolved suites differ (not ``output``, ``description``), each
    with both values where they are short: ``defaults.train.epochs (2 vs 1)``."""
    fa, fb = _flat(suite_a), _flat(suite_b)
    out = []
    for k in sorted(set(fa) | set(fb)):
        if k.split(".")[0] in ("output", "description") or fa.get(k) == fb.get(k):
            continue
        va = repr(fa[k]) if k in fa else "unset"
        vb = repr(fb[k]) if k in fb else "unset"
        out.append(f"{k} ({va} vs {vb})" if len(va) + len(vb) <= 40 else k)
    return out


def check_comparable(
    run_a: str | Path, run_b: str | Path, a: Any, b: Any, force: bool = False
) -> list[str]:
    """Refuse (ConfigError) runs of differently named suites or without a common cell unless
    ``force``; return warning lines (at most one): the suite settings that differ where the two
    runs' suite hashes do, or the difference ``force`` overrode."""
    from ..core.errors import ConfigError

    (ma, sa), (mb, sb) = _run_meta(run_a), _run_meta(run_b)
    name_a = ma.get("suite") or (sa or {}).get("name")
    name_b = mb.get("suite") or (sb or {}).get("name")
    refusals = []
    if name_a and name_b and name_a != name_b:
        refusals.append(f"runs of different suites ({name_a!r} vs {name_b!r})")
    cells_a, cells_b = set(a["cell_id"]), set(b["cell_id"])
    if cells_a and cells_b and not cells_a & cells_b:
        refusals.append(
            f"no cell in common (A: {len(cells_a)}, e.g. {min(cells_a)}; "
            f"B: {len(cells_b)}, e.g. {min(cells_b)})"
        )
    if refusals and not force:
        raise ConfigError(
            f"{run_a} vs {run_b}: {'; '.join(refusals)}; --force compares them anyway"
        )
    keys = suite_differences(sa, sb) if sa is not None and sb is not None else []
    ha, hb = ma.get("suite_hash"), mb.get("suite_hash")
    if refusals:
        return ["compared anyway (--force): " + "; ".join(refusals)]
    if (ha and hb and ha != hb) or ((not ha or not hb) and keys):
        what = ", ".join(keys[:8]) + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")
        if not keys:
            what = "suite.yaml files agree; the resolved cells differ (another deqbench version?)"
        hashes = f" (suite hash {ha} vs {hb})" if ha and hb else ""
        return [f"B ran the suite with other settings than A{hashes}: {what}"]
    return []
